"""Inductor's decompositions of ``dtq::quantize_input`` and ``dtq::quantize_grad``: the input and
gradient quantizations of a planned compiled GEMM call as plain tensor ops, which inductor fuses
into the kernels around them (the cast into the kernel producing x or dy; transposed codes come
from dtq's tiled kernel, ``dtq::transposed_codes``) instead of one opaque op per operand with its
own launches and host time; what torchao's float8 training compiles to. The ops are each codec's
``Codec.traced_quantize`` (per-tensor FP8 today), bitwise its ``quantize``; x is taken at its
stored precision (a bitcast round trip: inductor would otherwise feed its unrounded fp32
intermediate into the cast). A codec without that form, a symbolic shape, a GPU older than
sm_89 or a tensor that comes out of another dtq kernel (the ops' ``fuse`` False: SwiGLU's h and
its input's gradient, which nothing fuses into, and whose codes dtq's one-pass kernel writes in
both layouts from one read, where that kernel runs) keeps the op (the decomposition returns
``NotImplemented``); backends other than inductor keep it too.

The GEMMs of a planned call on a high-precision weight likewise (``dtq::linear``'s forward and
``dtq::linear_backward``), where every GEMM path is torch's own ops on the payloads
(``LinearPlan.traceable``: FP8 per-tensor's ``torch._scaled_mm``, sm_89 and later): the graph calls the
scaled GEMMs itself, and one small op per forward call, ``dtq::planned_weight``, keeps what must
run in Python (``GemmState.begin``'s bookkeeping, which FSDP2's gathers and a recompute read) and
quantizes the weight with dtq's one-pass kernel, as eager does. That takes the two Python op
bodies per GEMM (and their dispatch) out of the step. A bias gradient keeps the backward op
(inductor's reduction would sum in another order than eager's); a quantized weight keeps both
(FSDP2's backward gather refills it, which only the op reads).
"""

from __future__ import annotations

import math

import torch

from dtq import _bits, kernels
from dtq._library import forward_op
from dtq._torch_private import assume_constant_result
from dtq.nn import _ops

_registered = False


@assume_constant_result
def register() -> bool:
    """Put the decompositions into inductor's table (once; run where a dtq module is traced, so
    importing dtq does not import inductor)."""
    global _registered
    if not _registered:
        from torch._inductor import lowering

        for op, fn in _decompositions():
            if op not in lowering.lowerings:
                # the lowering of the calls a decomposition declines: the one inductor would give
                # a custom op (its own refuses an op that also has a decomposition)
                tag = lowering.get_layout_constraint_tag(op, with_default=True)
                constraint = lowering.tag_to_layout_constraint(tag)
                lowering.make_fallback(op, layout_constraint=constraint, warn=False, override_decomp=True)
        set_decomposed(True)
        _registered = True
    return True


