"""The mechanics of dtq's FSDP2 all-gather extensions, for both parameter modes.

* high-precision shards (default): a dtq module's GEMM weight is a ``HighPrecisionWeight``
  (:mod:`dtq.weights`); its ``fsdp_pre_all_gather`` quantizes the local shard with the module's
  current weight quantizer and a global amax (precomputed by ``dtq.parallel.precompute_amax``, or
  reduced on the spot);
* quantized parameters: the sharded parameter is a ``QuantizedTensor`` and its stored payloads
  are gathered as they are.

Either way the all-gather inputs are the row-structured payload fields of the directions this
gather needs; per-tensor fields (one global scale) travel in the metadata. The unsharded
parameter is a ``QuantizedTensor`` whose payloads are views of the gathered buffers
(:func:`gathered_payloads`; the tensor layer wraps them).

What a gather serves (recipe, quantizer, directions) is the module's decision, not this layer's:
the hooks ask ``module.gemm_state`` through :class:`GatherPlanner`. Directions: a forward gather
with ``reshard_after_forward=True`` moves rowwise payloads only and the backward gather
columnwise only (both when the module will be recomputed); with ``False`` the forward gather
moves both once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from dtq._bits import as_bytes
from dtq._torch_private import GatherContext, gather_context, resize_gather_buffers
from dtq._warn import warn_once
from dtq.codec import (
    COLUMNWISE,
    DIRECTIONS,
    ROWWISE,
    columnwise_from_rowwise,
    quantize_payloads,
    row_bytes,
    shape_2d,
    split_derived,
)
from dtq.distributed import comm
from dtq.distributed.amax import reduce_over_shards, sharded_amax
from dtq.distributed.world import check_launched_world

if TYPE_CHECKING:
    from dtq.formats import Quantizer


class GatherPlan(NamedTuple):
    """What one gather of one weight serves: the quantizer and the directions to move, for delayed
    scaling the function that turns the global current amax into the amax the weight is quantized
    with, and whether the gather falls back to high precision (an identity quantizer then: counted
    and warned about in ``comm_stats``, with ``why`` when the module chose it)."""

    quantizer: Quantizer
    directions: tuple[str, ...]
    weight_amax: Callable[[dict], torch.Tensor] | None = None
    fallback: bool = False
    why: str = (
        "no dtq recipe is active for its module (run the step under dtq.autocast) or the "
        "recipe asks for the high-precision weight in backward"
    )


class GatherPlanner(Protocol):
    """``module.gemm_state`` of the module FSDP2 hands to the hooks (``dtq.nn.gemm_state.GemmState``)."""

    def gather_plan(self, ctx: GatherContext, quantizer: Quantizer | None, have: tuple[str, ...]) -> GatherPlan: ...


class _GatherMeta(NamedTuple):  # (a tuple: made on every gather of every weight)
    quantizer: Quantizer
    directions: tuple[str, ...]
    layout: tuple[tuple[str, str], ...]  # (direction, field) of each all-gather input
    shared: dict  # (direction, field) -> per-tensor tensor, identical on every rank
    full_shape: torch.Size
    aliases: dict  # direction -> the gathered direction whose payload it is bitwise
    param_name: str
    packed: tuple | None = None  # (world, [(dtype, padded shard shape, rows per entry)]) when packed
    dtypes: tuple = ()  # each unpacked input's payload dtype (1-byte floats travel as uint8)
    derived: tuple = ()  # directions computed from the gathered ones (``split_derived``), not moved


def _check_supported(ctx: GatherContext) -> None:
    if ctx.post_forward_mesh:
        raise ValueError(
            f"dtq: {ctx.param_name} belongs to the FSDP2 module {ctx.module_name or '<root>'!r}, sharded with "
            "fully_shard(..., reshard_after_forward=<int>): FSDP2 would re-shard the gathered quantized payloads "
            "over a smaller group after forward, which dtq's all-gather extensions do not support. Use "
            "reshard_after_forward=True (reshard over the whole group) or False (keep the weight gathered until "
            "backward) for modules holding dtq weights"
        )


def _padded_rows(full_shape, world: int) -> int:
    return -(-full_shape[0] // world)  # torch.chunk's shard size: every shard but the last


def _rows_per_index(full_shape) -> int:
    return shape_2d(full_shape)[0] // max(full_shape[0], 1) if len(full_shape) > 1 else 1


_aligned: set = set()  # the (quantizer, directions, shape, world) that passed _check_alignment


def _check_alignment(ctx: GatherContext, quantizer: Quantizer, dirs, full_shape, world: int):
    """docs/design.md §5.4: a gathered direction's dim-0 blocks must not straddle two shards."""
    key = (quantizer, tuple(dirs), tuple(full_shape), world)
    if key in _aligned:
        return
    shard_rows = _padded_rows(full_shape, world)
    for d in dirs:
        need = quantizer.block_rows(d)
        if world > 1 and (shard_rows * _rows_per_index(full_shape)) % need:
            raise ValueError(
                f"dtq: cannot all-gather {ctx.param_name} (shape {list(full_shape)}) as "
                f"{quantizer.for_direction(d).format_name} "
                f"{d} payloads over {world} FSDP ranks: each shard has {shard_rows} rows but {d} blocks span {need} "
                f"rows, so a block would be split across ranks. Use a shard count that makes dim 0 / world size a "
                f"multiple of {need}, a format with smaller {d} blocks for this parameter, or keep its layer out of "
                f"dtq.convert (dtq.convert(model, recipe=..., fsdp_world={world}) skips and reports such layers)"
            )
    if len(_aligned) > 4096:
        _aligned.clear()
    _aligned.add(key)


