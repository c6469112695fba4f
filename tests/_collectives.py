"""Collective helpers the multi-rank tests share (real process groups, gloo or NCCL)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class CountAllReduce:
    """Counts ``torch.distributed.all_reduce`` calls inside the block (the real collective runs)."""

    def __init__(self):
        self.calls, self.real = 0, dist.all_reduce

    def __enter__(self):
        def counting(*a, **k):
            self.calls += 1
            return self.real(*a, **k)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.real


def gather_rows(t: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's ``t`` concatenated along dim 0, moved as bytes (gloo lacks float8 and int16 gathers)."""
    b = t.contiguous().view(torch.uint8)
    parts = [torch.empty_like(b) for _ in range(world)]
    dist.all_gather(parts, b)
    return torch.cat(parts).view(t.dtype)
