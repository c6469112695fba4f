"""The compiled path of dtq's GEMMs: ``torch.library`` custom ops, so that ``torch.compile`` traces a
dtq module without a graph break.

``dtq::linear`` runs :func:`dtq.nn._linear_fn.linear_forward` and returns the output and the
payload tensors backward needs; ``dtq::linear_backward`` runs ``linear_backward`` on them. Both
run the eager code itself (the same kernels, so compiled results are the eager bits), and both
have fake implementations for shape inference: the forward's is ``linear_forward`` run with
empty payloads (``fake_quantize``), so its layout is the real one by construction. A GEMM's
quantizers travel as the number of a slots template (a graph constant, the same for every block
of one structure) and its module as an opaque ``GemmHandle`` (a graph input), so one graph
serves every block; what only the running call knows (its module's amax histories and state, a
recompute, the amax reduction, checkpoint regions) is looked up inside the op when it runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dtq import kernels
from dtq._bits import stored_amax
from dtq._library import define, forward_op
from dtq._torch_private import assume_constant_result, in_backward
from dtq.formats import COLUMNWISE, ROWWISE
from dtq.nn import _handoff, linear_native
from dtq.nn import _linear_fn as lf
from dtq.nn.gemm_state import GemmCall, GemmHandle, GemmSlots, content_key, template
from dtq.nn.linear_plan import LinearPlan, shape_plan
from dtq.tensor import QUANTIZED, QuantizedTensor
from dtq.tensor_ops import implements
from dtq.weights import gathered_amax, unwrap


def _unaliased(flat: list, inputs: tuple) -> list:
    """Custom-op outputs may not alias inputs (or each other): a saved operand that is an input or
    a view of one (the high-precision input of ``backward_override="high_precision"``, a
    passthrough payload) is copied; and they are contiguous, as the fake implementation says.
    Aliasing is sharing a storage: compared by storage address, one lookup per tensor (a pairwise
    ``_is_alias_of`` cost more host time than a small GEMM's kernels). Every compiled GEMM call
    runs this, so plain tensors take the short way (no unwrapping, no list of inputs)."""
    if not flat:  # (a planned call given x's payloads and a quantized weight saves nothing)
        return []
    try:
        seen = set()
        for i in inputs:
            if i is None:
                continue
            if type(i) is torch.Tensor:
                seen.add(i.untyped_storage().data_ptr())
            elif isinstance(i, QUANTIZED):  # a quantized weight (QuantizedData) as its payload tensors
                seen.update(t.untyped_storage().data_ptr() for t in lf.flatten_saved((i,))[0])
            elif isinstance(i, torch.Tensor):
                seen.add(unwrap(i).untyped_storage().data_ptr())  # dtq's weight wrapper: its data's storage
        ptrs = [t.untyped_storage().data_ptr() for t in flat]
    except RuntimeError:  # fake tensors (tracing can run this body on them): no address, compare pairwise
        tensors = []
        for i in inputs:
            if isinstance(i, QUANTIZED):
                tensors += lf.flatten_saved((i,))[0]
            elif isinstance(i, torch.Tensor):
                tensors.append(unwrap(i))
        return _unaliased_pairwise(flat, tensors)
    out = []
    for t, ptr in zip(flat, ptrs):
        if ptr in seen:
            t = t.clone(memory_format=torch.contiguous_format)
            ptr = t.untyped_storage().data_ptr()
        elif not t.is_contiguous():  # the fake payloads are contiguous
            t = t.contiguous()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out.append(t)
    return out


def _unaliased_pairwise(flat: list, tensors: list) -> list:
    out, seen = [], []
    for t in flat:
        if any(torch._C._is_alias_of(t, i) for i in (*tensors, *seen)):
            t = t.clone(memory_format=torch.contiguous_format)
        t = t.contiguous()
        seen.append(t)
        out.append(t)
    return out


_layouts: dict = {}
_weight_keys: dict = {}  # a quantized weight's layout spec -> its key
_weight_specs: dict = {}  # key -> spec


def _weight_fields(weight: QuantizedTensor) -> tuple[list[torch.Tensor], int]:
    """A quantized weight as its payload tensors, one per field, and the key of its layout (format,
    shape, fields). Fields that are one tensor (identical directions) are listed once each: graphs
    traced from a parameter share them, graphs that AOTAutograd rebuilds the weight in may not,
    and the key must name one layout either way."""
    flat, (spec,) = lf.flatten_saved((weight,), share=False)
    key = _weight_keys.get(spec)
    if key is None:
        key = _weight_keys[spec] = content_key(spec)  # (0 stays free: a plain weight)
        if _weight_specs.setdefault(key, spec) != spec:
            other = _weight_specs[key]
            raise RuntimeError(f"dtq: two quantized weight layouts share the key {key}: {spec} and {other}")
    return flat, key


def _weight(weight: torch.Tensor, w_fields: list[torch.Tensor], wkey: int, live=None) -> torch.Tensor:
    """The weight an op was called with: ``weight`` itself (``wkey == 0``), or the quantized
    weight of layout ``wkey`` made of ``w_fields``. ``live()``: the module's weight parameter now,
    which says what a layout is when the graph was compiled by another process (inductor's
    caches) and this one has not met it yet."""
    if wkey == 0:
        return weight
    spec = _weight_specs.get(wkey)
    if spec is None:
        w = live() if live is not None else None
        if isinstance(w, QuantizedTensor):
            _weight_fields(w)
        spec = _weight_specs.get(wkey)
        if spec is None:
            have = lf.flatten_saved((w,), share=False)[1][0] if isinstance(w, QuantizedTensor) else type(w).__name__
            raise RuntimeError(
                f"dtq: a compiled graph takes a quantized weight of layout key {wkey}, which neither "
                f"this process nor the module's weight has (the weight now: {have}); the graph came "
                "from inductor's cache of a run whose weights differ. Clear that cache (a fresh "
                "TORCHINDUCTOR_CACHE_DIR) or compile after the weights are in their final format"
            )
    return lf.unflatten_saved(list(w_fields), [spec])[0]


def _layout(
    key: int, need_dgrad: bool, need_wgrad: bool, x_shape, x_dtype, weight, wkey: int, has_x_amax: bool
) -> list:
    """The saved-operand specs (``flatten_saved``) of a forward call, from a run of the forward
    on empty meta tensors (the bias changes only y): what ``dtq::linear_backward`` unflattens
    its saved list with. ``wkey``: the quantized weight's layout key where the caller has it (0:
    taken from ``weight``); the weight is taken apart only to build a layout not met yet."""
    if not wkey and isinstance(weight, QUANTIZED):
        wkey = _weight_fields(weight)[1]
    k = (key, need_dgrad, need_wgrad, tuple(x_shape), x_dtype, tuple(weight.shape), weight.dtype, wkey, has_x_amax)
    specs = _layouts.get(k)
    if specs is None:
        meta = torch.device("meta")
        xm = torch.empty(x_shape, dtype=x_dtype, device=meta)
        if wkey:
            fields = _weight_fields(weight)[0]
            wm = _weight(None, [torch.empty_like(f, device=meta) for f in fields], wkey)
        else:
            wm = torch.empty(weight.shape, dtype=weight.dtype, device=meta)
        a = torch.empty((), dtype=torch.float32, device=meta) if has_x_amax else None
        call = GemmCall(template(key), need_dgrad, need_wgrad)
        _, sx, sw = lf.linear_forward(call, xm, wm, None, a, quantize=lf.fake_quantize, gemm=lf.fake_mm)
        _, specs = lf.flatten_saved((sx, sw), keep=(wm,))
        _layouts[k] = specs
    return specs


@assume_constant_result
def plain_template(key: int) -> bool:
    """Whether calls of the slots template ``key`` run planned (``GemmSlots.plannable``): a graph
    constant, decided where the graph is traced. A template's slots have no amax histories: the
    recipe says whether the module's will."""
    t = template(key)
    return t.plannable and not t.recipe.delayed


