"""A gradient's amax handed from the dtq kernel that computed it to the GEMM that quantizes that
gradient, while AOTAutograd traces a backward graph.

Eagerly, the SwiGLU backward kernel hands max|dx| to the up projection's backward through an
``AmaxLink`` both autograd nodes hold. Compiled ops cannot hold one (their arguments are tensors
and constants), but their autograd formulas run one after the other while the backward graph is
traced: the SwiGLU formula :func:`offer`\\ s the gradient it returns with the amax its kernel
computed (an output of the same op, so a node of the same graph), and the GEMM's formula
:func:`take`\\ s it if its dy is that very tensor. Anything in between (a sum with another
gradient, a reshape) makes dy another tensor: the GEMM then reduces dy itself, to the same bits.
"""

from __future__ import annotations

import threading
import weakref

import torch

_slot = threading.local()


def offer(grad: torch.Tensor, amax: torch.Tensor) -> None:
    """``amax`` is max|grad|, computed by the kernel that produced ``grad``."""
    _slot.entry = (weakref.ref(grad), amax)


def take(grad: torch.Tensor) -> torch.Tensor | None:
    """max|grad| if the kernel that produced this very tensor offered it, else None."""
    entry = getattr(_slot, "entry", None)
    if entry is None or entry[0]() is not grad:
        return None
    _slot.entry = None
    return entry[1]
