"""Activation recompute is bitwise: ``torch.utils.checkpoint`` (reentrant and not), with and
without ``torch.autograd.graph.save_on_cpu``, around a block that calls one dtq module once or
twice per forward, trains exactly like the run without recompute, under every recipe. The second
call of a module sees other values (and, under delayed scaling, another scale from the history):
its recompute must replay that call's scale, not the last one used."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import dtq
from tests._recipe_matrix import RECIPES

HIDDEN, TOKENS, STEPS = 128, 32, 4

CASES = {
    **RECIPES,
    "fp8_delayed_most_recent": lambda: dtq.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent"),
}


class Block(torch.nn.Module):
    def __init__(self, twice: bool):
        super().__init__()
        self.fc1 = dtq.nn.Linear(HIDDEN, HIDDEN, bias=False, name="fc1")
        self.fc2 = dtq.nn.Linear(HIDDEN, HIDDEN, name="fc2")
        self.twice = twice

    def forward(self, x):
        h = self.fc1(x)
        if self.twice:  # the same module again, on values ten times larger
            h = self.fc1(h * 10)
        return self.fc2(torch.nn.functional.gelu(h))


def _run(recipe, twice: bool, recompute: str | None, on_cpu: bool, device: str):
    torch.manual_seed(0)
    block = Block(twice).to(device)
    if recipe.delayed:
        dtq.convert(block, recipe=recipe)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    out = []
    for step in range(STEPS):
        # inputs grow faster than the history's scales follow: stale scales would show
        x = (torch.randn(TOKENS, HIDDEN, generator=g) * 4**step).to(device).requires_grad_(True)
        saving = torch.autograd.graph.save_on_cpu() if on_cpu else contextlib.nullcontext()
        with dtq.autocast(recipe), saving:
            if recompute is None:
                y = block(x)
            else:
                y = checkpoint(block, x, use_reentrant=recompute == "reentrant")
        loss = y.float().square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        out.append(loss.detach())
        out += [x.grad] + [p.grad for p in block.parameters()]
        opt.step()
    out += [p.detach().__dtq_unwrap__() if hasattr(p, "__dtq_unwrap__") else p.detach() for p in block.parameters()]
    out += list(block.buffers())  # delayed-scaling histories
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
@pytest.mark.parametrize("recipe_name", list(CASES))
def test_recompute_is_bitwise(recipe_name, twice, device):
    recipe = CASES[recipe_name]()
    ref = _run(recipe, twice, None, False, device)
    for recompute in (None, "non_reentrant", "reentrant"):
        for on_cpu in (False, True):
            if recompute is None and not on_cpu:
                continue
            got = _run(recipe, twice, recompute, on_cpu, device)
            assert len(got) == len(ref)
            for i, (a, b) in enumerate(zip(got, ref)):
                assert torch.equal(_bits(a), _bits(b)), (recipe_name, twice, recompute, on_cpu, i)


def test_shared_module_in_two_checkpoint_regions():
    """One module in two checkpointed regions (weight sharing across layers): regions are
    recomputed in backward's order, the last first; each call must still replay its own scale."""
    recipe = dtq.DelayedScaling(amax_history_len=4)

    def run(recompute, reentrant=False):
        torch.manual_seed(0)
        lin = dtq.convert(torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN)), recipe=recipe)[0]
        opt = torch.optim.SGD(lin.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        grads = []
        for step in range(STEPS):
            x = (torch.randn(TOKENS, HIDDEN, generator=g) * 4**step).requires_grad_(True)
            with dtq.autocast(recipe):
                h = x
                for scale in (1.0, 10.0):  # two regions, one module

                    def f(t, s=scale):
                        return lin(t * s)

                    h = checkpoint(f, h, use_reentrant=reentrant) if recompute else f(h)
            opt.zero_grad()
            h.square().mean().backward()
            grads += [x.grad.clone(), lin.weight.grad.clone()]
            opt.step()
        return grads

    ref = run(False)
    for reentrant in (False, True):
        for i, (a, b) in enumerate(zip(run(True, reentrant), ref)):
            assert torch.equal(_bits(a), _bits(b)), (reentrant, i)