@assume_constant_result
def takes_tensor_amax(key: int, slot: str) -> bool:
    """Whether the ``slot`` ("input" or "grad_output") of template ``key`` scales from a
    tensor-wide max|x| (``Slot.takes_tensor_amax``): a planned compiled call then computes it in
    the graph, where inductor fuses the reduction into the kernel that produces the tensor
    instead of the quantization reading the tensor once more for it."""
    t = template(key)
    return not t.recipe.delayed and (t.sx if slot == "input" else t.sg).takes_tensor_amax()


# The dtypes a planned call's flags can name, at fixed places (the code is a graph constant that
# inductor's caches hand to later processes; a name this torch lacks keeps its place): the GEMMs'
# own and any other a caller may hand a module (an integer input runs as it does eagerly).
_FLAG_DTYPE_NAMES = (
    "bfloat16", "float16", "float32", "float64", "uint8", "int8", "int16", "int32", "int64", "bool",
    "complex32", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "uint16", "uint32", "uint64",
)  # fmt: skip
_FLAG_DTYPES = tuple(getattr(torch, n, None) for n in _FLAG_DTYPE_NAMES)
_DTYPE_BITS = 5


class CallFlags(NamedTuple):
    """A planned compiled call's constants beside its template key, which the ops called once per
    GEMM and step (``dtq::planned_weight``, ``quantize_input``, ``quantize_grad``) take as one int
    (:meth:`code`): torch's dispatch into a Python kernel costs about 0.2 µs per bool and 0.7 µs
    per dtype or ``list[int]`` argument on the CPU machine (``bench/host_python.py``), ten times
    that on the GPU hosts, and a compiled 1.07 B step makes about a hundred such calls."""

    need_dgrad: bool
    need_wgrad: bool
    no_grad_trainable: bool = False
    recompute_only: bool = False
    fuse: bool = True  # (quantize_input / quantize_grad: see quantize_input)
    x_dtype: torch.dtype = torch.bfloat16
    w_dtype: torch.dtype = torch.bfloat16

    def code(self) -> int:
        bits = sum(int(b) << i for i, b in enumerate(self[:5]))
        for i, dtype in enumerate((self.x_dtype, self.w_dtype)):
            if dtype is None or dtype not in _FLAG_DTYPES:
                raise ValueError(
                    f"dtq: a compiled GEMM call on {dtype} tensors, a dtype dtq's compiled ops cannot name; "
                    "give the module floating-point inputs and weights (bfloat16, float16, float32)"
                )
            bits |= _FLAG_DTYPES.index(dtype) << (5 + _DTYPE_BITS * i)
        return bits


