"""A gradient's amax handed from the dtq kernel that computed it to the GEMM that quantizes that
gradient, while AOTAutograd traces a backward graph.

Eagerly, the SwiGLU backward kernel hands max|dx| to the up projection's backward through an
``AmaxLink`` both autograd nodes hold. Compiled ops cannot hold one (their arguments are tensors
and constants), but their autograd formulas run one after the other while the backward graph is
traced: the SwiGLU formula :func:`offer`\\ s the gradient it returns with the amax its kernel
computed (an output of the same op, so a node of the same graph), and the GEMM's formula
:func:`take`\\ s it if its dy is that very tensor, unmodified. Anything in between (a sum with
another gradient, in place or not; a reshape) makes dy another tensor or another version of it:
the GEMM then reduces dy itself, to the same bits.
"""

from __future__ import annotations

import threading

import torch
from torch.utils.weak import WeakTensorKeyDictionary

_local = threading.local()


def _offers() -> WeakTensorKeyDictionary:
    offers = getattr(_local, "offers", None)
    if offers is None:
        offers = _local.offers = WeakTensorKeyDictionary()  # (an offer lives as long as its gradient)
    return offers


def offer(grad: torch.Tensor, amax: torch.Tensor) -> None:
    """``amax`` is max|grad| as ``grad`` is now, computed by the kernel that produced it."""
    _offers()[grad] = (grad._version, amax)


def take(grad: torch.Tensor) -> torch.Tensor | None:
    """max|grad| if the kernel that produced this very tensor offered it and nothing has written
    to the tensor since (autograd may add a second gradient into it in place), else None."""
    entry = _offers().pop(grad, None)
    if entry is None or entry[0] != grad._version:
        return None
    return entry[1]
