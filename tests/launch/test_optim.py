"""The trainer's gradient clipping (``dtq.launch.optim.clip_grad_norm``): torch's clipping, and for
a fused Adam / AdamW the same factor handed to the optimizer's step (``grad_scale``) instead of a
pass of its own over every gradient."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dtq.launch import optim
from dtq.testing import spawn

# The fused step divides each gradient by (norm + 1e-6) / max_norm where clipping multiplies it by
# max_norm / (norm + 1e-6): each path rounds twice (its factor, then the product or quotient), so
# the two results may differ by about 4 x 2^-24 relative. Parameters: lr 0.1 times that difference
# of an update whose gradient-driven part is below 1 in magnitude (eps = 1), hence atol 1e-7.
FOLD_RTOL = 2.0**-22


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _backward(model: torch.nn.Module, scale: float) -> None:
    torch.manual_seed(1)
    (model(torch.randn(12, 16)) * scale).square().sum().backward()


def test_without_an_optimizer_it_is_torchs_clipping_bitwise():
    ours, torchs = _model(), _model()
    for m in (ours, torchs):
        _backward(m, 10.0)
    norm = optim.clip_grad_norm(ours.parameters(), 1.0)
    expected = torch.nn.utils.clip_grad_norm_(torchs.parameters(), 1.0)
    assert torch.equal(norm, expected)
    for a, b in zip(ours.parameters(), torchs.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("scale", [10.0, 1e-3], ids=["clipped", "under_the_norm"])
def test_a_fused_adamw_takes_the_factor_in_its_step(scale):
    folded, separate = _model(), _model()
    opt_f = torch.optim.AdamW(folded.parameters(), lr=0.1, eps=1.0, fused=True)  # eps 1: updates follow |g|
    opt_s = torch.optim.AdamW(separate.parameters(), lr=0.1, eps=1.0, fused=True)
    for m in (folded, separate):
        _backward(m, scale)
    before = [p.grad.clone() for p in folded.parameters()]
    norm = optim.clip_grad_norm(folded.parameters(), 1.0, opt_f)
    assert all(torch.equal(b, p.grad) for b, p in zip(before, folded.parameters())), "the gradients were scaled"
    assert hasattr(opt_f, "grad_scale")
    optim.step(opt_f)
    assert not hasattr(opt_f, "grad_scale"), "the factor outlived its step"
    torch.nn.utils.clip_grad_norm_(separate.parameters(), 1.0)
    opt_s.step()
    assert norm > 1.0 if scale > 1 else norm < 1.0
    for a, b in zip(folded.parameters(), separate.parameters(), strict=True):
        if scale < 1:  # a factor of 1: the same division by one as no clipping at all
            assert torch.equal(a.grad, b.grad) and torch.equal(a, b)
        else:  # the fused step leaves the gradients it used in .grad
            torch.testing.assert_close(a.grad, b.grad, rtol=FOLD_RTOL, atol=0)
            torch.testing.assert_close(a.detach(), b.detach(), rtol=FOLD_RTOL, atol=1e-7)


def test_an_unfused_optimizer_gets_the_gradients_clipped():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    _backward(model, 10.0)
    optim.clip_grad_norm(model.parameters(), 1.0, opt)
    assert not hasattr(opt, "grad_scale")
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    torch.testing.assert_close(total, torch.tensor(1.0), rtol=1e-5, atol=0)  # clipped to max_norm


def test_a_factor_someone_else_set_is_left_alone():
    """A ``GradScaler`` (or a user) set ``grad_scale`` already: clipping scales the gradients
    itself and the factor stays as it was."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    opt.grad_scale = torch.tensor(1024.0)
    _backward(model, 10.0)
    optim.clip_grad_norm(model.parameters(), 1.0, opt)
    assert opt.grad_scale.item() == 1024.0
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    torch.testing.assert_close(total, torch.tensor(1.0), rtol=1e-5, atol=0)  # clipped to max_norm


def test_step_clears_the_factor_also_when_the_step_raises():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    _backward(model, 10.0)
    optim.clip_grad_norm(model.parameters(), 1.0, opt)

    def fail(*args, **kwargs):
        raise RuntimeError("step failed")

    opt.step = fail
    with pytest.raises(RuntimeError, match="step failed"):
        optim.step(opt)
    assert not hasattr(opt, "grad_scale")


def _fsdp2_fused_clip(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    folded, separate = _model(), _model()
    for m in (folded, separate):
        for layer in (m[0], m[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    opt_f, opt_s = (torch.optim.AdamW(m.parameters(), lr=0.1, eps=1.0, fused=True) for m in (folded, separate))
    for m in (folded, separate):
        _backward(m, 10.0)
    optim.clip_grad_norm(folded.parameters(), 1.0, opt_f)
    optim.step(opt_f)
    optim.clip_grad_norm(separate.parameters(), 1.0)
    opt_s.step()
    for a, b in zip(folded.parameters(), separate.parameters(), strict=True):
        assert type(a.grad).__name__ == "DTensor"
        torch.testing.assert_close(a.grad.to_local(), b.grad.to_local(), rtol=FOLD_RTOL, atol=0)
        torch.testing.assert_close(a.to_local().detach(), b.to_local().detach(), rtol=FOLD_RTOL, atol=1e-7)


def test_fsdp2s_fused_step_takes_the_factor():
    """DTensor gradients and parameters take the plain factor tensor (each rank's shard clipped by
    the norm over all of them)."""
    spawn(_fsdp2_fused_clip, 2, backend="gloo")