_decoded_flags: dict[int, CallFlags] = {}


def call_flags(code: int) -> CallFlags:
    """The :class:`CallFlags` of ``code`` (decoded once per code)."""
    flags = _decoded_flags.get(code)
    if flags is None:
        bools = [bool(code >> i & 1) for i in range(5)]
        mask = (1 << _DTYPE_BITS) - 1
        dtypes = [_FLAG_DTYPES[code >> (5 + _DTYPE_BITS * i) & mask] for i in range(2)]
        flags = _decoded_flags[code] = CallFlags(*bools, *dtypes)
    return flags


_checked_slots: dict = {}  # (id(slots), key) -> slots whose quantizers matched template ``key``'s


def _module_slots(handle: GemmHandle, key: int) -> GemmSlots:
    """The running module's slots for the template the graph was traced with (the same quantizers;
    compared once per slots object, not per call: quantizer equality costs microseconds)."""
    t = template(key)
    slots = handle.slots(t.recipe, t.gemm)
    if _checked_slots.get((id(slots), key)) is slots:
        return slots
    if slots.quantizers != t.quantizers:
        raise RuntimeError(
            f"dtq: {slots.name} shares a compiled graph traced for {t.name}, but the recipe gives it "
            f"other quantizers ({slots.quantizers} vs {t.quantizers}); a recipe whose quantizers depend "
            "on the module name must say so (name_dependent = True, as CustomRecipe does)"
        )
    if len(_checked_slots) > 4096:
        _checked_slots.clear()
    _checked_slots[(id(slots), key)] = slots
    return slots


def _plan(call: GemmCall, x: torch.Tensor, weight) -> LinearPlan | None:
    return shape_plan(call, x.shape, x.dtype, x.device, weight) if x.dim() >= 2 else None


