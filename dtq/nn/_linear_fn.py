"""The autograd function behind every dtq GEMM module: fprop, dgrad and wgrad on the payloads the
recipe asks for, with the backward override applied (docs/design.md section 4)."""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from dtq.codec import QuantizedData, shape_2d
from dtq.distributed import tp
from dtq.formats import COLUMNWISE, ROWWISE
from dtq.gemm import Operand, mm
from dtq.nn.gemm_state import GemmCall
from dtq.nn.slot import Slot
from dtq.tensor import QUANTIZED, QuantizedTensor
from dtq.weights import local_tensor, unwrap


def flatten_saved(objs, keep: tuple = (), share: bool = True) -> tuple[list, list]:
    """``objs`` as (plain tensors, specs): QuantizedTensors taken apart into their payload tensors
    (with ``share``, each shared tensor once), so saved-tensor hooks (torch.autograd.graph.save_on_cpu, dtq's
    offload) move payloads as payloads, at their quantized size, bit for bit. Objects in ``keep``
    (a quantized weight parameter, whose payloads an FSDP2 backward gather refills) stay objects.
    Fields go in sorted order, so the layout depends only on the formats, never on the order a
    kernel or a reference filled them in; without ``share`` not on which fields are one tensor either."""
    flat, specs, index = [], [], {}
    for o in objs:
        if o is None:
            specs.append(("none",))
        elif not isinstance(o, QUANTIZED):
            specs.append(("t", len(flat)))
            flat.append(o)
        elif keep and any(o is k for k in keep):
            specs.append(("obj", o))
        else:
            fields = []
            # QuantizedData (dtq's own) read directly: this runs in every GEMM's forward
            payloads = o._payloads if type(o) is QuantizedData else {d: o.payload(d) for d in o.directions}
            for d, payload in payloads.items():
                for k in sorted(payload):
                    v = payload[k]
                    i = index.get(id(v)) if share else None
                    if i is None:  # identical directions share tensors: save once
                        i = index[id(v)] = len(flat)
                        flat.append(v)
                    fields.append((d, k, i))
            specs.append(("qt", tuple(o.shape), o.dtype, o.quantizer, o.shape2d, tuple(fields)))
    return flat, specs


def unflatten_saved(flat, specs) -> list:
    out = []
    for spec in specs:
        if spec[0] == "qt":
            _, shape, dtype, quantizer, shape2d, fields = spec
            payloads: dict = {}
            for d, k, i in fields:
                payloads.setdefault(d, {})[k] = flat[i]
            out.append(QuantizedData(shape, dtype, quantizer, payloads, shape2d))
        elif spec[0] == "obj":
            out.append(spec[1])
        elif spec[0] == "none":
            out.append(None)
        else:
            out.append(flat[spec[1]])
    return out


def _keep(t: torch.Tensor, direction: str) -> torch.Tensor:
    if not isinstance(t, QUANTIZED) or not t.has(direction) or t.directions == (direction,):
        return t
    return t.with_directions(direction)


def _hp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(t, QUANTIZED):
        return t.dequantize(dtype)
    return unwrap(t).to(dtype)


_unsafe_view = torch.ops.aten._unsafe_view.default
_HP_OVERRIDE = "the recipe's backward_override uses high-precision operands in backward"


