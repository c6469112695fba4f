"""``dtq.optim.on_local_shards``: torch's fused Adam / AdamW over DTensors run on the local shards
with DTensor's bits, and hand back to DTensor's dispatch whatever needs more than that; the
trainer's gradient norm over one rank takes the local gradients (the single-process bits)."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import dtq
from dtq import optim as dtq_optim
from dtq.launch import optim as launch_optim
from dtq.testing import spawn


def _model(seed: int, mesh=None) -> torch.nn.Module:
    torch.manual_seed(seed)
    # (3 output rows: uneven shards over 2 ranks, 2 and 1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 3, bias=False))
    if mesh is not None:
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


class _Spy:
    """Records, for each fused step the handler saw, whether it ran on the local shards."""

    def __enter__(self):
        self.calls, self.real = [], dtq_optim._locally

        def spy(args, kwargs):
            out = self.real(args, kwargs)
            self.calls.append(out is not None)
            return out

        dtq_optim._locally = spy
        return self

    def __exit__(self, *exc):
        dtq_optim._locally = self.real


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.detach().reshape(-1).view(torch.int32) if t.dtype == torch.float32 else t.detach().reshape(-1)


def _train(model, local: bool, fused_cls, amsgrad: bool, tensor_lr: bool, world: int, rank: int):
    lr = torch.tensor(1e-2) if tensor_lr else 1e-2  # (a tensor: the ops' tensor_lr overloads)
    opt = fused_cls(model.parameters(), lr=lr, weight_decay=0.1, fused=True, amsgrad=amsgrad)
    torch.manual_seed(100)
    batches = [torch.randn(6 * world, 16) for _ in range(3)]
    with _Spy() as spy:
        for i, x in enumerate(batches):
            mine = x.chunk(world)[rank] if world > 1 else x
            model(mine).square().mean().backward()
            if i == 1:  # a clipping factor, as dtq.launch.optim.clip_grad_norm leaves it
                opt.grad_scale = torch.tensor(1.75)
            if i == 2:  # GradScaler's other input (nothing was found: the step runs)
                opt.found_inf = torch.tensor(0.0)
            if local:
                with dtq.optim.on_local_shards():
                    opt.step()
            else:
                opt.step()
            opt.__dict__.pop("grad_scale", None)
            opt.__dict__.pop("found_inf", None)
            opt.zero_grad()
    states = [_bits(v) for p in model.parameters() for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return [_bits(p) for p in model.parameters()], states, spy.calls


def _check_fsdp2_steps(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    for fused_cls, amsgrad, tensor_lr in (
        (torch.optim.AdamW, False, False),
        (torch.optim.AdamW, True, True),
        (torch.optim.Adam, False, True),
        (torch.optim.Adam, True, False),
    ):
        case = f"{fused_cls.__name__} amsgrad={amsgrad} tensor_lr={tensor_lr} world={world}"
        ref_p, ref_s, _ = _train(_model(0, mesh), False, fused_cls, amsgrad, tensor_lr, world, rank)
        got_p, got_s, calls = _train(_model(0, mesh), True, fused_cls, amsgrad, tensor_lr, world, rank)
        assert calls and all(calls), f"{case}: the fused steps did not run on the local shards: {calls}"
        assert all(torch.equal(a, b) for a, b in zip(ref_p, got_p)), f"{case}: parameters differ"
        assert len(ref_s) == len(got_s) and all(torch.equal(a, b) for a, b in zip(ref_s, got_s)), case
    # the state stays DTensors (checkpoints unchanged)
    model = _model(1, mesh)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.randn(4, 16)).sum().backward()
    with dtq.optim.on_local_shards():
        opt.step()
    assert all(isinstance(opt.state[p]["exp_avg"], DTensor) for p in model.parameters())


def _check_declines(rank, world):
    """Placements that differ, a gradient with a pending reduction, a plain tensor among
    DTensors: DTensor's own dispatch runs the call (redistributing, or raising as it does for a
    parameter left out of ``fully_shard``), with the bits it has without the context; a later
    call in the same context runs on the local shards again."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(3)
    full_p, full_g = torch.randn(8, 4), torch.randn(8, 4)

    def make(kind):
        p = distribute_tensor(full_p.clone(), mesh, [Shard(0) if kind == "local" else Replicate()])
        if kind == "partial":  # every rank holds a part of the sum
            g = DTensor.from_local(full_g.clone() / world, mesh, [Partial()], run_check=False)
        else:  # sharded: where the parameter is replicated, placements that differ
            g = distribute_tensor(full_g.clone(), mesh, [Shard(0)])
        return torch.nn.Parameter(p), g

    for kinds, expected in ((("shard",), [False]), (("partial",), [False]), (("shard", "local"), [False, True])):
        results = []
        for local in (False, True):
            groups = []
            for kind in kinds:  # one parameter group each: one fused call each
                p, g = make(kind)
                p.grad = g
                groups.append({"params": [p]})
            opt = torch.optim.AdamW(groups, lr=1e-2, fused=True)
            with _Spy() as spy:
                if local:
                    with dtq.optim.on_local_shards():
                        opt.step()
                else:
                    opt.step()
            results.append(([_bits(g["params"][0]) for g in groups], spy.calls))
        (ref, _), (got, calls) = results
        assert calls == expected, f"{kinds}: {calls}"
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), f"{kinds}: other bits inside the context"
    # a plain parameter in the same call as DTensors: DTensor refuses the mix, inside the context too
    plain = torch.nn.Parameter(torch.randn(8, 4))
    plain.grad = torch.randn(8, 4)
    p, g = make("local")
    p.grad = g
    for local in (False, True):
        opt = torch.optim.AdamW([p, plain], lr=1e-2, fused=True)
        with _Spy() as spy, pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            if local:
                with dtq.optim.on_local_shards():
                    opt.step()
            else:
                opt.step()
        assert spy.calls == ([False] if local else [])