def _begin(
    handle: GemmHandle, key: int, no_grad_trainable: bool, recompute_only: bool, planned: bool
) -> tuple[GemmSlots, bool, object]:
    """The bookkeeping of a compiled forward call at run time (``GemmState.begin``: the recipe
    and recompute flags FSDP2's gathers and checkpoint's recompute read): ``(slots, whether the
    call is a recompute, its amax reduction)``."""
    slots = _module_slots(handle, key)
    replay = in_backward()
    if recompute_only and not replay:
        raise RuntimeError(
            f"dtq: {slots.name}: a compiled forward ran outside dtq.autocast after a forward whose "
            "recompute has not run yet (a no_grad or checkpointed forward under a recipe); a "
            "compiled module cannot tell this call from that recompute. Run that backward first, "
            "or run this forward eagerly (torch.compiler.set_stance('force_eager'))"
        )
    sync = slots.state.begin(slots.recipe, replay, no_grad_trainable)
    if planned and sync is not None:
        raise RuntimeError(
            f"dtq: {slots.name}: a compiled graph traced without an amax reduction runs inside "
            "dtq.autocast(amax_group=...); compile the step inside that region"
        )
    return slots, replay, sync


def _forward(
    x,
    weight,
    bias,
    x_amax,
    x_payloads,
    handle,
    key,
    need_dgrad,
    need_wgrad,
    no_grad_trainable,
    recompute_only,
    planned,
    fake: bool,
    alias_inputs: tuple,
) -> list:
    if fake:
        call = GemmCall(template(key), need_dgrad, need_wgrad)
        if planned and (plan := _plan(call, x, weight)) is not None:
            y, saved = plan.empty_forward(x, x_given=bool(x_payloads))
            return [y, *saved]
        y, sx, sw = lf.linear_forward(call, x, weight, bias, x_amax, quantize=lf.fake_quantize, gemm=lf.fake_mm)
    else:
        slots, replay, sync = _begin(handle, key, no_grad_trainable, recompute_only, planned)
        if planned:
            plan = _plan(slots.call(need_dgrad, need_wgrad), x, weight)
            if plan is not None:  # (None: a shape no plan takes; the general path raises its message)
                y, saved = plan.forward(x, weight, bias, x_amax, share=False, x_payloads=x_payloads or None)
                return [y, *_unaliased(saved, alias_inputs)]
        call = GemmCall(slots, need_dgrad, need_wgrad, replay=replay, amax_sync=sync)
        y, sx, sw = lf.linear_forward(call, x, weight, bias, x_amax)
    flat, _ = lf.flatten_saved((sx, sw), keep=(weight,))  # a quantized weight is passed to backward again
    return [y, *_unaliased(flat, alias_inputs)]


def _linear_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_fields: list[torch.Tensor],
    wkey: int,
    bias: torch.Tensor | None,
    x_amax: torch.Tensor | None,
    x_payloads: list[torch.Tensor],
    handle: GemmHandle,
    key: int,
    need_dgrad: bool,
    need_wgrad: bool,
    no_grad_trainable: bool,
    recompute_only: bool,
    planned: bool,
) -> list[torch.Tensor]:
    """``[y, *saved]``: the forward of one GEMM of ``handle``'s module, traced with the slots
    template ``key``. A quantized weight parameter arrives as its payload tensors ``w_fields``
    and layout ``wkey`` (its ``QuantizedTensor`` dispatch takes it apart); ``wkey == 0``:
    ``weight`` is the weight. ``planned``: a plain call (:func:`plain_template`), run by its
    :class:`dtq.nn.linear_plan.LinearPlan` as eager runs it (the same saved fields);
    ``x_payloads``: x quantized by :func:`quantize_input` for a planned call (else empty), whose
    saved fields backward then takes from these inputs."""
    w = _weight(weight, w_fields, wkey, lambda: _module_slots(handle, key).live_weight())
    args = (bias, x_amax, x_payloads, handle, key, need_dgrad, need_wgrad, no_grad_trainable, recompute_only, planned)
    # what outputs may not alias: a quantized weight as the payload tensors it arrived as (no
    # taking apart the weight rebuilt from them)
    alias_inputs = (x, *(w_fields if wkey else (weight,)), bias, x_amax)
    return _forward(x, w, *args, fake=False, alias_inputs=alias_inputs)


