"""Delayed scaling's history step in one launch (``dtq.kernels.delayed_amax``) against its reference
(``dtq.nn.slot.history_step``, the torch ops), bit for bit: the amax returned and the history after
the shift, for the newest entry or the max, with a margin factor, entries held back by an amax
reduction (``skip``), one-entry and full-size histories, zeros, infinities and NaN in the history and
in x, every input dtype, and x given as a tensor (its max|x| is the new entry) or as a value. A
delayed-recipe Linear then trains bitwise the same with the kernel and with the reference. On the
CPU the step always runs the reference (checked at the end)."""

from __future__ import annotations

import pytest
import torch

import dtq
from dtq import kernels
from dtq._bits import stored_amax
from dtq.nn import slot as slot_mod
from tests.kernels.test_kernels import _same_bits as _same  # any NaN equals any NaN

needs_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() or not kernels.available("cuda"),
    reason="the kernels need a CUDA GPU with sm_90 (CPU-only here)",
)


def _history(n: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    h = torch.rand(n, generator=g) * 100
    if kind == "zeros":
        h.zero_()
    elif kind == "specials" and n >= 4:
        h[1], h[2], h[3] = float("inf"), 0.0, float("nan")
    elif kind == "specials":
        h[0] = float("nan")
    elif kind == "tail_zero" and n >= 2:  # a newest entry of 0 and older positive ones
        h[0] = 0.0
    return h.cuda()


@needs_kernels
@pytest.mark.parametrize("n", [1, 2, 16, 257, 1024, kernels.MAX_HISTORY])
@pytest.mark.parametrize("kind", ["random", "zeros", "specials", "tail_zero"])
@pytest.mark.parametrize("most_recent", [False, True])
def test_matches_reference_given_cur(n, kind, most_recent):
    for skip in sorted({0, 1, n // 2, max(n - 1, 0), n, n + 3}):
        for factor in (1.0, 2.0**3, 2.0**-2):
            for cur in (3.5, 0.0, float("nan")):
                ref, got = _history(n, kind), _history(n, kind)
                c = torch.tensor(cur, device="cuda")
                want = slot_mod.history_step(ref, c, skip, most_recent, factor)
                amax, entry = kernels.delayed_amax(got, None, c, skip, most_recent, factor)
                case = f"n={n} {kind} skip={skip} factor={factor} cur={cur}"
                assert _same(amax, want), case
                assert _same(got, ref), case
                assert entry.dim() == 0 and _same(entry, c), case


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (64, 128), (333, 1000), (2048, 4096)])
@pytest.mark.parametrize("special", ["none", "inf", "nan", "zeros"])
def test_matches_reference_given_x(dtype, shape, special):
    g = torch.Generator().manual_seed(shape[0] * shape[1])
    x = torch.randn(shape, generator=g) * 7
    if special == "inf":
        x[-1, -1] = -float("inf")
    elif special == "nan":
        x[0, -1] = float("nan")
    elif special == "zeros":
        x.zero_()
    x = x.to(dtype).cuda()
    ref, got = _history(16, "random"), _history(16, "random")
    cur = stored_amax(x)  # what the slot's reference path takes
    want = slot_mod.history_step(ref, cur, 0, False, 1.0)
    amax, entry = kernels.delayed_amax(got, x, None, 0, False, 1.0)
    assert _same(entry, cur) and _same(amax, want) and _same(got, ref)


def _train(recipe, steps: int = 4) -> tuple[list[float], torch.Tensor]:
    torch.manual_seed(0)
    m = dtq.nn.Linear(256, 128, bias=False).cuda()
    dtq.convert(m, recipe=recipe)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for i in range(steps):
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(i)).cuda().to(torch.bfloat16)
        loss = m(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    hist = torch.cat([b.detach().reshape(-1) for n, b in sorted(m.named_buffers()) if "amax_history" in n])
    return losses, hist


@needs_kernels
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_linear_same_with_and_without_the_kernel(monkeypatch, margin, algo):
    recipe = dtq.DelayedScaling(margin=margin, amax_history_len=8, amax_compute_algo=algo)
    calls = []
    real = kernels.delayed_amax
    monkeypatch.setattr(kernels, "delayed_amax", lambda *a: calls.append(1) or real(*a))
    losses_k, hist_k = _train(recipe)
    assert calls, "the delayed-scaling steps did not run the kernel"
    monkeypatch.setattr(slot_mod, "_history_kernel_input", lambda *a: False)
    losses_r, hist_r = _train(recipe)
    assert losses_k == losses_r
    assert _same(hist_k, hist_r)


def test_cpu_runs_the_reference():
    hist = torch.zeros(4)
    assert slot_mod._history_kernel_input(hist, torch.ones(2, 2), None) is False
    assert slot_mod._history_kernel_input(hist, None, torch.ones(())) is False
