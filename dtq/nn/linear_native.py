"""Planned FP8 per-tensor calls as one C++ autograd function (``csrc/linear.cpp``).

A planned call (:mod:`dtq.nn.linear_plan`) still runs a Python ``autograd.Function``: its
forward's Python around three launches, and a backward node that autograd's worker thread runs
under the GIL. On a small GEMM that is most of the step's host time. Where a plan's every launch
and GEMM is one the C++ function runs the same way (FP8 per-tensor codes from the fused kernel,
``[K, M]`` codes written by that launch for dgrad and wgrad, ``torch._scaled_mm`` for all three
GEMMs), the plan is described to the kernel library once (:func:`native_id`) and each call is one
crossing into it (:func:`run`). The C++ side runs ``LinearPlan.forward`` / ``backward``'s own
sequence of launches, GEMMs and casts, so the bits are the planned Python path's
(``tests/kernels/test_native_linear.py``). Anything else keeps the Python path.

A compiled graph runs its GEMMs itself, and quantizes through small ops (``dtq.nn._ops``:
``planned_weight``, ``quantize_input``, ``quantize_grad``); where the plan is registered, those
run their launch from the library too (:func:`payloads`), without the quantize plan's Python."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dtq import kernels
from dtq.formats import COLUMNWISE, ROWWISE
from dtq.nn.linear_plan import NATIVE_UNDECIDED, LinearPlan, _distinct
from dtq.weights import PLAIN_TYPES, HighPrecisionWeight

if TYPE_CHECKING:
    from dtq.codec import QuantizePlan

# Off: plans keep the Python path (the tests compare the two; a plan decides at its first run).
enabled = True

_WEIGHT_TYPES = (torch.Tensor, torch.nn.Parameter, HighPrecisionWeight)


def native_of(plan: LinearPlan) -> int | None:
    """``plan.native``, decided (and registered) at the plan's first eager call or compiled
    quantize op (:func:`payloads`)."""
    native = plan.native
    if native == NATIVE_UNDECIDED:
        native = plan.native = native_id(plan)
    return native


def native_id(plan: LinearPlan) -> int | None:
    """The kernel library's id of ``plan`` (registered now), or None where the C++ function would
    not run what the Python plan runs."""
    if not enabled or plan.device.type != "cuda" or plan.quantized_weight or plan.qw is None:
        return None
    if not (plan.traceable(False) and plan.traceable(True)):  # fp8_tensorwise_scaled_mm, [K, M] codes
        return None
    call = plan.call
    x = _launch_ints(plan.qx, plan.x2d, plan.x_dtype, plan.device, plan.x_known)
    w = _launch_ints(plan.qw, plan.w2d, plan.w_dtype, plan.device, plan.w_known)
    g = _launch_ints(plan.qg, plan.g2d, plan.x_dtype, plan.device, plan.g_known) if plan.qg is not None else [0]
    if x is None or w is None or g is None:
        return None
    # which GEMMs the C++ backward runs follows from which codes the launches write
    if _writes(x, _DATA_T) != call.need_wgrad or _writes(g, _DATA_T) != call.need_wgrad:
        return None
    if _writes(w, _DATA_T) != call.need_dgrad or (call.need_dgrad and not _writes(g, _DATA)):
        return None
    native = kernels.extension().register_linear([int(plan.fprop_fast_accum()), *x, *w, *g])
    # (identical descriptions: identical payload layouts)
    layouts = (plan.x_layout, plan.w_layout, plan.g_layout)
    _OUTPUTS[native] = tuple(_order(ints, layout) for ints, layout in zip((x, w, g), layouts))
    return native


# where _launch_ints puts the positions of the [M, K] codes, their scale and the [K, M] codes
_DATA, _SCALE, _DATA_T = 6, 7, 8
# the launches of a registered plan, as native_quantize names them
INPUT, WEIGHT, GRAD = 0, 1, 2
# per registered id and launch: its outputs that the compiled path's quantize ops return, in
# their order (the plan's x_layout / w_layout / g_layout distinct tensors), or None
_OUTPUTS: dict[int, tuple[tuple[int, ...] | None, ...]] = {}


def _order(ints: list[int], layout: tuple) -> tuple[int, ...] | None:
    """The positions among a launch's outputs (``ints``: its description) of ``layout``'s distinct
    payload tensors, or None where the launch does not write them all."""
    if ints[0] != 1:
        return None
    at = {"data": ints[_DATA], "scale_inv": ints[_SCALE], "data_t": ints[_DATA_T]}
    if any(at.get(field, -1) < 0 for _, field, _ in layout):
        return None
    positions: dict = {}
    for d, field, _ in layout:
        positions.setdefault(d, {})[field] = at[field]
    order = tuple(_distinct(positions, layout))  # (the plan's own walk of its layout)
    return order if len(set(order)) == len(order) else None  # (distinct tensors, one output: no)


def _writes(ints: list[int], field: int) -> bool:
    """Whether the launch ``ints`` describes writes the codes at ``field`` (_DATA or _DATA_T)."""
    return ints[0] == 1 and ints[field] >= 0


def _launch_ints(
    qp: QuantizePlan, shape: tuple[int, int], dtype: torch.dtype, device: torch.device, known: tuple[str, ...]
) -> list[int] | None:
    """One quantize plan as ``csrc/linear.cpp`` reads it: ``[1, mode_a, given_a, mode_b, given_b,
    signs, data, scale, data_t, scale_t]`` then the two slots' config and field lists, each
    preceded by its length; None where the plan is not one launch of FP8 per-tensor codes (with
    the columnwise codes written ``[K, M]`` by it, where wanted). ``known``: the directions whose
    amax a producer's max|x| stands for."""
    launch = qp.launch
    if launch is None or qp.derived is not None or qp.reference or qp.torch_amax or qp.uses_rng or launch.stochastic:
        return None
    rows = dict(zip(launch.names[0], range(len(launch.names[0]))))
    if launch.dirs[0] != ROWWISE or set(rows) != {"data", "scale_inv"}:
        return None
    row = qp.empty(shape, torch.device("meta"), dtype)[ROWWISE]
    if row["scale_inv"].shape != () or row["scale_inv"].dtype != torch.float32:
        return None  # (what torch._scaled_mm takes as it is, per-tensor)
    data_t = scale_t = -1
    if COLUMNWISE in qp.directions:
        if not qp.transposed or launch.names[1] != ("data_t",):
            return None
        data_t, scale_t = len(rows), rows["scale_inv"]  # the columnwise payload shares the rowwise scale
    # a transposed launch's two slots both read the rowwise amax where one is given (_call_transposed)
    given = [ROWWISE in known, len(launch.dirs) > 1 and ROWWISE in known]
    head = [1, launch.modes[0], int(given[0]), launch.modes[1], int(given[1]), launch.signs]
    out = head + [rows["data"], rows["scale_inv"], data_t, scale_t]
    for cfg, fields in zip(launch.cfgs, launch.fields):
        out += [len(cfg), *cfg, len(fields), *fields]
    return out


