"""Delayed-scaling histories shared across ranks: ``dtq.autocast(amax_group=...)`` MAX-reduces
each step's current amaxes over the group (one all-reduce after the forward, one at the end of
backward), so every rank holds the same histories, the values of the whole global batch. Real
processes, gloo."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint

import dtq
from dtq.testing import spawn

H = 64


def _model():
    torch.manual_seed(0)  # the same weights on every rank
    return torch.nn.Sequential(dtq.nn.Linear(H, 2 * H, name="a"), torch.nn.GELU(), dtq.nn.Linear(2 * H, H, name="b"))


def _histories(model) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if "amax_history_" in n}


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _steps(rank, world, reduce: bool, recompute: str | None):
    model = _model()
    recipe = dtq.DelayedScaling(amax_history_len=4)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(3):
        x = torch.randn(16, H, generator=g) * (1 + 3 * rank) * (step + 1)  # ranks see different magnitudes
        with (
            dtq.autocast(recipe, amax_group=dist.group.WORLD if reduce else None),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            if recompute is None:
                y = model(x)
            else:
                y = torch.utils.checkpoint.checkpoint(model, x.requires_grad_(), use_reentrant=recompute == "reentrant")
        if step == 0:  # without a group, dtq says once that the histories stay per rank
            said = any("without dtq.autocast(..., amax_group=...)" in str(w.message) for w in caught)
            assert said != reduce, [str(w.message) for w in caught]
        (y.float() * torch.linspace(-1, 1, H)).sum().backward()
        hist = _histories(model)
        whole_x = torch.cat(_gathered(x.detach()))
        if reduce:
            for name, h in hist.items():  # bitwise the same on every rank
                assert all(torch.equal(h, o) for o in _gathered(h)), (step, name)
            # the first GEMM's input amax is the whole global batch's
            assert torch.equal(hist["0.amax_history_0_input"][0], whole_x.abs().amax()), step
        else:  # without the group each rank keeps its own (so the test above can fail)
            assert not torch.equal(hist["0.amax_history_0_input"][0], whole_x.abs().amax()) or rank == world - 1


@pytest.mark.parametrize("recompute", [None, "non_reentrant", "reentrant"])
def test_histories_agree_across_ranks(recompute):
    spawn(_steps, 2, True, recompute, backend="gloo")


def test_without_a_group_histories_stay_per_rank():
    spawn(_steps, 2, False, None, backend="gloo")


def _reused_module(rank, world):
    """One module called twice per step (a reused layer): both of its entries of the step are
    reduced, and its second call's scale uses only shared entries."""
    torch.manual_seed(0)
    lin = dtq.nn.Linear(H, H)
    recipe = dtq.DelayedScaling(amax_history_len=4)
    g = torch.Generator().manual_seed(7 + rank)
    calls = []
    real = dist.all_reduce

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    dist.all_reduce = counting
    try:
        for step in range(3):
            x1, x2 = (torch.randn(8, H, generator=g) * (1 + 5 * rank) for _ in range(2))
            with dtq.autocast(recipe, amax_group=dist.group.WORLD):
                y = lin(x1) + lin(x2)
            y.sum().backward()
            for name, h in _histories(lin).items():
                assert all(torch.equal(h, o) for o in _gathered(h)), (step, name, h)
            inp = lin.amax_history_0_input
            assert torch.equal(inp[1], torch.cat(_gathered(x1)).abs().amax())  # the first call's entry
            assert torch.equal(inp[0], torch.cat(_gathered(x2)).abs().amax())
    finally:
        dist.all_reduce = real
    # one all-reduce after each forward, one at the end of each backward (plus the test's own gathers: none)
    assert len(calls) == 2 * 3, len(calls)
    import copy
    import pickle

    for clone in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):  # no process group is captured
        assert clone.gemm_state.amax_sync is None
        assert torch.equal(clone.amax_history_0_input, lin.amax_history_0_input)


def test_module_called_twice_per_step():
    spawn(_reused_module, 2, backend="gloo")


def test_amax_group_needs_torch_distributed():
    with (
        pytest.raises(RuntimeError, match="torch.distributed is not initialized"),
        dtq.autocast(dtq.DelayedScaling(), amax_group=object()),
    ):
        pass
