"""dtq's blocking collectives, run so that the calling thread, not a backend's worker thread,
frees each one's work.

A gloo work holds its tensors and a copy of the caller's thread-local state (in backward that
includes the Python ``contextvars.Context`` torch stashes there). Whichever thread drops the last
reference frees them, and freeing Python-owned objects takes the GIL. Under torch 2.13 a
blocking collective returns as soon as the work is done, often before gloo's worker thread has
dropped its reference: when a script ended right after (a backward whose last step was a
tensor-parallel all-reduce, say), the worker met a finalizing interpreter and the process
aborted ("terminate called without an active exception", in about one two-rank CPU run in
four). Keeping the last work here until the next collective (or until the interpreter clears
this module) leaves the worker nothing to free. Only CPU collectives (gloo's) are kept: a CUDA
one's buffers (an activation's gradient, say) would otherwise stay allocated until the next.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

_last_work: list[dist.Work] = []  # the latest collective's work, freed by the next call


def run(collective: Callable[..., dist.Work | None], *args, **kwargs) -> None:
    """``collective(*args, **kwargs)`` (a ``torch.distributed`` function), waited for as the
    blocking call would be; a CPU collective's work is kept until dtq's next collective."""
    work = collective(*args, async_op=True, **kwargs)
    if work is None:  # this rank is not in the group: nothing was issued
        return
    work.wait()
    if _on_cpu(args):
        _last_work[:] = [work]


def _on_cpu(args: tuple) -> bool:
    """Whether the collective's first tensor argument (or first tensor of a list argument) is on
    the CPU."""
    for a in args:
        if isinstance(a, (list, tuple)) and a:
            a = a[0]
        if isinstance(a, torch.Tensor):
            return a.device.type == "cpu"
    return False
