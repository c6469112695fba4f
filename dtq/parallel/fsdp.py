"""FSDP2 all-gather extensions: plain ``fully_shard`` on a dtq model gathers quantized payloads.

Two parameter modes share one gather path:

* high-precision shards (default): a dtq module's GEMM weight is a :class:`HighPrecisionWeight`;
  its ``fsdp_pre_all_gather`` quantizes the local shard with the module's current weight
  quantizer and a global amax (precomputed by :func:`precompute_amax`, or reduced on the spot);
* quantized parameters: the sharded parameter is a ``QuantizedTensor`` and its stored payloads are
  gathered as they are.

Either way the all-gather inputs are the row-structured payload fields of the directions this
gather needs; per-tensor fields (one global scale) travel in the metadata. The unsharded
parameter is a ``QuantizedTensor`` whose payloads are views of the gathered buffers.

Directions: a forward gather with ``reshard_after_forward=True`` moves rowwise payloads only and
the backward gather columnwise only (both when the module will be recomputed); with ``False`` the
forward gather moves both once. The module tells which recipe and backward override it runs.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch.utils._pytree import tree_map

from dtq._bits import as_bytes
from dtq.autocast import active_amax_sync, active_recipe
from dtq.formats import COLUMNWISE, ROWWISE, IdentityQuantizer, Quantizer, codec_for
from dtq.formats.base import quantize_payloads, shape_2d
from dtq.parallel import comm
from dtq.parallel.amax import all_reduce_max, reduce_over_shards
from dtq.parallel._torch_private import GatherContext, gather_context, in_backward, resize_gather_buffers
from dtq.parallel.world import check_launched_world
from dtq.tensor import QuantizedTensor, warn_once


@dataclasses.dataclass(frozen=True)
class _GatherMeta:
    quantizer: Quantizer
    directions: tuple[str, ...]
    layout: tuple[tuple[str, str], ...]  # (direction, field) of each all-gather input
    shared: dict  # (direction, field) -> per-tensor tensor, identical on every rank
    full_shape: torch.Size
    aliases: dict  # direction -> the gathered direction whose payload it is bitwise
    param_name: str
    packed: tuple | None = None  # (world, [(dtype, padded shard shape, rows per entry)]) when packed
    dtypes: tuple = ()  # each unpacked input's payload dtype (1-byte floats travel as uint8)


def _gather_recipe(ctx: GatherContext, module):
    """The recipe a gather serves: in forward the one the module's forward resolves (FSDP2 gathers
    inside the module call, so inside the user's dtq.autocast, else under the recipe dtq.convert
    bound; None means high precision); in backward, which runs outside autocast and possibly on
    autograd's own thread, the one the module last ran."""
    if ctx.training_state == "FORWARD":
        return module.gemm_state.resolve(in_backward())  # as the module's forward resolves it
    return active_recipe() or module.gemm_state.recipe


def _needed_directions(ctx: GatherContext, module, quantizer: Quantizer, have: tuple[str, ...]) -> tuple[str, ...]:
    recipe = _gather_recipe(ctx, module)
    override = recipe.backward_override if recipe is not None else None
    columnwise_for_backward = override is None
    rowwise_for_backward = override is not None or module.gemm_state.recompute
    state = ctx.training_state
    if state == "FORWARD":  # (FSDP2 gathers under no_grad: grad mode says nothing here)
        want = {ROWWISE}
        if not ctx.reshard_after_forward:  # kept unsharded until backward: bring backward's payload too
            want |= {COLUMNWISE} if columnwise_for_backward else {ROWWISE}
    elif state == "PRE_BACKWARD":
        want = ({COLUMNWISE} if columnwise_for_backward else set()) | ({ROWWISE} if rowwise_for_backward else set())
    else:  # an explicit unshard(), state-dict gathering, ...: everything the recipe uses
        want = {ROWWISE} | ({COLUMNWISE} if columnwise_for_backward else set())
    dirs = tuple(d for d in (ROWWISE, COLUMNWISE) if d in want and d in have)
    if not dirs:
        raise RuntimeError(f"dtq: FSDP2 gathers {ctx.param_name} in state {state} and needs {sorted(want)}, but the "
                           f"sharded parameter only holds {list(have)}; quantize it with both directions")
    return dirs