def _record(lay: _Layout, fields, world: int, moved_bytes: int) -> list[tuple[str, int]]:
    """Bytes all-gathered per direction (``comm_stats`` keys); any packing slack is charged to the
    first direction."""
    per_dir: dict[str, int] = {}
    for (d, _), t in zip(lay.layout, fields):
        per_dir[d] = per_dir.get(d, 0) + t.numel() * t.element_size() * world
    if per_dir:
        first = next(iter(per_dir))
        per_dir[first] += moved_bytes - sum(per_dir.values())
    return [(f"{name}/{d}", per_dir[d]) for d, name in lay.format_names if d in per_dir]


def _pack(inputs: list[torch.Tensor], shape) -> torch.Tensor:
    """All fields' bytes in one all-gather input: flat, or (for FSDP2's uneven-shard rule that
    every input has the padded parameter-shard shape) in a container of that shape whose dtype
    is the narrowest that holds them."""
    flat = torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in inputs])
    if shape is None:
        return flat
    n = max(1, torch.Size(shape).numel())
    itemsize = next((i for i in (1, 2, 4, 8) if i * n >= flat.numel()), None)
    if itemsize is None:
        raise RuntimeError(f"dtq: {flat.numel()} payload bytes do not fit an all-gather input of shape {list(shape)}")
    buf = torch.zeros(n * itemsize, dtype=torch.uint8, device=flat.device)
    buf[: flat.numel()] = flat
    return buf.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]).view(shape)