def _linear_fake(x, weight, w_fields, wkey, *args):  # args: as _linear_impl's, from bias on
    w = _weight(weight, w_fields, wkey)
    return _forward(x, w, *args, fake=True, alias_inputs=(x, w, args[0], args[1]))  # (args: bias, x_amax, ...)


def _linear_backward_impl(
    dy: torch.Tensor,
    saved: list[torch.Tensor],
    weight: torch.Tensor,
    w_fields: list[torch.Tensor],
    wkey: int,
    handle: GemmHandle,
    key: int,
    need_dgrad: bool,
    need_wgrad: bool,
    need_bgrad: bool,
    x_shape: list[int],
    x_dtype: torch.dtype,
    has_x_amax: bool,
    planned: bool,
    dy_amax: torch.Tensor | None,
    dy_payloads: list[torch.Tensor],
) -> list[torch.Tensor]:
    """``[dx?, dw?, db?]`` (those asked for, in that order) of ``dtq::linear``; ``dy_amax``:
    max|dy|, computed in the graph for a planned call whose dy takes a tensor-wide amax;
    ``dy_payloads``: dy quantized in the graph (:func:`quantize_grad`) for a planned call, else empty."""
    slots = _module_slots(handle, key)
    w = _weight(weight, w_fields, wkey, slots.live_weight)
    if planned:
        # the forward ran this shape's plan, so it exists (or builds again: the same layout)
        plan = shape_plan(slots.call(need_dgrad, need_wgrad), torch.Size(x_shape), x_dtype, dy.device, w)
        wobj = None
        if isinstance(w, QUANTIZED):
            # under FSDP2, the parameter the backward all-gather refilled, as eager backward reads it
            live = slots.live_weight() if slots.state.fsdp_gathered else None
            wobj = live if isinstance(live, QuantizedTensor) else w
        grads = plan.backward(dy, tuple(saved), wobj, None, w.dtype, need_bgrad, dy_amax, dy_payloads or None)
        return [g.contiguous() for g in grads if g is not None]
    specs = _layout(key, need_dgrad, need_wgrad, x_shape, x_dtype, w, wkey, has_x_amax)
    saved_x, saved_w = lf.unflatten_saved(list(saved), specs)
    if specs[1][0] == "obj":  # the quantized weight itself (its meta stand-in in the layout)
        # under FSDP2, the parameter the backward all-gather refilled, as eager backward reads it
        live = slots.live_weight() if slots.state.fsdp_gathered else None
        saved_w = live if isinstance(live, QuantizedTensor) else w
    call = GemmCall(slots, need_dgrad, need_wgrad, amax_sync=slots.state.amax_sync)
    grads = lf.linear_backward(call, dy, saved_x, saved_w, torch.Size(x_shape), x_dtype, w.dtype, need_bgrad)
    # contiguous, as the fake says (a GEMM may hand dW over transposed)
    return [g.contiguous() for g in grads if g is not None]


def _linear_backward_fake(
    dy,
    saved,
    weight,
    w_fields,
    wkey,
    handle,
    key,
    need_dgrad,
    need_wgrad,
    need_bgrad,
    x_shape,
    x_dtype,
    has_x_amax,
    planned,
    dy_amax,
    dy_payloads,
):
    w = _weight(weight, w_fields, wkey)
    out = []
    if need_dgrad:
        out.append(dy.new_empty(x_shape, dtype=x_dtype))
    if need_wgrad:
        out.append(dy.new_empty(w.shape, dtype=w.dtype))
    if need_bgrad:
        out.append(dy.new_empty(dy.shape[-1:], dtype=dy.dtype))
    return out


