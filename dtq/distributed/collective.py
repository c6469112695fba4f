"""dtq's blocking collectives, run so that the calling thread, not a backend's worker thread,
frees each one's work.

A gloo work holds its tensors and a copy of the caller's thread-local state (in backward that
includes the Python ``contextvars.Context`` torch stashes there). Whichever thread drops the last
reference frees them, and freeing Python-owned objects takes the GIL. Under torch 2.13 a
blocking collective returns as soon as the work is done, often before gloo's worker thread has
dropped its reference: when a script ended right after (a backward whose last step was a
tensor-parallel all-reduce, say), the worker met a finalizing interpreter and the process
aborted ("terminate called without an active exception", in about one two-rank CPU run in
four). Keeping the latest works here (until later collectives replace them, or the interpreter
clears this module) leaves the worker nothing to free. Several are kept, not one: gloo runs two
worker threads, so a later collective can finish on one while the other, descheduled, still holds
an earlier work (keeping only the last still aborted about one run in ten on a loaded machine).
Only CPU collectives (gloo's) are kept: a CUDA one's buffers (an activation's gradient, say) would
otherwise stay allocated until later. A collective without tensors (a barrier) is kept where its
group's backend is gloo: a gloo barrier's work holds the works issued before it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch
import torch.distributed as dist

_KEPT = 16
_recent: collections.deque = collections.deque(maxlen=_KEPT)  # the latest CPU collectives' works


def run(collective: Callable[..., dist.Work | None], *args, **kwargs) -> None:
    """``collective(*args, **kwargs)`` (a ``torch.distributed`` function), waited for as the
    blocking call would be; a CPU collective's work is kept until ``_KEPT`` later ones replace it."""
    work = collective(*args, async_op=True, **kwargs)
    if work is None:  # this rank is not in the group: nothing was issued
        return
    work.wait()
    if _on_cpu(args, kwargs.get("group")):
        _recent.append(work)


def _on_cpu(args: tuple, group) -> bool:
    """Whether the collective's first tensor argument (or first tensor of a list argument) is on
    the CPU; without tensors, whether ``group``'s backend is gloo."""
    for a in args:
        if isinstance(a, (list, tuple)) and a:
            a = a[0]
        if isinstance(a, torch.Tensor):
            return a.device.type == "cpu"
    return dist.get_backend(group) == "gloo"