def _check_supported(ctx: GatherContext) -> None:
    if ctx.post_forward_mesh:
        raise ValueError(
            f"dtq: {ctx.param_name} belongs to the FSDP2 module {ctx.module_name or '<root>'!r}, sharded with "
            "fully_shard(..., reshard_after_forward=<int>): FSDP2 would re-shard the gathered quantized payloads "
            "over a smaller group after forward, which dtq's all-gather extensions do not support. Use "
            "reshard_after_forward=True (reshard over the whole group) or False (keep the weight gathered until "
            "backward) for modules holding dtq weights")


def _padded_rows(full_shape, world: int) -> int:
    return -(-full_shape[0] // world)  # torch.chunk's shard size: every shard but the last


def _rows_per_index(full_shape) -> int:
    return shape_2d(full_shape)[0] // max(full_shape[0], 1) if len(full_shape) > 1 else 1


def _check_alignment(ctx: GatherContext, quantizer: Quantizer, dirs, full_shape, world: int):
    """docs/design.md §5.4: a gathered direction's dim-0 blocks must not straddle two shards."""
    shard_rows = _padded_rows(full_shape, world)
    for d in dirs:
        need = quantizer.block_rows(d)
        if world > 1 and (shard_rows * _rows_per_index(full_shape)) % need:
            raise ValueError(
                f"dtq: cannot all-gather {ctx.param_name} (shape {list(full_shape)}) as {quantizer.for_direction(d).format_name} "
                f"{d} payloads over {world} FSDP ranks: each shard has {shard_rows} rows but {d} blocks span {need} "
                f"rows, so a block would be split across ranks. Use a shard count that makes dim 0 / world size a "
                f"multiple of {need}, a format with smaller {d} blocks for this parameter, or keep its layer out of "
                f"dtq.convert (dtq.convert(model, recipe=..., fsdp_world={world}) skips and reports such layers)")


def _split(quantizer: Quantizer, payloads: dict, dirs) -> tuple[list[torch.Tensor], tuple, dict]:
    inputs, layout, shared = [], [], {}
    for d in dirs:
        sub = quantizer.for_direction(d)
        for field, rows in codec_for(sub).fields(sub, d).items():
            t = payloads[d][field]
            if rows is None:
                shared[(d, field)] = t
            else:
                inputs.append(t.contiguous())
                layout.append((d, field))
    return inputs, tuple(layout), shared


def _record(quantizer: Quantizer, layout, fields, world: int, moved_bytes: int) -> None:
    """Bytes all-gathered per direction; any packing slack is charged to the first direction."""
    per_dir: dict[str, int] = {}
    for (d, _), t in zip(layout, fields):
        per_dir[d] = per_dir.get(d, 0) + t.numel() * t.element_size() * world
    if per_dir:
        first = next(iter(per_dir))
        per_dir[first] += moved_bytes - sum(per_dir.values())
    for d, n in per_dir.items():
        comm.record(quantizer.for_direction(d).format_name, d, n)


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
    buf[:flat.numel()] = flat
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
            t = per_rank[r, offset:offset + nbytes].view(dtype).view(shape)
            pieces.append(t[:-(-valid // rows_per_entry)])
        fields.append(torch.cat(pieces))
        offset += nbytes
    return fields


def post_all_gather(outputs, meta: _GatherMeta, param_dtype: torch.dtype, out: QuantizedTensor | None = None):
    if meta.packed is not None:
        outputs = _unpack(outputs[0], meta)
    payloads: dict[str, dict] = {d: {} for d in meta.directions}
    for (d, field), t, dtype in zip(meta.layout, outputs, meta.dtypes or [None] * len(meta.layout)):
        payloads[d][field] = t.view(dtype) if dtype is not None and t.dtype != dtype else t
    for (d, field), t in meta.shared.items():
        payloads[d][field] = t
    for d, src in meta.aliases.items():
        payloads[d] = dict(payloads[src])
    if out is not None:
        # FSDP2 keeps one unsharded parameter object across gathers (autograd accumulates into
        # it); refill it with this gather's payloads (a TP parameter's local tensor: the object
        # GEMMs saved for backward).
        if hasattr(out, "device_mesh"):
            out = out._local_tensor
        out._quantizer, out._payloads, out._shape2d = meta.quantizer, payloads, shape_2d(meta.full_shape)
        return None
    return QuantizedTensor(meta.full_shape, param_dtype, meta.quantizer, payloads), ()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    out = t.new_zeros((rows, *t.shape[1:]))
    out[:t.shape[0]] = t
    return out


def _finish(ctx: GatherContext, quantizer, dirs, payloads, full_shape, world, fallback: bool = False):
    aliases = quantizer.aliases(tuple(dirs))
    moved = tuple(d for d in dirs if d not in aliases)
    inputs, layout, shared = _split(quantizer, payloads, moved)
    fields = inputs
    packed = None
    uneven = full_shape[0] % world != 0
    if world == 1 or uneven:
        # FSDP2's single-rank shortcut copies only the first all-gather input, and with uneven
        # shards it wants every input in the padded shard's shape: pack all fields into one.
        pad_rows = _padded_rows(full_shape, world) * _rows_per_index(full_shape)
        specs, padded = [], []
        for (d, field), t in zip(layout, inputs):
            sub = quantizer.for_direction(d)
            rows_per_entry = codec_for(sub).fields(sub, d)[field]
            t = _pad_rows(t, -(-pad_rows // rows_per_entry))
            specs.append((t.dtype, tuple(t.shape), rows_per_entry))
            padded.append(t)
        fields = padded
        shard_shape = (_padded_rows(full_shape, world), *full_shape[1:]) if uneven else None
        inputs = [_pack(padded, shard_shape)]
        packed = (world, specs)
    dtypes = ()
    if packed is None:
        # FP8 codes travel as bytes: a group whose inputs are all FP8 would get an FP8 all-gather
        # buffer, which gloo (and any backend without FP8 collectives) rejects.
        dtypes = tuple(t.dtype for t in inputs)
        inputs = [as_bytes(t) for t in inputs]
    resize_gather_buffers(ctx, inputs, world)
    if fallback:
        dtype = payloads[dirs[0]]["data"].dtype
        comm.record_fallback(dtype, sum(t.numel() * t.element_size() for t in inputs) * world, ctx.param_name,
                             "no dtq recipe is active for its module (run the step under dtq.autocast) or the "
                             "recipe asks for the high-precision weight in backward")
    else:
        _record(quantizer, layout, fields, world, sum(t.numel() * t.element_size() for t in inputs) * world)
    return tuple(inputs), _GatherMeta(quantizer, dirs, layout, shared, torch.Size(full_shape), aliases, ctx.param_name,
                                      packed, dtypes)


# -- high-precision shards -----------------------------------------------------------------------


aten = torch.ops.aten


def _map1(fn, x):
    """``fn`` over ``x`` or, for a list / tuple, over its items (the nesting aten arguments have);
    deeper structures go through pytree."""
    if isinstance(x, (list, tuple)):
        if any(isinstance(e, (list, tuple, dict)) for e in x):
            return tree_map(fn, x)
        return type(x)(fn(e) for e in x) if type(x) in (list, tuple) else tree_map(fn, x)
    if isinstance(x, dict):
        return tree_map(fn, x)
    return fn(x)


def _map(fn, args: tuple) -> tuple:
    return tuple(_map1(fn, a) for a in args)


_WRITTEN: dict = {}  # op -> (positions, names) of the arguments it writes


def _bump_written(func, args: tuple, kwargs: dict | None) -> None:
    """Advance the version counter of every HighPrecisionWeight ``func`` wrote. An op reaching a
    wrapper through another subclass (an optimizer step on FSDP2's DTensor parameter) runs below
    autograd, where torch bumps only the outer tensor's counter; the amax cache keys on this one."""
    where = _WRITTEN.get(func)
    if where is None:
        written = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write]
        where = _WRITTEN[func] = tuple(written)
    for i, name in where:
        arg = args[i] if i < len(args) else (kwargs or {}).get(name)
        for t in (arg if isinstance(arg, (list, tuple)) else (arg,)):
            if isinstance(t, HighPrecisionWeight):
                torch.autograd.graph.increment_version(t)


class HighPrecisionWeight(torch.Tensor):
    """A GEMM weight kept in high precision whose FSDP2 all-gather moves quantized payloads.

    A wrapper subclass around the real data (``_data``): the view and copy ops FSDP2 applies to a
    parameter (detach, chunk/split, slice, view, new_zeros, copy_, ...) keep the class and with it
    the all-gather hooks; every other op runs on the plain data and returns plain tensors."""

    _KEEP = {
        aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
        aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.as_strided.default,
        aten.new_zeros.default, aten.new_empty.default, aten.new_empty_strided.default, aten.empty_like.default,
        aten.zeros_like.default, aten.clone.default, aten._to_copy.default, aten._pin_memory.default,
        aten.t.default,
    }
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, requires_grad: bool = False):
        self = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=data.dtype,
                                                   device=data.device, layout=data.layout, requires_grad=requires_grad)
        self._data = data
        return self

    @staticmethod
    def wrap(t: torch.Tensor) -> "HighPrecisionWeight":
        return HighPrecisionWeight(t.detach())

    def __dtq_unwrap__(self) -> torch.Tensor:
        return self._data

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"HighPrecisionWeight({self._data!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Every op on a parameter (the optimizer's, autograd's accumulation, FSDP2's) passes here,
        # so this is on the host's critical path: aten arguments nest at most one level (tensor
        # lists of foreach ops), which _map walks without pytree.
        wrappers = {}

        def unwrap(t):
            if isinstance(t, HighPrecisionWeight):
                wrappers[id(t._data)] = t
                return t._data
            return t

        out = func(*_map(unwrap, args), **{k: _map1(unwrap, v) for k, v in (kwargs or {}).items()})
        if wrappers:
            if func._schema.is_mutable:
                _bump_written(func, args, kwargs)
            # In-place ops hand back their (unwrapped) argument: give the wrapper back instead.
            out = _map1(lambda t: wrappers.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)
        if func in cls._KEEP:
            return _map1(lambda t: HighPrecisionWeight(t) if type(t) is torch.Tensor else t, out)
        return out

    def __reduce_ex__(self, protocol):
        return (HighPrecisionWeight, (self._data, self.requires_grad))

    # Traceable-wrapper-subclass protocol: lets nn.Module.to()/.double()/.cuda() swap the whole
    # tensor instead of assigning .data behind the wrapper's back.
    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return HighPrecisionWeight(inner["_data"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        ctx = gather_context(self)
        _check_supported(ctx)
        check_launched_world()
        module.gemm_state.fsdp_gathered = True
        world = mesh.size()
        param_dtype = mp_policy.param_dtype or self.dtype
        shard = self._data.detach().to(param_dtype)
        recipe = _gather_recipe(ctx, module)
        slot = module.weight_slot(ctx.leaf_name, recipe) if recipe is not None else None
        quantizer = slot.quantizer if slot is not None else None
        hp_backward = (recipe is not None and recipe.backward_override == "high_precision"
                       and ctx.training_state == "PRE_BACKWARD")
        fallback = quantizer is None or hp_backward
        if fallback:
            quantizer = IdentityQuantizer()
            dirs = (ROWWISE,)
            payloads = quantize_payloads(quantizer, shard, dirs)
        else:
            dirs = _needed_directions(ctx, module, quantizer, (ROWWISE, COLUMNWISE))
            _check_alignment(ctx, quantizer, dirs, outer_size, world)
            amax = _global_amax(self, quantizer, shard, mesh, ctx.param_name, dirs)
            if slot.history is not None:
                amax = _delayed_weight_amax(ctx, slot, amax)
            payloads = quantize_payloads(quantizer, shard, dirs, amax=amax)
        return _finish(ctx, quantizer, dirs, payloads, outer_size, world, fallback)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return post_all_gather(all_gather_outputs, metadata, param_dtype, out)


# FSDP2 reads the hook's signature on every gather: precomputed, as for QuantizedTensor's.
HighPrecisionWeight.fsdp_pre_all_gather.__signature__ = inspect.signature(HighPrecisionWeight.fsdp_pre_all_gather)


def _delayed_weight_amax(ctx: GatherContext, slot, amax: dict) -> torch.Tensor:
    """Delayed scaling: the weight's scale comes from its amax history, exactly as the module's
    own quantization of an unsharded weight would take it. A forward gather is that quantization
    (one per forward call: the history takes the global current amax); a backward or recompute
    gather reuses the scale of the forward it serves."""
    if ctx.training_state == "FORWARD" and not in_backward():
        cur = next(iter(amax.values()))  # per-tensor: the same global max|W| for every direction
        return slot.delayed_amax(cur, active_amax_sync())
    used = slot.replayed_amax()
    return used if used is not None else next(iter(amax.values()))  # no forward yet (explicit unshard)


def _amax_key(t: "HighPrecisionWeight", quantizer: Quantizer, dtype: torch.dtype):
    """What a cached global amax is valid for: this shard's values (an in-place op through the
    wrapper, FSDP2's DTensor included, bumps the wrapper's counter; one on the unwrapped data
    bumps the data's), the quantizer and the dtype the gather casts to."""
    return (t._version, t._data._version, quantizer, dtype)


def _global_amax(local: torch.Tensor, quantizer: Quantizer, shard: torch.Tensor, mesh, name: str, dirs):
    cached = getattr(local, "_dtq_amax", None)
    if cached is not None and cached[0] == _amax_key(local, quantizer, shard.dtype) and set(dirs) <= set(cached[1]) | {
            d for d in dirs if not codec_for(quantizer.for_direction(d)).needs_amax(quantizer.for_direction(d), d)}:
        return cached[1]
    try:  # both directions at once, so the backward gather reuses this reduction
        amax = quantizer.local_amax(shard)
    except ValueError:  # a direction this shard cannot hold (it is not gathered either)
        amax = quantizer.local_amax(shard, rowwise=ROWWISE in dirs, columnwise=COLUMNWISE in dirs)
    if amax and mesh.size() > 1:
        warn_once("fsdp-amax-on-the-fly",
                  f"dtq: reducing the amax of {name} (and of every parameter like it) in its own all-reduce during "
                  "the FSDP2 all-gather; call dtq.parallel.precompute_amax(model) after optimizer.step() to do "
                  "all of them in one batched all-reduce")
        amax = reduce_over_shards(amax, mesh.get_group())
    local._dtq_amax = (_amax_key(local, quantizer, shard.dtype), amax)
    return amax


@torch.no_grad()
def precompute_amax(model: torch.nn.Module, recipe=None) -> None:
    """Reduce the global amax of every FSDP2-sharded high-precision dtq weight that needs one, in
    one all-reduce per process group. Call it after ``optimizer.step()`` (like torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``); gathers reuse the result until the weight changes."""
    from torch.distributed.tensor import DTensor

    from dtq.nn.module import QuantizedModule

    check_launched_world()
    groups: dict = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, QuantizedModule):
            continue
        state = module.gemm_state
        rec = recipe or active_recipe() or state.recipe or state.default_recipe
        if rec is None:
            continue
        for leaf in module.weight_names():
            p = getattr(module, leaf)
            local = p._local_tensor if isinstance(p, DTensor) else None
            if not isinstance(local, HighPrecisionWeight):
                continue
            q = module.weight_quantizer(leaf, rec)
            if q is None:
                continue
            ctx = gather_context(local)
            # The dtype fsdp_pre_all_gather casts the shard to: the policy's param_dtype, known from
            # fully_shard on (FSDPParam.param_dtype is set only at the first forward).
            policy = getattr(ctx.fsdp_param, "mp_policy", None)
            dtype = getattr(policy, "param_dtype", None) or getattr(ctx.fsdp_param, "param_dtype", None) or local.dtype
            try:
                amax = q.local_amax(local._data.to(dtype))
            except ValueError as e:
                name = f"{fqn}.{leaf}".lstrip(".")
                raise ValueError(f"dtq.parallel.precompute_amax: cannot take the amax of {name} (this rank's FSDP2 "
                                 f"shard {list(local.shape)} of {list(p.shape)}) for {q.format_name}: {e} Keep the "
                                 f"layer out of dtq.convert (dtq.convert(model, recipe=..., fsdp_world=...) skips and "
                                 f"reports layers a recipe cannot shard)") from e
            if amax:
                pg = ctx.fsdp_param.shard_mesh_from_root.get_group()
                groups.setdefault(pg, []).append((local, q, dtype, amax))
    for pg, items in groups.items():
        reduced = iter(all_reduce_max([a for _, _, _, amax in items for a in amax.values()], pg))
        for local, q, dtype, amax in items:
            local._dtq_amax = (_amax_key(local, q, dtype), {d: next(reduced) for d in amax})


# -- quantized parameters ------------------------------------------------------------------------


def quantized_pre_all_gather(self: QuantizedTensor, mesh, outer_size, outer_stride, module, mp_policy):
    ctx = gather_context(self)
    _check_supported(ctx)
    check_launched_world()
    module.gemm_state.fsdp_gathered = True
    world = mesh.size()
    dirs = _needed_directions(ctx, module, self._quantizer, self.directions)
    _check_alignment(ctx, self._quantizer, dirs, outer_size, world)
    return _finish(ctx, self._quantizer, dirs, {d: self._payloads[d] for d in dirs}, outer_size, world)