def _setup_context(ctx, inputs, output):
    x, weight, _, _, bias, x_amax, x_payloads, handle, key, need_dgrad, need_wgrad, _, _, planned = inputs
    ctx.args = (
        handle,
        key,
        need_dgrad,
        need_wgrad,
        bias is not None and bias.requires_grad,
        list(x.shape),
        x.dtype,
        x_amax is not None,
        planned,
    )
    x_saved = []
    if x_payloads:  # x's saved fields are inputs (quantize_input's outputs), not outputs
        plan = _plan(GemmCall(template(key), need_dgrad, need_wgrad), x, weight)
        x_saved = [x_payloads[i] for i in plan.x_saved] if plan is not None else []
    ctx.n_x_payloads = len(x_payloads)
    ctx.save_for_backward(weight, *x_saved, *output[1:])


def _backward(ctx, grads):
    key, need_dgrad, need_wgrad, need_bgrad = ctx.args[1:5]
    planned = ctx.args[-1]
    weight, *saved = ctx.saved_tensors
    dy, dy_amax, dy_payloads = grads[0], None, []
    if planned and (need_dgrad or need_wgrad) and dy.numel():
        # max|dy| from the dtq kernel that produced dy (SwiGLU's backward), if one did: then
        # nothing produces dy that inductor could fuse dy's amax or cast into either
        handed = _handoff.take(dy)
        if takes_tensor_amax(key, "grad_output"):
            # else in the graph: fused into dy's producer
            dy_amax = handed if handed is not None else stored_amax(dy.detach())
        if quantizes_grad_apart(key):  # in the graph too, where inductor can fuse it (_fused_input)
            x_shape, x_dtype = ctx.args[5:7]
            flags = CallFlags(need_dgrad, need_wgrad, fuse=handed is None, x_dtype=x_dtype, w_dtype=weight.dtype)
            dy_payloads = quantize_grad(dy.detach(), dy_amax, key, flags.code(), x_shape[-1])
    out = iter(linear_backward(dy, saved, weight, [], 0, *ctx.args, dy_amax, dy_payloads))
    dx = next(out) if need_dgrad else None
    dw = next(out) if need_wgrad else None
    db = next(out) if need_bgrad else None
    # w_fields: always [] here; x_payloads: no gradient (quantized codes)
    none_x = [None] * ctx.n_x_payloads
    return dx, dw, [], None, db, None, none_x, None, None, None, None, None, None, None


def _input_plan(x: torch.Tensor, key: int, flags: int, out_features: int) -> LinearPlan:
    """The plan of a planned call of template ``key`` (``flags``: its :class:`CallFlags` code) on
    ``x`` whose weight is ``[out_features, x.shape[-1]]``: its input and gradient quantizations
    are the module's (the weight's kind changes only the weight's side)."""
    f = call_flags(flags)
    return _template_plan(key, f.need_dgrad, f.need_wgrad, x.shape, x.dtype, x.device, out_features, f.w_dtype)


_template_plans: dict = {}


def _template_plan(key, need_dgrad, need_wgrad, x_shape, x_dtype, device, out_features, w_dtype) -> LinearPlan:
    """The plan of template ``key``'s planned call of this shape, kept per shape (with the kernels'
    on/off token, as ``shape_plan``'s own cache): a compiled step asks once per GEMM operand, and
    describing the weight as a meta tensor costs more host time than the lookup."""
    k = (key, need_dgrad, need_wgrad, tuple(x_shape), x_dtype, device, out_features, w_dtype, kernels.disabled_token())
    plan = _template_plans.get(k)
    if plan is not None:
        return plan
    w = torch.empty((out_features, x_shape[-1]), dtype=w_dtype, device="meta")
    call = GemmCall(template(key), need_dgrad, need_wgrad)
    # (None: a shape the formats refuse; building the plan again raises their message)
    x_shape = torch.Size(x_shape)
    plan = shape_plan(call, x_shape, x_dtype, device, w) or LinearPlan(call, x_shape, x_dtype, device, w)
    if len(_template_plans) > 256:
        _template_plans.clear()
    _template_plans[k] = plan
    return plan


def _grad_plan(dy: torch.Tensor, key: int, flags: int, in_features: int) -> LinearPlan:
    f = call_flags(flags)
    x_shape = (*dy.shape[:-1], in_features)
    return _template_plan(key, f.need_dgrad, f.need_wgrad, x_shape, f.x_dtype, dy.device, dy.shape[-1], f.w_dtype)