def _rows_shape(x_shape: torch.Size, rows: int, n: int) -> tuple[int, ...]:
    """``x_shape`` with its leading dim resized so the whole holds ``rows`` rows, last dim ``n``."""
    inner = 1
    for s in x_shape[1:-1]:
        inner *= s
    if len(x_shape) < 2:
        return (n,)
    if inner == 0:  # an empty inner dim: no rows either way, the leading dim stays
        return (x_shape[0], *x_shape[1:-1], n)
    return (rows // inner, *x_shape[1:-1], n)


def fake_quantize(slot: Slot, x: torch.Tensor, rowwise: bool, columnwise: bool, **_) -> torch.Tensor:
    """What ``slot.quantize`` returns, with empty payloads of the same layout (shapes, dtypes,
    shared tensors of identical directions) and nothing computed: the compiled path's shape
    inference. Runs no kernel, draws no random numbers, moves no amax history."""
    q = slot.quantizer
    if q is None or not (rowwise or columnwise):
        return x
    dirs = tuple(d for d, on in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if on)
    shape = shape_2d(x.shape)
    twins = q.aliases(dirs)
    payloads: dict = {}
    for d in dirs:
        if d in twins:
            payloads[d] = dict(payloads[twins[d]])
        else:
            codec = q.codec(d)
            try:
                codec.check_shape(shape)
            except ValueError as e:  # the message eager gives
                raise ValueError(f"{slot.role}: {e}") from None
            payloads[d] = codec.empty(shape, x.device, x.dtype)
    return QuantizedData(x.shape, x.dtype, q, payloads, device=x.device)


def fake_mm(a: Operand, b: Operand, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    (m, _), (_, n) = a.logical_shape(), b.logical_shape()
    return torch.empty(m, n, dtype=out_dtype, device=a.tensor.device)


def linear_forward(
    call: GemmCall,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    x_amax: torch.Tensor | None = None,
    *,
    quantize=Slot.quantize,
    gemm=mm,
):
    """``(y, saved_x, saved_w)`` of ``y = x @ W.T + b``: x quantized by the input slot, W by the
    weight slot (unless it is a QuantizedTensor parameter already), and the operands backward
    needs. ``quantize`` / ``gemm`` are replaced by :func:`fake_quantize` / :func:`fake_mm` for
    shape inference (the compiled path), which then runs this very code."""
    slots = call.slots
    sx, sw, override = slots.sx, slots.sw, slots.recipe.backward_override
    wl = local_tensor(weight)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    gather = call.group if call.tp is not None and call.tp.gathers_input else None
    bwd_cols = override is None
    if gather is not None and override == "high_precision":
        x2 = tp.gather_rows(x2, gather, reason=_HP_OVERRIDE)  # the override saves the high-precision input
        xq = quantize(sx, x2, rowwise=True, columnwise=False, replay=call.replay, sync=call.amax_sync)
    else:
        xq = quantize(
            sx,
            x2,
            rowwise=True,
            columnwise=bwd_cols and call.need_wgrad,
            replay=call.replay,
            group=gather,
            sync=call.amax_sync,
            known_amax=x_amax,
        )
        if gather is not None and not isinstance(xq, QUANTIZED):
            x2 = xq  # gathered in high precision (no quantizer for the input)
    if isinstance(wl, QUANTIZED):
        wq = wl
    else:
        wq = quantize(
            sw, wl, rowwise=True, columnwise=bwd_cols and call.need_dgrad, replay=call.replay, sync=call.amax_sync
        )
    # GEMMs write the output dtype directly (no extra cast pass); with a bias, fp32 first.
    y = gemm(
        Operand(xq, ROWWISE),
        Operand(wq, ROWWISE, transpose=True),
        torch.float32 if bias is not None else x.dtype,
        fast_accum=slots.recipe.fprop_fast_accumulation,
    )
    if bias is not None:
        y = y + local_tensor(bias).to(torch.float32)
    if override is None:
        saved_x, saved_w = _keep(xq, COLUMNWISE), _keep(wq, COLUMNWISE)
    elif override == "high_precision":
        saved_x, saved_w = x2, wl
    else:  # "dequantized": exactly the forward operands
        saved_x, saved_w = _keep(xq, ROWWISE), _keep(wq, ROWWISE)
    if isinstance(wl, QUANTIZED):
        # A quantized weight parameter is kept as the object itself: under FSDP2 its payloads
        # are refilled by the backward all-gather (columnwise, or what the override needs).
        saved_w = wl
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    if call.tp is not None and call.tp.scatters_output:
        y = tp.reduce_scatter_rows(y, call.group)
    # Not a view of y (as reshape would give): FSDP2 warns about modules that return views.
    if x.dim() != 2 or y._is_view() or not y.is_contiguous():
        y = _unsafe_view(y.contiguous(), _rows_shape(x.shape, y.shape[0], y.shape[-1]))
    return y, (saved_x if call.need_wgrad else None), (saved_w if call.need_dgrad else None)


def check_weight_columnwise(call: GemmCall, w) -> None:
    """dgrad reads a quantized weight's columnwise payload: say so where it has none."""
    if not w.has(COLUMNWISE):
        raise RuntimeError(
            f"dtq: {call.name}: the weight has no columnwise payload for dgrad (it holds "
            f"{list(w.directions)}). Quantize the weight with both directions, or "
            "train it under a recipe with backward_override"
        )


def linear_backward(
    call: GemmCall,
    dy: torch.Tensor,
    saved_x,
    saved_w,
    x_shape: torch.Size,
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
    need_bgrad: bool,
):
    """``(dx, dw, db)`` (None where not needed) of :func:`linear_forward` from its saved operands:
    dgrad and wgrad on the payloads the recipe asks for, or the backward override's operands."""
    sg = call.slots.sg
    need_dgrad, need_wgrad = call.need_dgrad, call.need_wgrad
    # contiguous: the same reduction order (bias grad) whatever layout a compiled graph hands over
    dy2 = (dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])).contiguous()
    scatter = call.group if call.tp is not None and call.tp.scatters_output else None
    dx = dw = db = None
    if call.override is None:
        # max|dy| from the next op's kernel, where dy is the gradient it computed it for
        known = call.link.take_grad_amax(dy) if call.link is not None else None
        gq = sg.quantize(
            dy2, rowwise=need_dgrad, columnwise=need_wgrad, group=scatter, sync=call.amax_sync, known_amax=known
        )
        if need_dgrad:
            if isinstance(saved_w, QUANTIZED):
                check_weight_columnwise(call, saved_w)
            dx = mm(Operand(gq, ROWWISE), Operand(saved_w, COLUMNWISE), x_dtype)
        if need_wgrad:
            dw = mm(Operand(gq, COLUMNWISE, transpose=True), Operand(saved_x, COLUMNWISE), w_dtype)
    else:
        if scatter is not None:
            dy2 = tp.gather_rows(dy2, scatter, reason=_HP_OVERRIDE)  # the overrides use the high-precision gradient
        if call.override == "high_precision":
            # Same products, in the same order and dtype, as torch's own linear backward, so that
            # the gradients are bitwise those of the unquantized module.
            if need_dgrad:
                dx = dy2.mm(_hp(saved_w, dy.dtype)).to(x_dtype)
            if need_wgrad:
                dw = _hp(saved_x, dy.dtype).t().mm(dy2).t().to(w_dtype)
        else:
            # "dequantized": the forward's operand values exactly (fp32; they need not fit in bf16).
            g = dy2.float()
            if need_dgrad:
                dx = g.mm(
                    saved_w.dequantize(torch.float32, direction=ROWWISE)
                    if isinstance(saved_w, QUANTIZED)
                    else _hp(saved_w, torch.float32)
                ).to(x_dtype)
            if need_wgrad:
                xd = (
                    saved_x.dequantize(torch.float32, direction=ROWWISE)
                    if isinstance(saved_x, QUANTIZED)
                    else _hp(saved_x, torch.float32)
                )
                dw = xd.t().mm(g).t().to(w_dtype)
    if need_bgrad:
        db = dy2.sum(0)
    if dx is not None:
        if call.tp is not None and call.tp.gathers_input:
            dx = tp.reduce_scatter_rows(dx, call.group)
        if dx.shape != x_shape:
            dx = dx.reshape(x_shape)
    return dx, dw, db