def _unpack(output: torch.Tensor, meta: _GatherMeta) -> list[torch.Tensor]:
    world, specs = meta.packed
    per_rank = output.contiguous().view(torch.uint8).reshape(world, -1)
    full_rows = shape_2d(meta.full_shape)[0]
    pad_rows = _padded_rows(meta.full_shape, world) * _rows_per_index(meta.full_shape)
    fields = []
    offset = 0
    for dtype, shape, rows_per_entry in specs:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        pieces = []
        for r in range(world):
            valid = max(0, min(pad_rows, full_rows - r * pad_rows))  # payload rows this rank really has
            t = per_rank[r, offset : offset + nbytes].view(dtype).view(shape)
            pieces.append(t[: -(-valid // rows_per_entry)])
        fields.append(pieces[0] if world == 1 else torch.cat(pieces))
        offset += nbytes
    return fields


def gathered_payloads(outputs, meta: _GatherMeta) -> dict[str, dict]:
    """The unsharded parameter's payloads: views of the all-gather outputs, with the per-tensor
    fields from the metadata and aliased directions sharing their twin's tensors."""
    if meta.packed is not None:
        outputs = _unpack(outputs[0], meta)
    payloads: dict[str, dict] = {d: {} for d in meta.directions}
    for (d, field), t, dtype in zip(meta.layout, outputs, meta.dtypes or [None] * len(meta.layout)):
        payloads[d][field] = t.view(dtype) if dtype is not None and t.dtype != dtype else t
    for (d, field), t in meta.shared.items():
        payloads[d][field] = t
    for d, src in meta.aliases.items():
        payloads[d] = dict(payloads[src])
    for d in meta.derived:  # the whole tensor's rows are here: bitwise what quantizing the whole gives
        payloads[d] = columnwise_from_rowwise(meta.quantizer, payloads[ROWWISE], shape_2d(meta.full_shape))
    return {d: payloads[d] for d in DIRECTIONS if d in payloads}


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What :func:`_finish` derives from a gather's structure alone (quantizer, directions, full
    shape, world size), made once per structure: FSDP2 calls the hooks for every weight on every
    gather, so their host time is on each step's critical path. ``packed``: the fields go into
    one packed input (:func:`_pack`), built per call."""

    aliases: dict
    layout: tuple  # (direction, field) of each row-structured field, in input order
    shared: tuple  # (direction, field) of each per-tensor field (travels in the metadata)
    rows: tuple  # rows per entry of each row-structured field
    packed: bool
    shard_shape: tuple | None  # the padded shard's shape, for an uneven packed gather
    pad_rows: int
    format_names: tuple  # (direction, format name) of each moved direction, for comm_stats
    derived_bytes: tuple  # (format name, direction, bytes) of each derived direction


_layouts: dict = {}


def _gather_layout(quantizer: Quantizer, dirs: tuple, full_shape, world: int, derived: tuple) -> _Layout:
    key = (quantizer, dirs, tuple(full_shape), world, derived)
    found = _layouts.get(key)
    if found is not None:
        return found
    aliases = quantizer.aliases(tuple(dirs))
    moved = tuple(d for d in dirs if d not in aliases)
    layout, shared, rows = [], [], []
    for d in moved:
        for field, r in quantizer.codec(d).fields().items():
            if r is None:
                shared.append((d, field))
            else:
                layout.append((d, field))
                rows.append(r)
    uneven = full_shape[0] % world != 0
    # FSDP2's single-rank shortcut copies only the first all-gather input, and with uneven shards
    # it wants every input in the padded shard's shape: such gathers pack all fields into one (a
    # single field on one rank travels as it is, sparing two copies of the weight).
    packed = uneven or (world == 1 and len(layout) > 1)
    pad_rows = _padded_rows(full_shape, world) * _rows_per_index(full_shape)
    shard2d = (pad_rows, shape_2d(full_shape)[1])
    found = _Layout(
        aliases,
        tuple(layout),
        tuple(shared),
        tuple(rows),
        packed,
        (_padded_rows(full_shape, world), *full_shape[1:]) if uneven else None,
        pad_rows,
        tuple((d, quantizer.for_direction(d).format_name) for d in moved),
        tuple(
            (quantizer.for_direction(d).format_name, f"{d}_derived", row_bytes(quantizer, d, shard2d) * world)
            for d in derived
        ),
    )
    if len(_layouts) > 4096:
        _layouts.clear()
    _layouts[key] = found
    return found


def _finish(
    ctx: GatherContext,
    quantizer,
    dirs,
    payloads,
    full_shape,
    world,
    fallback: str | None = None,
    derived=(),
    lay: _Layout | None = None,
    records: list | None = None,
):
    """The all-gather inputs and metadata of ``payloads``. ``lay``: the gather's layout where the
    caller has it; ``records``: a list that keeps this gather's byte counts (its first call fills
    it, later ones add the same counts without working them out again: they depend only on the
    layout and the shapes)."""
    if lay is None:
        lay = _gather_layout(quantizer, tuple(dirs), full_shape, world, tuple(derived))
    fields = [payloads[d][f].contiguous() for d, f in lay.layout]
    shared = {k: payloads[k[0]][k[1]] for k in lay.shared}
    packed = None
    if lay.packed:
        specs, padded = [], []
        for t, rows_per_entry in zip(fields, lay.rows):
            t = _pad_rows(t, -(-lay.pad_rows // rows_per_entry))
            specs.append((t.dtype, tuple(t.shape), rows_per_entry))
            padded.append(t)
        fields = padded
        inputs = [_pack(padded, lay.shard_shape)]
        packed = (world, specs)
        dtypes = ()
    else:
        # FP8 codes travel as bytes: a group whose inputs are all FP8 would get an FP8 all-gather
        # buffer, which gloo (and any backend without FP8 collectives) rejects.
        dtypes = tuple(t.dtype for t in fields)
        inputs = [as_bytes(t) for t in fields]
    resize_gather_buffers(ctx, inputs, world)
    if records:
        comm.add(records)
    else:
        moved_bytes = sum(t.numel() * t.element_size() for t in inputs) * world
        if fallback:
            comm.record_fallback(payloads[dirs[0]]["data"].dtype, moved_bytes, ctx.param_name, fallback)
        else:
            counts = _record(lay, fields, world, moved_bytes)
            counts += [(f"{name}/{what}", nbytes) for name, what, nbytes in lay.derived_bytes]
            comm.add(counts)
            if records is not None:
                records += counts
    full = torch.Size(full_shape)
    meta = _GatherMeta(quantizer, dirs, lay.layout, shared, full, lay.aliases, ctx.param_name, packed, dtypes, derived)
    return tuple(inputs), meta


class _Static(NamedTuple):
    """What the gathers of one weight in one plan (quantizer, directions, mesh, shapes) decide
    before any value: kept on the weight per gathered directions, so each gather of a step runs
    only the per-value part (FSDP2 calls the hook for every weight on every gather, on each step's
    critical path)."""

    key: tuple  # (quantizer, planned directions, delayed, mesh, full shape, shard shape, gathered dtype)
    world: int
    dirs: tuple  # the directions moved
    derived: tuple  # the directions derived after the gather
    reusable: bool  # a backward gather may take the forward's quantized shard
    lay: _Layout
    records: list  # comm_stats' byte counts of one gather (filled by the first)


def _static(weight, quantizer, plan_dirs: tuple, delayed: bool, mesh, outer_size, shard_shape, dtype, ctx) -> _Static:
    key = (quantizer, plan_dirs, delayed, mesh, outer_size, shard_shape, dtype)
    memo = weight._gather_static
    found = memo.get(plan_dirs)
    if found is not None and found.key == key:  # (identity first: the same quantizer and mesh objects)
        return found
    world = mesh.size()
    _check_alignment(ctx, quantizer, plan_dirs, outer_size, world)
    dirs, derived = split_derived(quantizer, plan_dirs, shape_2d(shard_shape))
    # (delayed scaling's amax moves with its history, not with the weight, and stochastic
    # rounding draws anew: quantized anew)
    reusable = not delayed and not any(quantizer.codec(d).uses_rng() for d in dirs)
    lay = _gather_layout(quantizer, tuple(dirs), outer_size, world, tuple(derived))
    found = memo[plan_dirs] = _Static(key, world, dirs, derived, reusable, lay, [])
    return found


def high_precision_pre_all_gather(weight: torch.Tensor, data: torch.Tensor, mesh, outer_size, module, mp_policy):
    """``HighPrecisionWeight.fsdp_pre_all_gather``: quantize this rank's shard ``data`` of
    ``weight`` as the module's plan says, with the global amax."""
    ctx = gather_context(weight)
    _check_supported(ctx)
    check_launched_world()
    param_dtype = mp_policy.param_dtype or weight.dtype
    plan = _planner(module, ctx).gather_plan(ctx, None, DIRECTIONS)
    quantizer = plan.quantizer
    if plan.fallback:
        dirs, world = plan.directions, mesh.size()
        payloads = quantize_payloads(quantizer, data.detach().to(param_dtype), dirs)
        _keep_shard(weight, ctx, None, payloads)
        return _finish(ctx, quantizer, dirs, payloads, outer_size, world, plan.why)
    delayed = plan.weight_amax is not None
    st = _static(weight, quantizer, plan.directions, delayed, mesh, outer_size, data.shape, param_dtype, ctx)
    dirs = st.dirs
    key = amax_key(weight, data, quantizer, param_dtype) if st.reusable else None
    payloads = _reused_shard(weight, key, quantizer, dirs) if key is not None else None
    if payloads is None:
        shard = data.detach().to(param_dtype)
        fused = plan.weight_amax is None  # (one rank: the quantize pass takes the amax itself)
        amax = _global_amax(weight, data, quantizer, shard, mesh, ctx.param_name, dirs, fused, st.world)
        if plan.weight_amax is not None:
            amax = plan.weight_amax(amax)
        payloads = quantize_payloads(quantizer, shard, dirs, amax=amax)
    _keep_shard(weight, ctx, key, payloads)
    return _finish(ctx, quantizer, dirs, payloads, outer_size, st.world, None, st.derived, st.lay, st.records)


def _reused_shard(weight, key: tuple, quantizer: Quantizer, dirs) -> dict | None:
    """The payloads of ``dirs`` from the quantization an earlier gather of the same values kept
    (:func:`_keep_shard`), a direction bitwise another's (``Quantizer.aliases``) served by its
    twin; None unless every direction is there."""
    have = weight.cached_shard(key)
    if have is None:
        return None
    out = {}
    for d in dirs:
        src = d if d in have else _twin(quantizer, d, tuple(have))
        if src is None:
            return None
        out[d] = have[src]
    return out


_twins: dict = {}


def _twin(quantizer: Quantizer, d: str, have: tuple) -> str | None:
    """The direction of ``have`` whose payload is bitwise ``d``'s, if any (per quantizer, once)."""
    key = (quantizer, d, have)
    if key not in _twins:
        if len(_twins) > 4096:
            _twins.clear()
        _twins[key] = next((s for s in have if quantizer.aliases((s, d)).get(d) == s), None)
    return _twins[key]


def _keep_shard(weight, ctx: GatherContext, key: tuple | None, payloads: dict) -> None:
    """A forward gather that FSDP2 reshards after (``reshard_after_forward=True``) keeps its
    quantized shard (``key``: None where it may not be reused) for the backward gather of the
    same values, which then moves it without quantizing again (per-tensor FP8: the same codes
    serve dgrad). Every other gather lets it go: the backward one (reused or not: a high-precision
    backward, delayed scaling), a forward that keeps the weight gathered, an explicit unshard.
    Costs the quantized shard's memory (1/world of the quantized weight) from forward to backward,
    and after a forward without backward (evaluation) until the weight's next gather."""
    if key is not None and ctx.training_state == "FORWARD" and ctx.reshard_after_forward:
        weight.remember_shard(key, payloads)
    else:
        weight.remember_shard(None)


def quantized_pre_all_gather(weight: torch.Tensor, quantizer: Quantizer, payloads: dict, mesh, outer_size, module):
    """``QuantizedTensor.fsdp_pre_all_gather``: the stored ``payloads`` of the directions the
    module's plan needs, as they are."""
    ctx = gather_context(weight)
    _check_supported(ctx)
    check_launched_world()
    world = mesh.size()
    dirs = _planner(module, ctx).gather_plan(ctx, quantizer, tuple(payloads)).directions
    _check_alignment(ctx, quantizer, dirs, outer_size, world)
    derived = ()
    if ROWWISE in payloads:  # a rowwise_dequantized hybrid's columnwise payload: moved or derived, by bytes
        dirs, derived = split_derived(quantizer, dirs, shape_2d(weight.shape))
    return _finish(ctx, quantizer, dirs, {d: payloads[d] for d in dirs}, outer_size, world, derived=derived)


def _planner(module, ctx: GatherContext) -> GatherPlanner:
    state = getattr(module, "gemm_state", None)
    if state is None:
        raise TypeError(
            f"dtq: FSDP2 gathers {ctx.param_name}, a dtq weight held by {type(module).__name__}, which is "
            "not a dtq module (no gemm_state says which recipe its GEMMs run); keep dtq weights in dtq "
            "modules (dtq.convert puts them there)"
        )
    return state


def amax_key(weight: torch.Tensor, data: torch.Tensor, quantizer: Quantizer, dtype: torch.dtype) -> tuple:
    """What a cached global amax is valid for: this shard's values (an in-place op through the
    wrapper, FSDP2's DTensor included, bumps the wrapper's counter; one on the unwrapped data
    bumps the data's), the quantizer and the dtype the gather casts to. ``weight`` is the
    ``HighPrecisionWeight`` (which keeps the cache), ``data`` the plain tensor it wraps."""
    return (weight._version, data._version, quantizer, dtype)


def _amax_directions(quantizer: Quantizer, dirs) -> set[str]:
    """The directions whose amax quantizing ``dirs`` takes (a columnwise payload quantized from the
    rowwise one takes the rowwise amax too)."""
    need = {d for d in dirs if quantizer.codec(d).needs_amax()}
    if COLUMNWISE in dirs and quantizer.columnwise_from_rowwise() and quantizer.codec(ROWWISE).needs_amax():
        need.add(ROWWISE)
    return need


def _global_amax(
    local: torch.Tensor,
    data: torch.Tensor,
    quantizer: Quantizer,
    shard: torch.Tensor,
    mesh,
    name: str,
    dirs,
    fused: bool = False,
    world: int | None = None,
) -> dict | None:
    """The whole weight's amaxes for quantizing ``shard``: cached (``precompute_amax``, or an
    earlier gather of the same values), or taken and reduced now. None when the shard is the whole
    weight and ``fused`` (the caller quantizes with the amax as it is): the quantize then takes
    the amax in the same pass as the values, as it would for the unsharded weight. ``world``:
    ``mesh.size()``, where the caller has it."""
    key = amax_key(local, data, quantizer, shard.dtype)
    cached = local.cached_amax(key)
    if cached is not None and _amax_directions(quantizer, dirs) <= set(cached):
        return cached
    if fused and (world if world is not None else mesh.size()) == 1:
        return None

    def reduce(amax: dict) -> dict:
        if mesh.size() == 1:
            return amax
        warn_once(
            "fsdp-amax-on-the-fly",
            f"dtq: reducing the amax of {name} (and of every parameter like it) in its own all-reduce during "
            "the FSDP2 all-gather; call dtq.parallel.precompute_amax(model) after optimizer.step() to do "
            "all of them in one batched all-reduce",
        )
        return reduce_over_shards(amax, mesh.get_group())

    try:  # both directions at once, so the backward gather reuses this reduction
        amax = sharded_amax(quantizer, shard, reduce)
    except ValueError:  # a direction this shard cannot hold (it is not gathered either)
        amax = sharded_amax(quantizer, shard, reduce, rowwise=ROWWISE in dirs, columnwise=COLUMNWISE in dirs)
    local.remember_amax(key, amax)
    return amax
