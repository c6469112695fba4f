"""Delayed-scaling histories shared across ranks: ``dtq.autocast(amax_group=...)`` MAX-reduces
each step's current amaxes over the group (one all-reduce after the forward, one at the end of
backward), so every rank holds the same histories, the values of the whole global batch. Real
processes, gloo."""

from __future__ import annotations

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
        with dtq.autocast(recipe, amax_group=dist.group.WORLD if reduce else None):
            if recompute is None:
                y = model(x)
            else:
                y = torch.utils.checkpoint.checkpoint(model, x.requires_grad_(), use_reentrant=recompute == "reentrant")
        (y.float() * torch.linspace(-1, 1, H)).sum().backward()
        hist = _histories(model)
        whole_x = torch.cat(_gathered(x.detach()))
        if reduce:
            for name, h in hist.items():  # bitwise the same on every rank
                assert all(torch.equal(h, o) for o in _gathered(h)), (step, name)
            # the first GEMM's input amax is the whole global batch's
            assert torch.equal(hist["0.amax_history_0_input"][0], whole_x.abs().amax()), step
            assert hist["2.amax_history_0_grad_output"][0] > 0
        else:  # without the group each rank keeps its own (so the test above can fail)
            assert not torch.equal(hist["0.amax_history_0_input"][0], whole_x.abs().amax()) or rank == world - 1


@pytest.mark.parametrize("recompute", [None, "non_reentrant", "reentrant"])
def test_histories_agree_across_ranks(recompute):
    spawn(_steps, 2, True, recompute)


def test_without_a_group_histories_stay_per_rank():
    spawn(_steps, 2, False, None)


def test_amax_group_needs_torch_distributed():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        with dtq.autocast(dtq.DelayedScaling(), amax_group=object()):
            pass
