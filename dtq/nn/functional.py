"""Fused SwiGLU: ``silu(gate) * up`` of a GEMM's ``[..., 2F]`` output, forward and backward one
pass each on the GPU (csrc/swiglu.cu).

Eager PyTorch spends five kernels on it (silu, mul; in backward two muls, silu's backward and
the cat of the halves' gradients) and saves ``silu(gate)`` beside the GEMM output; for a
Llama-3-8B MLP at 8k tokens that is a fifth of an FP8 step. The formulas below fix the
arithmetic: fp32 (or the input's wider dtype), every operation rounded once, one rounding to the
input dtype at the end (eager ``F.silu(a) * b`` rounds ``silu(a)`` first). The kernel reproduces
the reference run through torch's CUDA ops bit for bit; on the CPU, torch's own ``exp`` may differ
from CUDA's in the last bit.

Between two dtq GEMMs (``LayerNormMLP``) the kernels also hand over the amaxes the next
quantization needs (:class:`AmaxLink`): FP8 current scaling (and NVFP4 directions without the
random Hadamard) then skip their amax passes over ``h`` and over the gradient of the gate/up
tensor, the largest activation of the MLP.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from dtq import kernels
from dtq._bits import stored_amax
from dtq._library import define
from dtq.nn import _handoff


def _halves(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = x.unflatten(-1, (-1, 2, block))
    return pairs.select(-2, 0).flatten(-2), pairs.select(-2, 1).flatten(-2)


def _silu_parts(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = 1.0 + torch.exp(-a)
    return a / d, 1.0 / d  # silu(a), sigmoid(a)


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # fp32, or float64 for float64 inputs


def swiglu_reference(x: torch.Tensor, block: int) -> torch.Tensor:
    """``silu(a) * b`` in fp32 (float64 for float64 x), rounded to ``x.dtype``; ``a``/``b``:
    alternating blocks of ``block`` columns of ``x`` (``block = F``: the two halves)."""
    a, b = (t.to(_math_dtype(x)) for t in _halves(x, block))
    silu, _ = _silu_parts(a)
    return (silu * b).to(x.dtype)


def swiglu_backward_reference(dh: torch.Tensor, x: torch.Tensor, block: int) -> torch.Tensor:
    """Gradient of ``x`` ([..., 2F], gate/up blocks as in :func:`swiglu_reference`) from ``dh``."""
    a, b = (t.to(_math_dtype(x)) for t in _halves(x, block))
    d = dh.to(a.dtype)
    silu, s = _silu_parts(a)
    da = (d * b) * (s * (1.0 + a * (1.0 - s)))
    db = d * silu
    return torch.stack((da.unflatten(-1, (-1, block)), db.unflatten(-1, (-1, block))), dim=-2).flatten(-3).to(x.dtype)


def _use_kernel(*tensors: torch.Tensor) -> bool:
    x = tensors[0]  # plain tensors only (a DTensor or other subclass takes the reference's torch ops)
    return (
        all(type(t) is torch.Tensor and t.device == x.device and t.dtype == x.dtype for t in tensors)
        and x.is_cuda
        and x.dtype in kernels.INPUT_DTYPES
        and kernels.available(x.device)
    )


@dataclasses.dataclass
class AmaxLink:
    """Amaxes the fused kernels compute for free, for the dtq GEMMs on either side: ``h_amax``
    (max|h|, set by the forward: the down projection's input) and ``grad_amax`` (max|dx|, set by
    the backward with the gradient dx it belongs to: the up projection's output gradient, read
    once by its backward). Each is the exact value an amax pass would give, or None where no
    kernel ran."""

    h_amax: torch.Tensor | None = None
    grad_amax: torch.Tensor | None = None
    _grad_of: weakref.ref | None = dataclasses.field(default=None, repr=False)
    _grad_version: int = dataclasses.field(default=0, repr=False)

    def offer_grad_amax(self, dx: torch.Tensor, amax: torch.Tensor | None) -> None:
        """max|dx| for the gradient ``dx`` the backward returns."""
        self.grad_amax, self._grad_of, self._grad_version = amax, weakref.ref(dx), dx._version

    def take_grad_amax(self, dy: torch.Tensor) -> torch.Tensor | None:
        """The offered amax if ``dy`` is the very gradient it was computed for, unchanged; else
        None (the GEMM runs its own amax pass): where h also feeds another op, autograd sums
        the two gradients into another tensor, or into dx in place, whose max|.| differs."""
        amax, of, version = self.grad_amax, self._grad_of, self._grad_version
        self.grad_amax = self._grad_of = None
        if amax is None or of is None or of() is not dy or dy._version != version:
            return None
        return amax


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, block: int, link: AmaxLink | None) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.block, ctx.link = block, link
        if _use_kernel(x):
            lead = x.shape[:-1]
            h, amax = kernels.swiglu(x.contiguous().reshape(-1, x.shape[-1]), block, want_amax=link is not None)
            if link is not None:
                link.h_amax = amax
            return h.reshape(*lead, x.shape[-1] // 2)
        return swiglu_reference(x, block)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        (x,) = ctx.saved_tensors
        link = ctx.link
        # create_graph (double backward): the reference's differentiable torch ops
        if _use_kernel(x, dh) and not torch.is_grad_enabled():
            dx, amax = kernels.swiglu_backward(
                dh.contiguous().reshape(-1, dh.shape[-1]),
                x.contiguous().reshape(-1, x.shape[-1]),
                ctx.block,
                want_amax=link is not None,
            )
            dx = dx.reshape(x.shape)
            if link is not None:
                link.offer_grad_amax(dx, amax)
            return dx, None, None
        return swiglu_backward_reference(dh, x, ctx.block), None, None


def _swiglu_impl(x: torch.Tensor, block: int) -> torch.Tensor:
    """The compiled path of :func:`swiglu`: the eager kernel (or reference) as one opaque op, so
    compiled bits are the eager ones."""
    return _SwiGLU.forward(_NoCtx(), x, block, None)


def _swiglu_fake(x, block):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


def _swiglu_backward_impl(dh: torch.Tensor, x: torch.Tensor, block: int) -> torch.Tensor:
    ctx = _NoCtx()
    ctx.saved_tensors, ctx.block, ctx.link = (x,), block, None
    with torch.no_grad():
        return _SwiGLU.backward(ctx, dh)[0]


def _swiglu_backward_fake(dh, x, block):
    return torch.empty_like(x)


def _swiglu_backward_amax_impl(dh: torch.Tensor, x: torch.Tensor, block: int) -> list[torch.Tensor]:
    """``[dx, max|dx|]``: the compiled backward of :func:`swiglu` with a ``link``, the amax from the
    kernel as eager's :class:`AmaxLink` hands it to the up projection (or dx's stored values'
    amax where no kernel ran)."""
    ctx = _NoCtx()
    ctx.saved_tensors, ctx.block, ctx.link = (x,), block, AmaxLink()
    with torch.no_grad():
        dx = _SwiGLU.backward(ctx, dh)[0]
    return [dx, _amax_or_stored(ctx.link.grad_amax, dx)]


def _swiglu_backward_amax_fake(dh, x, block):
    return [torch.empty_like(x), torch.empty((), dtype=torch.float32, device=x.device)]


def _amax_or_stored(amax: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    if amax is not None:
        return amax
    return stored_amax(t) if t.numel() else torch.zeros((), dtype=torch.float32, device=t.device)


class _NoCtx:
    """Stands in for autograd's ctx when the custom ops call _SwiGLU's bodies."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _swiglu_setup(ctx, inputs, output):
    x, block = inputs
    ctx.block = block
    ctx.save_for_backward(x)