def set_decomposed(on: bool) -> None:
    """Put the decompositions into inductor's table, or take them out (the ops then run as they
    are, as they do under other backends). Inductor reads a copy of its table made at its first
    compile in the process (``fast_random_decomps``, cached): that copy is made again, or an
    earlier compile of anything would leave dtq's ops undecomposed for the process's life."""
    from torch._inductor import decomposition

    for op, fn in _decompositions():
        if on:
            decomposition.decompositions[op] = fn
        else:
            decomposition.decompositions.pop(op, None)
    cached = getattr(decomposition, "fast_random_decomps", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()


def _decompositions() -> tuple:
    return (
        (_ops.quantize_input, _quantize_input),
        (_ops.quantize_grad, _quantize_grad),
        (forward_op(_ops.linear), _linear),
        (_ops.linear_backward, _linear_backward),
    )


def _linear(x, weight, w_fields, wkey, bias, x_amax, x_payloads, *rest):
    """A planned call on a high-precision weight whose GEMMs are torch's scaled GEMMs
    (``LinearPlan.traceable``): ``dtq::planned_weight`` (the call's bookkeeping and the weight's
    quantization) and the forward GEMM in the graph, so that no Python runs around the GEMM.
    (The arguments are ``dtq::linear``'s.)"""
    handle, key, need_dgrad, need_wgrad, no_grad_trainable, recompute_only, planned = rest
    if not (planned and not wkey and x_payloads and x.dim() >= 2 and _static(x)):
        return NotImplemented
    if (need_dgrad or need_wgrad) and not _ops.quantizes_grad_apart(key):
        return NotImplemented  # (backward's op quantizes dy itself: keep the pair as it is)
    with _untraced():
        plan = _ops._template_plan(
            key, need_dgrad, need_wgrad, x.shape, x.dtype, x.device, weight.shape[0], weight.dtype
        )
        if not plan.traceable(bias is not None):
            return NotImplemented
    flags = _ops.CallFlags(need_dgrad, need_wgrad, no_grad_trainable, recompute_only, True, x.dtype, weight.dtype)
    w_payloads = _ops.planned_weight(weight, handle, key, flags.code(), math.prod(x.shape[:-1]))
    y, saved = plan.forward(x, weight, bias, None, share=False, x_payloads=x_payloads, w_payloads=w_payloads)
    return [y, *saved]


def _linear_backward(dy, saved, weight, w_fields, wkey, handle, key, need_dgrad, need_wgrad, need_bgrad, *rest):
    """The backward of a planned call decomposed by :func:`_linear`: its dgrad and wgrad scaled
    GEMMs in the graph. Not with a bias gradient (inductor's own reduction would sum in another
    order than eager's) nor where dy is not quantized in the graph. (The arguments are
    ``dtq::linear_backward``'s.)"""
    x_shape, x_dtype, _, planned, dy_amax, dy_payloads = rest
    if not (planned and not wkey and not need_bgrad and _static(dy) and all(isinstance(s, int) for s in x_shape)):
        return NotImplemented
    if not dy_payloads or not (need_dgrad or need_wgrad):
        return NotImplemented
    with _untraced():
        plan = _ops._template_plan(key, need_dgrad, need_wgrad, x_shape, x_dtype, dy.device, dy.shape[-1], weight.dtype)
        if not plan.traceable(False):
            return NotImplemented
    grads = plan.backward(dy, tuple(saved), None, None, weight.dtype, False, dy_amax, dy_payloads)
    return [g.contiguous() for g in grads if g is not None]


def _quantize_input(x, x_amax, key, flags, out_features):
    if not (_static(x) and (_ops.call_flags(flags).fuse or not _kernel_quantizes(x))):
        return NotImplemented
    with _untraced():
        plan = _ops._input_plan(x, key, flags, out_features)
    return _traced_payloads(plan.qx.q, plan.x_layout, x, x_amax)


def _quantize_grad(dy, dy_amax, key, flags, in_features):
    fuse = _ops.call_flags(flags).fuse
    if not (_static(dy) and isinstance(in_features, int) and (fuse or not _kernel_quantizes(dy))):
        return NotImplemented
    with _untraced():
        plan = _ops._grad_plan(dy, key, flags, in_features)
    return _traced_payloads(plan.qg.q, plan.g_layout, dy, dy_amax)


def _kernel_quantizes(t: torch.Tensor) -> bool:
    """Whether the op itself would quantize ``t`` with dtq's one-pass kernel (the reason a call
    passes ``fuse`` False); without the kernels the op would run the references' torch ops one
    by one, where the decomposition still gives inductor's fused kernels (the same bits)."""
    return t.device.type == "cuda" and kernels.available(t.device)


def _static(t: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in t.shape)


def _untraced():
    """The plans' meta-tensor probes are not part of the graph."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    return disable_proxy_modes_tracing()


def _traced_payloads(q, layout: tuple, x: torch.Tensor, amax: torch.Tensor | None):
    """The distinct payload tensors of ``layout`` (``LinearPlan``'s) for ``x`` quantized by ``q``
    with max|x| ``amax``, as the codecs' plain ops (``Codec.traced_quantize``); NotImplemented
    where a codec has none. A direction whose payload is bitwise another's (``Quantizer.aliases``:
    per-tensor FP8's two directions) takes that one's tensors, so that the codes are cast and
    stored once: traced apart, inductor's kernel stored them twice (once more for the [K, M] copy
    ``data_t`` is transposed from)."""
    cuda = x.device.type == "cuda"
    if cuda and torch.cuda.get_device_capability(x.device) < (8, 9):
        return NotImplemented  # Triton has no FP8 conversions before sm_89; the ops emulate them
    from torch._inductor import config as inductor_config

    # Triton's conversion on NVIDIA GPUs is the reference cast (``_bits.cast_fp8``); elsewhere the
    # cast keeps its clamp and NaN fix-up
    triton = cuda and torch.version.hip is None and inductor_config.cuda_backend == "triton"
    x2 = x.reshape(-1, x.shape[-1])
    int_dtype = _bits._SAME_SIZE_INT.get(x2.dtype)
    if int_dtype is not None:  # x's stored values (see the module docstring)
        x2 = x2.view(int_dtype).view(x2.dtype)
    if amax is None:
        amax = _bits.stored_amax(x2)
    directions = tuple(dict.fromkeys(d for d, _, _ in layout))
    twin = q.aliases(directions)  # direction -> the earlier one whose payload it is, bitwise
    wanted: dict = {}  # traced direction -> the fields it and its twins need
    for d, k, _ in layout:
        wanted.setdefault(twin.get(d, d), set()).add(k)
    payloads = {}
    for d, fields in wanted.items():
        payload = q.codec(d).traced_quantize(x2, amax, transposed="data_t" in fields, triton=triton)
        if payload is None or not fields <= set(payload):
            return NotImplemented
        payloads[d] = payload
    out: list[torch.Tensor] = []
    for d, k, i in layout:  # directions sharing a tensor (identical codes) take the first's
        if i == len(out):
            out.append(payloads[twin.get(d, d)][k])
    return out
