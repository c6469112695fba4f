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

Works dtq does not issue (FSDP2's gathers and reduce-scatters, a script's own) can still be last
held by a gloo worker that is descheduled between finishing one and dropping it; CI saw two-rank
CPU scripts abort so at exit (about one run in fifty, not reproducible on demand). So once a
process has run a gloo collective here, an ``atexit`` handler gives gloo's workers a moment
(``EXIT_GRACE_S``) while the interpreter is still whole, then frees the kept works itself.
"""

from __future__ import annotations

import atexit
import collections
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

_KEPT = 16
_recent: collections.deque = collections.deque(maxlen=_KEPT)  # the latest CPU collectives' works
EXIT_GRACE_S = 0.1  # at exit, after a gloo collective: time for gloo's workers to drop their works
_exit_hook = False


def run(collective: Callable[..., dist.Work | None], *args, **kwargs) -> None:
    """``collective(*args, **kwargs)`` (a ``torch.distributed`` function), waited for as the
    blocking call would be; a CPU collective's work is kept until ``_KEPT`` later ones replace it."""
    work = collective(*args, async_op=True, **kwargs)
    if work is None:  # this rank is not in the group: nothing was issued
        return
    work.wait()
    if _on_cpu(args, kwargs.get("group")):
        _recent.append(work)
        _register_exit_hook()


def _register_exit_hook() -> None:
    global _exit_hook
    if not _exit_hook:
        atexit.register(_let_gloo_workers_finish)
        _exit_hook = True


def _let_gloo_workers_finish() -> None:
    """At exit (``atexit``: before the interpreter starts finalizing, so other threads may still
    take the GIL): wait ``EXIT_GRACE_S`` for gloo's workers to drop the works they finished, then
    free the kept ones here."""
    time.sleep(EXIT_GRACE_S)
    _recent.clear()


def _on_cpu(args: tuple, group) -> bool:
    """Whether the collective's first tensor argument (or first tensor of a list argument) is on
    the CPU; without tensors, whether ``group``'s backend is gloo."""
    for a in args:
        if isinstance(a, (list, tuple)) and a:
            a = a[0]
        if isinstance(a, torch.Tensor):
            return a.device.type == "cpu"
    return dist.get_backend(group) == "gloo"