def _quantize_grad_impl(
    dy: torch.Tensor, dy_amax: torch.Tensor | None, key: int, flags: int, in_features: int
) -> list[torch.Tensor]:
    """dy quantized as a planned call of template ``key`` (``flags``: its :class:`CallFlags`
    code; the weight ``[dy.shape[-1], in_features]``) quantizes it in backward
    (``LinearPlan.g_layout``'s distinct tensors), for ``dtq::linear_backward``'s ``dy_payloads``:
    an op of the backward graph, which inductor decomposes into kernels fused with dy's producer
    where the flags say ``fuse`` (else dtq's one-pass kernel runs: dy comes out of another dtq kernel)."""
    plan = _grad_plan(dy, key, flags, in_features)
    if (native := linear_native.payloads(plan, linear_native.GRAD, dy, dy_amax)) is not None:
        return native
    return _unaliased(plan.quantize_grad(dy, dy_amax), (dy, dy_amax))


def _quantize_grad_fake(dy, dy_amax, key, flags, in_features):
    return _grad_plan(dy, key, flags, in_features).empty_grad(dy)


@assume_constant_result
def quantizes_grad_apart(key: int) -> bool:
    """Whether a planned compiled call of template ``key`` quantizes dy with :func:`quantize_grad`:
    not where the gradient format rounds stochastically (its seed is drawn inside the GEMMs' op)."""
    q = template(key).sg.quantizer
    return q is not None and not any(q.codec(d).uses_rng() for d in (ROWWISE, COLUMNWISE))


def _quantize_input_impl(
    x: torch.Tensor, x_amax: torch.Tensor | None, key: int, flags: int, out_features: int
) -> list[torch.Tensor]:
    """x quantized as a planned call of template ``key`` (``flags``: its :class:`CallFlags` code;
    the weight ``[out_features, x.shape[-1]]``) quantizes its input (``LinearPlan.x_layout``'s
    distinct tensors), for ``dtq::linear``'s ``x_payloads``. Its arguments name no module, so the
    calls of GEMMs that read one x the same way (q, k and v; gate and up) are identical, and
    AOTAutograd's common-subexpression pass runs one of them: x is quantized once, and backward
    keeps one copy of its columnwise codes, as eager's ``_LastInput`` does. ``fuse`` (a flag):
    inductor may decompose it into kernels fused with x's producer (``dtq.nn._fused_input``);
    False where x comes out of a dtq kernel, which nothing fuses into: dtq's one-pass kernel
    writes both layouts of the codes from one read, where the decomposition casts and then
    transposes."""
    plan = _input_plan(x, key, flags, out_features)
    if (native := linear_native.payloads(plan, linear_native.INPUT, x, x_amax)) is not None:
        return native
    return _unaliased(plan.quantize_input(x, x_amax), (x, x_amax))


def _quantize_input_fake(x, x_amax, key, flags, out_features):
    return _input_plan(x, key, flags, out_features).empty_input(x)


@assume_constant_result
def quantizes_input_apart(key: int) -> bool:
    """Whether a planned compiled call of template ``key`` quantizes its input with
    :func:`quantize_input` (merged between GEMMs that read one x): not where the input format
    rounds stochastically (each GEMM then draws its own bits)."""
    q = template(key).sx.quantizer
    return not any(q.codec(d).uses_rng() for d in (ROWWISE, COLUMNWISE))


