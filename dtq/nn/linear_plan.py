"""The eager fast path of a plain dtq GEMM call: what :func:`dtq.nn._linear_fn.linear_forward` and
``linear_backward`` decide on every call (the quantize plan of each operand, the GEMM path of
fprop, dgrad and wgrad, which payloads backward keeps) decided once per module GEMM, recipe,
gradient combination, input shape and dtype, and weight kind. A step then runs the kernels with
little Python around them: on a small GEMM the host time of that Python is the step's time.

A plain call is one the general path would run without tensor parallelism, delayed scaling, a
backward override or an amax reduction, with every operand quantized (amaxes its producers
computed, ``x_amax`` and an ``AmaxLink``'s, are taken as the general path takes them); its
recompute under ``torch.utils.checkpoint`` runs planned too. It computes the same kernels on the
same values, so the bits are the general path's (``tests/nn/test_linear_plan.py`` compares them);
anything else takes the general path. What it keeps may differ: FP8 codes written transposed for
dgrad and wgrad on a GPU, and one quantization of an input that several GEMMs read in a row."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from dtq import kernels
from dtq.codec import (
    _NO_AMAX,
    QuantizedData,
    QuantizePlan,
    _given_amaxes,
    _seed,
    as_2d,
    quantize_plan,
    shape_2d,
    wanted_directions,
)
from dtq.formats import COLUMNWISE, ROWWISE
from dtq.gemm import Operand, bind, select, transposed_reads
from dtq.nn._linear_fn import check_weight_columnwise, once_differentiable_lean
from dtq.nn.slot import tensor_amax_directions
from dtq.tensor import QUANTIZED
from dtq.weights import gathered_amax

if TYPE_CHECKING:
    from dtq.nn.gemm_state import GemmCall

_unsafe_view = torch.ops.aten._unsafe_view.default
NATIVE_UNDECIDED = -1  # LinearPlan.native before its first run (eager call or compiled quantize op)


class LinearPlan:
    """One planned GEMM call shape (see the module docstring). Built on a call's first run; the
    GEMM paths are bound on their first use, from that call's operands."""

    __slots__ = (
        "call",
        "device",
        "qx",
        "qw",
        "qg",
        "x_shape",
        "x2d",
        "w2d",
        "g2d",
        "x_dtype",
        "w_dtype",
        "out_shape",
        "quantized_weight",
        "w_quantizer",
        "x_fields",
        "w_fields",
        "x_layout",
        "x_saved",
        "w_layout",
        "g_layout",
        "x_known",
        "w_known",
        "g_known",
        "fprop",
        "fprop_bias",
        "dgrad",
        "wgrad",
        "native",
    )

    def __init__(self, call: GemmCall, x_shape: torch.Size, x_dtype: torch.dtype, dev: torch.device, wl):
        slots = call.slots
        self.call, self.device = call, dev
        self.x_shape, self.x_dtype, self.w_dtype = x_shape, x_dtype, wl.dtype
        self.x2d, self.w2d = shape_2d(x_shape), (wl.shape[0], wl.shape[-1])
        self.g2d = (self.x2d[0], self.w2d[0])
        self.out_shape = (*x_shape[:-1], wl.shape[0])
        self.quantized_weight = isinstance(wl, QUANTIZED)
        self.w_quantizer = wl.quantizer if self.quantized_weight else slots.sw.quantizer
        tx, tw, tg = self._transposed_columnwise(dev)
        self.qx = quantize_plan(
            slots.sx.quantizer, wanted_directions(True, call.need_wgrad), self.x2d, x_dtype, dev, transposed=tx
        )
        self.qw = None
        if not self.quantized_weight:
            dirs = wanted_directions(True, call.need_dgrad)
            self.qw = quantize_plan(self.w_quantizer, dirs, self.w2d, wl.dtype, dev, transposed=tw)
        need_g = call.need_dgrad or call.need_wgrad
        g_dirs = wanted_directions(call.need_dgrad, call.need_wgrad) if need_g else ()
        self.qg = quantize_plan(slots.sg.quantizer, g_dirs, self.g2d, x_dtype, dev, transposed=tg) if g_dirs else None
        # the columnwise fields backward keeps, from the plans' layouts (fixed before any call:
        # the compiled path's fake implementation and backward read them too)
        meta = torch.device("meta")
        self.x_fields = self.w_fields = ()
        ex = self.qx.empty(self.x2d, meta, x_dtype)
        if call.need_wgrad:
            self.x_fields = _saved_fields(ex[COLUMNWISE])
        # x's payloads as a list of distinct tensors (the compiled path's dtq::quantize_input):
        # (direction, field, index) per field, directions' shared tensors listed once
        self.x_layout, self.x_saved = _tensor_layout(ex), ()
        if call.need_wgrad:
            where = {(d, k): i for d, k, i in self.x_layout}
            self.x_saved = tuple(where[COLUMNWISE, k] for k in self.x_fields)
        # a high-precision weight's payloads likewise (the compiled path's dtq::planned_weight)
        self.w_layout = ()
        if self.qw is not None:
            ew = self.qw.empty(self.w2d, meta, wl.dtype)
            self.w_layout = _tensor_layout(ew)
            if call.need_dgrad:
                self.w_fields = _saved_fields(ew[COLUMNWISE])
        # dy's payloads as distinct tensors, likewise (the compiled path's dtq::quantize_grad)
        self.g_layout = _tensor_layout(self.qg.empty(self.g2d, meta, x_dtype)) if self.qg is not None else ()
        # the directions of x and dy whose amax a producer's max|x| / max|dy| stands for
        self.x_known, self.g_known = _tensor_amax_dirs(self.qx, self.x2d), _tensor_amax_dirs(self.qg, self.g2d)
        # and of a high-precision weight whose max|w| its gather took (dtq.weights.gathered_amax)
        self.w_known = _tensor_amax_dirs(self.qw, self.w2d)
        # fprop's GEMM bound on first use, one per output dtype: with a bias it writes fp32 (the
        # bias is added before the one rounding); plans of a slots template serve modules with
        # and without one (a compiled graph's)
        self.fprop = self.fprop_bias = self.dgrad = self.wgrad = None
        # the kernel library's id of this plan where its C++ autograd function runs it eagerly
        # (and a compiled graph's quantize ops run its launches), None where the Python path runs
        # it: decided at its first run (dtq.nn.linear_native.native_of), not where a graph traces it
        self.native: int | None = NATIVE_UNDECIDED

    def fprop_fast_accum(self) -> bool:
        """Whether fprop accumulates fast: the recipe asks for it and fprop's path has it (as
        :meth:`_bind_forward` binds it)."""
        if not self.call.slots.recipe.fprop_fast_accumulation:
            return False
        x_op = _meta_operand(self.call.slots.sx.quantizer, ROWWISE, self.x2d, self.x_dtype, self.device)
        w_op = _meta_operand(self.w_quantizer, ROWWISE, self.w2d, self.w_dtype, self.device, transpose=True)
        return select(x_op, w_op, self.x_dtype).fast_accum

    def _transposed_columnwise(self, dev: torch.device) -> tuple[bool, bool, bool]:
        """Whether x's, the weight's and dy's columnwise codes should also be written transposed by
        their quantize launch: where the GEMM path that will read them (wgrad, dgrad) takes them
        [K, M] (Hopper's FP8 GEMMs), which then spares a transpose kernel per operand per call."""
        call, x_dtype, w_dtype = self.call, self.x_dtype, self.w_dtype
        tx = tw = tg = False
        if dev.type != "cuda":
            return tx, tw, tg
        sx, sg = call.slots.sx.quantizer, call.slots.sg.quantizer
        if call.need_wgrad:
            dy_t = _meta_operand(sg, COLUMNWISE, self.g2d, x_dtype, dev, transpose=True)
            tg, tx = transposed_reads(dy_t, _meta_operand(sx, COLUMNWISE, self.x2d, x_dtype, dev), w_dtype)
        if call.need_dgrad and not self.quantized_weight:
            dy = _meta_operand(sg, ROWWISE, self.g2d, x_dtype, dev)
            _, tw = transposed_reads(dy, _meta_operand(self.w_quantizer, COLUMNWISE, self.w2d, w_dtype, dev), x_dtype)
        return tx, tw, tg

    def forward(
        self,
        x: torch.Tensor,
        wl: torch.Tensor,
        bias: torch.Tensor | None,
        x_amax: torch.Tensor | None,
        share: bool = True,
        x_payloads: list[torch.Tensor] | None = None,
        w_payloads: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(y, tensors to save)`` as ``linear_forward`` computes them (``x_amax``: max|x|, if its
        producer computed it). ``share``: take x's payloads from the previous call that quantized
        x the same way (:class:`_LastInput`); a custom op's outputs may not be shared (False).
        ``x_payloads``: x quantized already (:meth:`quantize_input`); the tensors to save are then
        the weight's only (x's are ``x_payloads[i] for i in x_saved``). ``w_payloads``: the
        high-precision weight quantized already (:meth:`quantize_weight`)."""
        if x_payloads is not None:
            px = _fields(x_payloads, self.x_layout)
        elif share:
            x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            px = _input_payloads(self.qx, x, x2, self.x_known, x_amax)
        else:
            px = _run(self.qx, x if x.dim() == 2 else x.reshape(-1, x.shape[-1]), self.x_known, x_amax)
        if self.quantized_weight:
            pw = {ROWWISE: wl.payload(ROWWISE)}
        elif w_payloads is not None:
            pw = _fields(w_payloads, self.w_layout)
        else:
            w_amax = gathered_amax(wl) if self.w_known else None
            pw = _run(self.qw, as_2d(wl, self.w_quantizer), self.w_known, w_amax)
        fprop = self.fprop if bias is None else self.fprop_bias
        if fprop is None:
            fprop = self._bind_forward(px, pw, x, wl, bias)
        y = fprop(px[ROWWISE], pw[ROWWISE])
        if bias is not None:
            y = y + bias.to(torch.float32)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if x.dim() != 2 or y._is_view() or not y.is_contiguous():
            y = _unsafe_view(y.contiguous(), self.out_shape)
        saved = [px[COLUMNWISE][k] for k in self.x_fields] if x_payloads is None else []
        if self.w_fields:
            saved += [pw[COLUMNWISE][k] for k in self.w_fields]
        return y, saved

    def quantize_input(self, x: torch.Tensor, x_amax: torch.Tensor | None) -> list[torch.Tensor]:
        """x's payloads as :meth:`forward` computes them, as the list ``x_layout`` describes: what
        the compiled path quantizes once for every GEMM that reads x (an op whose identical calls
        AOTAutograd merges)."""
        px = _run(self.qx, x if x.dim() == 2 else x.reshape(-1, x.shape[-1]), self.x_known, x_amax)
        return _distinct(px, self.x_layout)

    def quantize_weight(self, wl: torch.Tensor, w_amax: torch.Tensor | None = None) -> list[torch.Tensor]:
        """A high-precision weight's payloads as :meth:`forward` computes them, as the list
        ``w_layout`` describes (the compiled path's ``dtq::planned_weight``); ``w_amax``: max|w|
        where the weight's gather took it (for the ``w_known`` directions)."""
        return _distinct(_run(self.qw, as_2d(wl, self.w_quantizer), self.w_known, w_amax), self.w_layout)

    def empty_weight(self, device: torch.device) -> list[torch.Tensor]:
        """What :meth:`quantize_weight` returns, empty."""
        return _distinct(self.qw.empty(self.w2d, device, self.w_dtype), self.w_layout)

    def traceable(self, bias: bool) -> bool:
        """Whether this call's GEMMs can run as torch's own ops on the payloads in a compiled graph
        (``dtq.nn._fused_input``), instead of one dtq op per forward and per backward: every path
        ``GemmPath.traceable``, and every operand a path reads as [K, M] codes written so
        (``data_t``) by its quantization. A high-precision weight only (a quantized one is
        refilled by FSDP2's backward gather, which only the op reads); ``bias``: the forward adds
        one (fprop's output is then fp32)."""
        call, dev = self.call, self.device
        if self.quantized_weight or self.qw is None:
            return False
        sx, sg, sw = call.slots.sx.quantizer, call.slots.sg.quantizer, self.w_quantizer
        x_op = _meta_operand(sx, ROWWISE, self.x2d, self.x_dtype, dev)
        w_op = _meta_operand(sw, ROWWISE, self.w2d, self.w_dtype, dev, transpose=True)
        # (A, its layout, B, its layout, output dtype) of fprop, dgrad and wgrad
        gemms = [(x_op, self.x_layout, w_op, self.w_layout, torch.float32 if bias else self.x_dtype)]
        if call.need_dgrad:
            dy = _meta_operand(sg, ROWWISE, self.g2d, self.x_dtype, dev)
            w_t = _meta_operand(sw, COLUMNWISE, self.w2d, self.w_dtype, dev)
            gemms.append((dy, self.g_layout, w_t, self.w_layout, self.x_dtype))
        if call.need_wgrad:
            dy_t = _meta_operand(sg, COLUMNWISE, self.g2d, self.x_dtype, dev, transpose=True)
            x_t = _meta_operand(sx, COLUMNWISE, self.x2d, self.x_dtype, dev)
            gemms.append((dy_t, self.g_layout, x_t, self.x_layout, self.w_dtype))
        for a, la, b, lb, out in gemms:
            if not select(a, b, out).traceable:
                return False
            for op, layout, reads_t in zip((a, b), (la, lb), transposed_reads(a, b, out)):
                if reads_t and (op.direction, "data_t") not in {(d, k) for d, k, _ in layout}:
                    return False  # (the path would transpose the codes with dtq's kernel)
        return True

    def quantize_grad(self, dy: torch.Tensor, dy_amax: torch.Tensor | None) -> list[torch.Tensor]:
        """dy's payloads as :meth:`backward` computes them, as the list ``g_layout`` describes: what
        the compiled path quantizes in its backward graph, ahead of the GEMMs' op."""
        dy2 = (dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])).contiguous()
        return _distinct(_run(self.qg, dy2, self.g_known, dy_amax), self.g_layout)

    def empty_grad(self, dy: torch.Tensor) -> list[torch.Tensor]:
        """What :meth:`quantize_grad` returns, empty."""
        return _distinct(self.qg.empty(self.g2d, dy.device, self.x_dtype), self.g_layout)

    def empty_input(self, x: torch.Tensor) -> list[torch.Tensor]:
        """What :meth:`quantize_input` returns, empty."""
        return _distinct(self.qx.empty(self.x2d, x.device, self.x_dtype), self.x_layout)

    def empty_forward(self, x: torch.Tensor, x_given: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """What :meth:`forward` returns, empty (the compiled path's fake implementation);
        ``x_given``: for a call given ``x_payloads``."""
        dev = x.device
        saved = []
        if self.x_fields and not x_given:
            px = self.qx.empty(self.x2d, dev, self.x_dtype)[COLUMNWISE]
            saved += [px[k] for k in self.x_fields]
        if self.w_fields:
            pw = self.qw.empty(self.w2d, dev, self.w_dtype)[COLUMNWISE]
            saved += [pw[k] for k in self.w_fields]
        return torch.empty(self.out_shape, dtype=self.x_dtype, device=dev), saved

    def _bind_forward(self, px: dict, pw: dict, x: torch.Tensor, wl: torch.Tensor, bias):
        fprop = bind(
            _operand(self.qx.q, px, ROWWISE, self.x2d, x.dtype, x.device),
            _operand(self.w_quantizer, pw, ROWWISE, self.w2d, wl.dtype, x.device, transpose=True),
            torch.float32 if bias is not None else x.dtype,
            fast_accum=self.call.slots.recipe.fprop_fast_accumulation,
        )
        if bias is None:
            self.fprop = fprop
        else:
            self.fprop_bias = fprop
        return fprop

    def backward(
        self,
        dy: torch.Tensor,
        saved: tuple,
        wobj,
        link,
        w_dtype: torch.dtype,
        need_bgrad: bool,
        dy_amax: torch.Tensor | None = None,
        dy_payloads: list[torch.Tensor] | None = None,
    ) -> tuple:
        """``(dx, dw, db)`` as ``linear_backward`` computes them (``link``: the call's AmaxLink;
        ``dy_amax``: max|dy| if computed already; ``dy_payloads``: dy quantized already, by
        :meth:`quantize_grad`)."""
        call = self.call
        dy2 = dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        if self.qg is not None:
            if dy_payloads:
                pg = _fields(dy_payloads, self.g_layout)
            else:
                known = dy_amax
                if link is not None:  # max|dy| from the next op's kernel, where dy is its gradient
                    known = link.take_grad_amax(dy)
                pg = _run(self.qg, dy2, self.g_known, known)
            n = len(self.x_fields)
            if call.need_dgrad:
                if self.quantized_weight:
                    pw = _weight_columnwise(call, wobj)
                else:
                    pw = dict(zip(self.w_fields, saved[n:]))
                if self.dgrad is None:
                    self.dgrad = bind(
                        _operand(self.qg.q, pg, ROWWISE, self.g2d, dy.dtype, dy.device),
                        _operand(self.w_quantizer, {COLUMNWISE: pw}, COLUMNWISE, self.w2d, w_dtype, dy.device),
                        self.x_dtype,
                    )
                dx = self.dgrad(pg[ROWWISE], pw)
            if call.need_wgrad:
                px = dict(zip(self.x_fields, saved[:n]))
                if self.wgrad is None:
                    self.wgrad = bind(
                        _operand(self.qg.q, pg, COLUMNWISE, self.g2d, dy.dtype, dy.device, transpose=True),
                        _operand(self.qx.q, {COLUMNWISE: px}, COLUMNWISE, self.x2d, self.x_dtype, dy.device),
                        w_dtype,
                    )
                dw = self.wgrad(pg[COLUMNWISE], px)
        db = dy2.contiguous().sum(0) if need_bgrad else None
        if dx is not None and dx.shape != self.x_shape:
            dx = dx.reshape(self.x_shape)
        return dx, dw, db


def _operand(q, payloads: dict, direction: str, shape2d, dtype, device, transpose: bool = False) -> Operand:
    """An operand of a call, to choose and bind a GEMM path with (as the general path builds it)."""
    return Operand(QuantizedData(shape2d, dtype, q, payloads, shape2d, device), direction, transpose)


def _meta_operand(q, direction: str, shape2d, dtype, device, transpose: bool = False) -> Operand:
    """An operand like the call's own (format, direction, shape, dtypes, device) with meta payloads:
    enough for :func:`dtq.gemm.transposed_reads` to choose its path before any value exists."""
    payload = q.codec(direction).empty(shape2d, torch.device("meta"), dtype)
    return _operand(q, {direction: payload}, direction, shape2d, dtype, device, transpose)


def _tensor_layout(payloads: dict) -> tuple[tuple[str, str, int], ...]:
    """``(direction, field, i)`` for every field of ``payloads`` (directions in order, fields
    sorted), ``i`` numbering distinct tensors in order of first appearance: directions that share a
    tensor (identical directions, rowwise codes beside transposed ones) share its number."""
    index: dict = {}
    return tuple((d, k, index.setdefault(id(p[k]), len(index))) for d, p in payloads.items() for k in sorted(p))


def _fields(tensors: list[torch.Tensor], layout: tuple) -> dict:
    """The payloads ``{direction: {field: tensor}}`` of distinct tensors listed as ``layout`` says
    (the inverse of :func:`_distinct`)."""
    out: dict = {}
    for d, k, i in layout:
        out.setdefault(d, {})[k] = tensors[i]
    return out


def _distinct(payloads: dict, layout: tuple) -> list[torch.Tensor]:
    """The distinct tensors of ``payloads``, in ``layout``'s numbering (:func:`_tensor_layout`)."""
    out: list[torch.Tensor] = []
    for d, k, i in layout:
        if i == len(out):
            out.append(payloads[d][k])
    return out


def _saved_fields(payload: dict) -> tuple[str, ...]:
    """The columnwise fields backward keeps: with transposed codes (``data_t``), not the [M, K]
    ``data`` too (the GEMM reads only the former; saving both would double the codes' memory)."""
    names = sorted(payload)
    return tuple(n for n in names if n != "data") if "data_t" in payload else tuple(names)


class _LastInput:
    """The last planned input quantization: ``(weak x, x's version, plan, known amax, payloads)``.
    GEMMs that read one tensor one after another (q, k and v of one x; gate and up) quantize it
    once: the same kernels on the same values give the same bits, so the first call's payloads
    serve the next ones, whose backward then keeps the same columnwise codes (one copy instead of
    one per GEMM). A write into x (its version), another quantizer or known amax, or stochastic
    rounding (a seed per call) quantize again. The payloads are held until the next input
    quantization or the next planned backward."""

    entry: tuple | None = None


_LAST = _LastInput()


def _input_payloads(plan: QuantizePlan, x: torch.Tensor, x2: torch.Tensor, known_dirs: tuple, known) -> dict:
    """``plan``'s payloads of the input ``x`` (as the 2-D ``x2``), shared with the previous call
    that quantized the same tensor the same way (:class:`_LastInput`)."""
    if plan.uses_rng:
        return _run(plan, x2, known_dirs, known)
    e = _LAST.entry
    if e is not None and e[2] is plan and e[3] is known and e[0]() is x and e[1] == x._version:
        return e[4]
    out = _run(plan, x2, known_dirs, known)
    _LAST.entry = (weakref.ref(x), x._version, plan, known, out)
    return out


def _run(plan: QuantizePlan, x: torch.Tensor, known_dirs: tuple = (), known: torch.Tensor | None = None) -> dict:
    """``plan``'s payloads of the 2-D ``x`` (``quantize_payloads`` without its lookups); ``known``:
    max|x| computed by x's producer, which stands for the amax of ``known_dirs`` (the plan's
    directions scaled from max|x| over the whole tensor, :func:`_tensor_amax_dirs`), as
    ``Slot.quantize`` uses it."""
    xc = (x.detach() if x.requires_grad else x).contiguous()
    given = _NO_AMAX
    if known is not None and known_dirs:
        if known.dim() or known.dtype != torch.float32 or known.device != xc.device:
            # (the codecs' own check and message for a wrong size; else the 0-dim fp32 they take)
            given = _given_amaxes(plan.q, plan, dict.fromkeys(known_dirs, known), tuple(xc.shape), xc.device)
        else:
            given = dict.fromkeys(known_dirs, known)
    return plan(xc, given, _seed(None, x) if plan.uses_rng else None)


def _tensor_amax_dirs(plan: QuantizePlan | None, shape: tuple[int, int]) -> tuple[str, ...]:
    """The directions of ``plan`` whose amax a producer's max|x| is (``Slot._known_amax``'s rule:
    scaled from max|x| over the whole tensor), among those it computes an amax for itself: decided
    once per plan instead of on every call given a known amax."""
    if plan is None:
        return ()
    dirs = tensor_amax_directions(plan.q, plan.directions, shape)
    return tuple(d for d in plan.own if d in dirs and plan.needs_amax[d])  # (_given_amaxes' filter)


def _weight_columnwise(call: GemmCall, w) -> dict:
    check_weight_columnwise(call, w)
    return w.payload(COLUMNWISE)


def plan_for(call: GemmCall, x: torch.Tensor, wl) -> LinearPlan | None:
    """The cached plan of this call shape, or None where the general path must run (an input or
    weight of another kind than planned ones, or a shape a format refuses: the general path then
    raises its message)."""
    if type(x) is not torch.Tensor or x.dim() < 2:
        return None
    return shape_plan(call, x.shape, x.dtype, x.device, wl)


def shape_plan(
    call: GemmCall, x_shape: torch.Size, x_dtype: torch.dtype, device: torch.device, wl
) -> LinearPlan | None:
    """:func:`plan_for` of an input described by its shape, dtype and device (the compiled path's
    fake implementation and backward have no input tensor; ``x_shape`` has 2 dims or more)."""
    w_kind = wl.quantizer if isinstance(wl, QUANTIZED) else None
    key = (call.need_dgrad, call.need_wgrad, x_shape, x_dtype, device, wl.shape, wl.dtype, w_kind)
    plans = call.slots.plans
    token = kernels.disabled_token()
    hit = plans.get(key)
    if hit is not None and hit[0] == token:
        return hit[1]
    try:
        plan = LinearPlan(call, x_shape, x_dtype, device, wl)
    except ValueError:
        return None
    if len(plans) > 64:
        plans.clear()
    plans[key] = (token, plan)
    return plan


class PlannedLinearFn(torch.autograd.Function):
    """:class:`dtq.nn._linear_fn.LinearFn` of a planned call."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: LinearPlan, x_amax, link):
        y, saved = plan.forward(x, weight, bias, x_amax)
        ctx.save_for_backward(*saved)
        wobj = weight if plan.quantized_weight else None
        ctx.args = (plan, wobj, link, weight.dtype, bias is not None and bias.requires_grad)
        return y

    @staticmethod
    @once_differentiable_lean
    def backward(ctx, dy):
        _LAST.entry = None  # the forward is over: hold no input payloads through backward
        plan, wobj, link, w_dtype, need_bgrad = ctx.args
        dx, dw, db = plan.backward(dy, ctx.saved_tensors, wobj, link, w_dtype, need_bgrad)
        return dx, dw, db, None, None, None