def _swiglu_grad(ctx, dh):
    (x,) = ctx.saved_tensors
    return _swiglu_backward_op(dh, x, ctx.block), None


def _swiglu_amax_impl(x: torch.Tensor, block: int) -> list[torch.Tensor]:
    """The compiled path of :func:`swiglu` with a ``link``: ``[h, max|h|]``, the amax from the
    kernel as eager's :class:`AmaxLink` hands it to the down projection (else a reduction of h,
    which inductor cannot fuse into this op), or h's stored values' amax where no kernel ran."""
    link = AmaxLink()
    h = _SwiGLU.forward(_NoCtx(), x, block, link)
    return [h, _amax_or_stored(link.h_amax, h)]


def _swiglu_amax_fake(x, block):
    return [_swiglu_fake(x, block), torch.empty((), dtype=torch.float32, device=x.device)]


def _swiglu_amax_setup(ctx, inputs, output):
    _swiglu_setup(ctx, inputs, output)
    ctx.mark_non_differentiable(output[1])


def _swiglu_amax_grad(ctx, grads):
    (x,) = ctx.saved_tensors
    # max|dx| from the kernel, for the up projection's backward formula (traced next)
    dx, amax = _swiglu_backward_amax_op(grads[0], x, ctx.block)
    _handoff.offer(dx, amax)
    return dx, None  # (max|h| takes no gradient)


# The ops compiled graphs call (swiglu_fw, swiglu_amax_fw, swiglu_backward, swiglu_backward_amax)
# have C++ CUDA kernels too (csrc/ops.cpp, registered when the kernel library loads): two calls per
# LayerNormMLP and step, without a Python kernel. These Python kernels run for other devices, and
# on CUDA where dtq's kernel does not apply (the C++ kernel hands the call back to them).
_swiglu_backward_op = define("swiglu_backward", _swiglu_backward_impl, _swiglu_backward_fake)
_swiglu_backward_amax_op = define("swiglu_backward_amax", _swiglu_backward_amax_impl, _swiglu_backward_amax_fake)
_swiglu_op = define("swiglu", _swiglu_impl, _swiglu_fake, backward=_swiglu_grad, setup_context=_swiglu_setup)
_swiglu_amax_op = define(
    "swiglu_amax", _swiglu_amax_impl, _swiglu_amax_fake, backward=_swiglu_amax_grad, setup_context=_swiglu_amax_setup
)


def swiglu(x: torch.Tensor, block: int | None = None, *, link: AmaxLink | None = None) -> torch.Tensor:
    """``silu(a) * b`` of ``x = [..., 2F]``: ``a`` the first half of the last dim and ``b`` the
    second, or, with ``block=B``, gate and up alternating in blocks of ``B`` columns
    (``LayerNormMLP(swiglu_interleave=B)``). Differentiable; one kernel each way on sm_90+.
    ``link``: receives max|h| and, in backward, max|dx| (see :class:`AmaxLink`)."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dim of x (shape {tuple(x.shape)}) must be even: gate and up halves")
    f = x.shape[-1] // 2
    block = f if block is None else block
    if block < 1 or f % block:
        raise ValueError(f"swiglu: block={block} must divide half the last dim ({f}) of x (shape {tuple(x.shape)})")
    if not x.is_floating_point():
        raise ValueError(f"swiglu: x must be floating point, got {x.dtype}")
    if torch.compiler.is_compiling():  # one opaque op each way
        if link is None:
            return _swiglu_op(x, block)
        # max|h| as an output; backward's max|dx| reaches the up projection's backward through
        # dtq.nn._handoff (an op cannot hold the link)
        h, link.h_amax = _swiglu_amax_op(x, block)
        return h
    return _SwiGLU.apply(x, block, link)