def once_differentiable_lean(backward):
    """``once_differentiable`` for a GEMM Function's backward without its ``no_grad`` region where no
    graph is being built (every common backward: autograd runs it with grad mode off already), which
    is host time on every GEMM; a backward under ``create_graph=True`` still gets its refusal of a
    second differentiation."""
    refusing = once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            return refusing(ctx, *grads)
        return backward(ctx, *grads)

    return wrapper


class LinearFn(torch.autograd.Function):
    """``y = x @ W.T + b`` as :func:`linear_forward` / :func:`linear_backward` describe, under the
    :class:`GemmCall` ``call``.

    Under tensor parallelism (``call.tp`` over ``call.group``) the weight is this rank's shard (a
    DTensor's local tensor); with sequence parallelism a column GEMM gathers its input quantized
    and reduce-scatters dx, a row GEMM reduce-scatters its output and gathers dy quantized (the two
    gathers whose payloads the GEMMs consume)."""

    @staticmethod
    def forward(ctx, x, weight, bias, x_amax, call: GemmCall):
        y, saved_x, saved_w = linear_forward(call, x, weight, bias, x_amax)
        wl = local_tensor(weight)
        flat, ctx.saved_specs = flatten_saved((saved_x, saved_w), keep=(wl,))
        ctx.save_for_backward(*flat)
        ctx.call = call
        ctx.meta = (x.shape, x.dtype, weight.dtype, bias is not None and bias.requires_grad)
        ctx.w_spec = (
            (weight.device_mesh, weight.placements, weight.shape, weight.stride()) if wl is not weight else None
        )
        ctx.b_spec = (
            (bias.device_mesh, bias.placements, bias.shape, bias.stride())
            if bias is not None and local_tensor(bias) is not bias
            else None
        )
        return y

    @staticmethod
    @once_differentiable_lean
    def backward(ctx, dy):
        saved_x, saved_w = unflatten_saved(ctx.saved_tensors, ctx.saved_specs)
        dx, dw, db = linear_backward(ctx.call, dy, saved_x, saved_w, *ctx.meta)
        return dx, _as_param_grad(dw, ctx.w_spec), _as_param_grad(db, ctx.b_spec), None, None


def _as_param_grad(g: torch.Tensor | None, spec) -> torch.Tensor | None:
    """The gradient of a DTensor parameter is a DTensor with the parameter's placements."""
    if g is None or spec is None:
        return g
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = spec
    return DTensor.from_local(g, mesh, placements, run_check=False, shape=shape, stride=stride)


class DequantizeWeight(torch.autograd.Function):
    """High-precision use of a quantized weight parameter (outside ``dtq.autocast``): the gradient
    flows to the parameter unchanged."""

    @staticmethod
    def forward(ctx, weight: QuantizedTensor, dtype: torch.dtype):
        return weight.dequantize(dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class WeightData(torch.autograd.Function):
    """A :class:`dtq.weights.HighPrecisionWeight` parameter as its plain data (an alias), the gradient
    passed to the parameter unchanged: torch's linear (outside ``dtq.autocast``) then runs the very
    same ops on the same data, without the wrapper's Python dispatch of each of them (host time)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor):
        return unwrap(weight).detach()

    @staticmethod
    def backward(ctx, grad):
        return grad