def _check_two_ranks(rank, world):
    _check_fsdp2_steps(rank, world)
    _check_declines(rank, world)


def test_fused_steps_on_local_shards_keep_dtensors_bits_and_decline_other_shardings_2_ranks():
    spawn(_check_two_ranks, 2, backend="gloo")


def test_on_local_shards_restores_dtensors_table():
    table = DTensor._op_dispatcher._custom_op_handlers
    before = dict(table)
    with pytest.raises(RuntimeError, match="inside"):
        with dtq.optim.on_local_shards():
            assert table[torch.ops.aten._fused_adamw_.default] is dtq_optim._fused_step_on_local_shards
            raise RuntimeError("inside")
    assert table == before
    # contexts that overlap (two threads'): the handler stays until the last one leaves
    first, second = dtq.optim.on_local_shards(), dtq.optim.on_local_shards()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert table[torch.ops.aten._fused_adamw_.default] is dtq_optim._fused_step_on_local_shards
    second.__exit__(None, None, None)
    assert table == before


def _check_one_rank_norm(rank, world):
    """FSDP2 over one rank: the trainer's gradient norm is taken over the local gradients (not
    through DTensor's dispatch of each), and it and the clipping factor are the single-process
    run's bits."""
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(7)
    x = torch.randn(6, 16) * 30
    real = torch.nn.utils.get_total_norm
    for loss_scale in (1.0, 1e-22):  # large gradients (the clipping factor is set), tiny ones
        totals, scales = [], []
        for sharded in (False, True):
            model = _model(4, mesh if sharded else None)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
            (model(x).square().mean() * loss_scale).backward()
            assert all(isinstance(p.grad, DTensor) == sharded for p in model.parameters())
            given = []

            def spy(tensors, *a, **k):
                given.extend(type(t).__name__ for t in tensors)
                return real(tensors, *a, **k)

            torch.nn.utils.get_total_norm = spy
            try:
                total = launch_optim.clip_grad_norm(model.parameters(), 1.0, opt)
            finally:
                torch.nn.utils.get_total_norm = real
            assert given and set(given) == {"Tensor"}, f"the norm was taken over {set(given)}"
            totals.append(_bits(total))
            scales.append(_bits(opt.grad_scale))
        assert torch.equal(*totals), f"loss x {loss_scale}: the one-rank FSDP2 norm differs from the single-process one"
        assert torch.equal(*scales)


def _check_one_rank(rank, world):
    _check_fsdp2_steps(rank, world)
    _check_one_rank_norm(rank, world)


def test_fused_steps_and_the_gradient_norm_over_one_rank():
    spawn(_check_one_rank, 1, backend="gloo")
