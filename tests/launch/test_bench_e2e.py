"""bench/bench_e2e.py's peak-memory column: each variant's own peak. In an interleaved run
(``--rounds`` > 1) every variant stays built until all are timed, and the column counted the
earlier variants' models and optimizer states in every later one's peak."""

from __future__ import annotations

import pathlib
import sys
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA's allocator statistics)")


def _variant(mib: int):
    """A one-Linear model whose fp32 weight takes ``mib`` MiB (gradient and AdamW's two states: 3x more)."""
    return lambda: torch.nn.Linear(256, mib * 1024, bias=False, device="cuda"), None


@pytest.mark.usefixtures("fresh_dynamo")
def test_interleaved_variants_report_their_own_peak_memory(monkeypatch):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
    import bench_e2e

    # (the interleaved run raises dynamo's recompile limit for the process)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", torch._dynamo.config.recompile_limit)

    args = SimpleNamespace(warmup=1, iters=1, inner=1, rounds=2, backward_thread="caller", gaps=0)
    x = torch.randn(4, 256, device="cuda")
    rows = bench_e2e.time_interleaved({"large": _variant(256), "small": _variant(8)}, x, args, torch.device("cuda"))
    # large: 256 MiB each for the weight, its gradient and two AdamW states; small: 8 MiB each
    assert 0.95 < rows["large"]["peak_gib"] < 1.5, rows
    # before the fix 0.81 (H200): the large variant's weight and AdamW states counted in
    assert rows["small"]["peak_gib"] < 0.1, rows