def _known(amax: torch.Tensor | None, dirs: tuple[str, ...], device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """A producer's amax as a launch reads it: dropped where no direction takes it (the Python
    path ignores it too); not ok where it is not the 0-dim fp32 on ``device`` the launch reads
    (the Python path then checks it and says what is wrong)."""
    if amax is None or not dirs:
        return None, True
    return amax, not amax.dim() and amax.dtype == torch.float32 and amax.device == device


def run(
    plan: LinearPlan, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x_amax: torch.Tensor | None
) -> torch.Tensor | None:
    """``y`` of the planned call through the C++ function, or None where this call must take the
    Python path (a weight of another kind, a producer's amax that is not the 0-dim fp32 tensor
    the launch reads: the Python path then checks it and says what is wrong), or a plan the C++
    function does not run."""
    native = native_of(plan)
    if native is None or type(weight) not in _WEIGHT_TYPES:
        return None
    x_amax, ok = _known(x_amax, plan.x_known, x.device)
    if not ok:
        return None
    w_data = weight._data if type(weight) is HighPrecisionWeight else weight
    return kernels.extension().native_linear(x, weight, w_data, bias, x_amax, native)


def payloads(
    plan: LinearPlan, which: int, t: torch.Tensor, known: torch.Tensor | None = None
) -> list[torch.Tensor] | None:
    """The compiled path's quantize ops through the kernel library: ``plan.quantize_input(t,
    known)`` (``which`` INPUT), ``quantize_weight(t, known)`` (WEIGHT) or ``quantize_grad(t, known)``
    (GRAD), the same launch with the same bits and outputs. Each is one op call per GEMM and step
    whose Python (the quantize plan's, and the launch's list arguments) is most of its host time.
    None where the plan is not one the C++ function runs, or the Python path must look at
    ``known`` (not the 0-dim fp32 the launch reads: it then says what is wrong)."""
    native = native_of(plan)
    # (plain tensors and parameters: a graph hands FSDP2's unsharded weight over as an nn.Parameter)
    if native is None or type(t) not in PLAIN_TYPES:
        return None
    order = _OUTPUTS[native][which]
    if order is None:
        return None
    dirs = plan.x_known if which == INPUT else plan.g_known if which == GRAD else plan.w_known
    known, ok = _known(known, dirs, t.device)
    if not ok:
        return None
    outs = kernels.extension().native_quantize(t, known, native, which)
    return [outs[i] for i in order]