def _planned_weight_impl(
    weight: torch.Tensor, handle: GemmHandle, key: int, flags: int, tokens: int
) -> list[torch.Tensor]:
    """The run-time part of a planned compiled call whose GEMMs the graph runs itself
    (``dtq.nn._fused_input``'s decomposition of ``dtq::linear``): the call's bookkeeping
    (:func:`_begin`, which a graph must not skip) and its high-precision weight quantized with
    dtq's kernel as eager quantizes it (``LinearPlan.w_layout``'s distinct tensors). ``flags``:
    the call's :class:`CallFlags` code; ``tokens``: the rows of its input (the weight's plan is
    that of the 2-D input ``[tokens, weight.shape[1]]``: the same quantization). Where the
    weight's gather took its max|w| (:func:`dtq.weights.gathered_amax`), the quantization takes
    that instead of reading the weight for it: the same bits."""
    f = call_flags(flags)
    _begin(handle, key, f.no_grad_trainable, f.recompute_only, True)
    plan = _weight_plan(weight, key, f, tokens)
    w_amax = gathered_amax(weight) if plan.w_known else None
    if (native := linear_native.payloads(plan, linear_native.WEIGHT, weight, w_amax)) is not None:
        return native  # (fresh tensors: the launch's outputs)
    return _unaliased(plan.quantize_weight(weight, w_amax), (weight,))


def _planned_weight_fake(weight, handle, key, flags, tokens):
    return _weight_plan(weight, key, call_flags(flags), tokens).empty_weight(weight.device)


def _weight_plan(weight: torch.Tensor, key: int, f: CallFlags, tokens: int) -> LinearPlan:
    x_shape, out_features, dev = (tokens, weight.shape[1]), weight.shape[0], weight.device
    return _template_plan(key, f.need_dgrad, f.need_wgrad, x_shape, f.x_dtype, dev, out_features, weight.dtype)


def _dequantize_weight_impl(
    weight: torch.Tensor, w_fields: list[torch.Tensor], wkey: int, dtype: torch.dtype, handle: GemmHandle, gemm: int
) -> torch.Tensor:
    """A quantized weight in high precision (a GEMM outside dtq.autocast), as eager's
    ``DequantizeWeight`` computes it; its gradient passes to the parameter unchanged. ``handle``
    and ``gemm``: whose weight it is (what its layout is, in a graph another process compiled;
    whether FSDP2 gathered it for a recipe, which a forward without one may not use)."""
    handle.check_gathered_for(None)
    out = _weight(weight, w_fields, wkey, lambda: handle.weight(gemm)).dequantize(dtype)
    return out.clone() if any(torch._C._is_alias_of(out, f) for f in w_fields) else out


def _dequantize_weight_fake(weight, w_fields, wkey, dtype, handle, gemm):
    return torch.empty(_weight(weight, w_fields, wkey).shape, dtype=dtype, device=w_fields[0].device)


def _dequantize_setup(ctx, inputs, output):
    pass


def _dequantize_grad(ctx, grad):
    return grad, [], None, None, None, None


linear_backward = define("linear_backward", _linear_backward_impl, _linear_backward_fake)
linear = define("linear", _linear_impl, _linear_fake, backward=_backward, setup_context=_setup_context)
quantize_input = define("quantize_input", _quantize_input_impl, _quantize_input_fake)
quantize_grad = define("quantize_grad", _quantize_grad_impl, _quantize_grad_fake)
planned_weight = define("planned_weight", _planned_weight_impl, _planned_weight_fake)
dequantize_weight = define(
    "dequantize_weight",
    _dequantize_weight_impl,
    _dequantize_weight_fake,
    backward=_dequantize_grad,
    setup_context=_dequantize_setup,
)

# (a public op and the op its graphs call take the weight at the same place)
_WEIGHT_ARG = {
    op: i
    for public, i in ((linear, 1), (linear_backward, 2), (dequantize_weight, 0))
    for op in {public, forward_op(public)}
}


@implements(list(_WEIGHT_ARG))
def _quantized_weight(func, args, kwargs):
    """A quantized weight parameter reaches the ops through QuantizedTensor's dispatch (below
    autograd, which keeps the parameter itself for its gradient): it continues as its payload
    tensors, which is also what a compiled graph holds of it."""
    args = list(args)
    i = _WEIGHT_ARG[func]
    weight = args[i]
    if not isinstance(weight, QuantizedTensor) or args[i + 2] != 0:
        return NotImplemented
    args[i + 1], args[i + 2] = _weight_fields(weight)
    args[i] = torch.empty(0, dtype=weight.dtype, device=weight.device)  # a stand-in: the fields are the weight
    if any(isinstance(a, QuantizedTensor) for a in args):
        return NotImplemented
    return func(*args, **kwargs)
