"""``QuantizedTensor``: a torch.Tensor subclass holding per-direction payloads and its quantizer.

The outer tensor is a storage-less wrapper with the logical shape and the nominal (high-precision)
dtype; the payload tensors (codes, scales, amax) are the real data. Dispatch policy:

* ``detach``, ``clone``, ``alias``: keep the subclass (shared / copied payloads);
* ``empty_like``, ``new_empty``, ``new_zeros``, ``zeros_like``, ``zero_``: zero payloads of the
  same format (bitwise ``quantize(zeros)``), no quantization, no random numbers drawn;
* ``_to_copy`` (``.to()``, ``.cpu()``, ``.cuda()``), ``_pin_memory``: move every payload, keep the
  subclass (a new floating dtype only changes the nominal dtype);
* ``copy_``: raw payload copy when the quantizer configs are equal, requantization otherwise;
* dim-0 ``split`` / ``slice`` / ``narrow`` / ``chunk``: payload views, when dim-0 boundaries fall on
  every present direction's block rows (and the view's last dim is the payloads' K);
* ``view`` / ``reshape`` / contiguous ``as_strided`` to any shape of the same size: metadata only,
  the payloads keep describing the same [M, K] matrix (``shape2d``);
* everything else dequantizes its quantized arguments and runs in high precision; an in-place op
  on a QuantizedTensor requantizes the result, as the [M, K] matrix, into its payloads.

A dim-0 slice that covers only some rows of a tensor holding a tensor-wide field (``Codec.fields``
None: FP8's per-tensor scale, NVFP4's amax, FP8 row-wise's columnwise per-column scales) is a
*partial view* (``_partial``): that field is the whole tensor's own, so requantizing the slice
would rescale every other row. In-place writes into a partial view are refused before anything is
written, except a same-quantizer ``copy_`` that leaves every other row's values as they are (equal
tensor-wide fields, or other rows that are still zeros: FSDP2's padded shard buffers). Views that
share payloads (detach, alias, view/reshape, as_strided, further slices) keep the flag; results
that own their payloads (clone, ``_to_copy``, ``*_like`` / ``new_*``) do not.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Iterable, NamedTuple

import torch
from torch.utils._pytree import tree_map

from dtq._torch_private import local_tensor
from dtq._warn import warn_once
from dtq.distributed import gather
from dtq.formats.base import (COLUMNWISE, DIRECTIONS, ROWWISE, Payload, QuantizedData, Quantizer, check_direction,
                              codec_for, dequantize_payload, quantize_payloads, shape_2d)

aten = torch.ops.aten
_FLAT = "_payload__"  # attribute-name prefix under which __tensor_flatten__ exposes payload tensors
_HANDLERS: dict = {}


def _implements(ops: Iterable):
    def deco(fn: Callable):
        for op in ops:
            _HANDLERS[op] = fn
        return fn

    return deco


class _Partial(NamedTuple):
    """Where a partial view (a dim-0 slice of part of the rows) sits in the tensor it was cut from."""

    start: int  # rows [start, end) of the whole's [M, K] matrix
    end: int
    rows: int  # the whole's M
    shared: tuple[tuple[str, str], ...]  # (direction, field) of the tensor-wide fields shared with the whole
    whole: dict | None = None  # the whole's payloads (to check its other rows); None once pickled / traced

    def key(self) -> tuple:
        """Everything but ``whole``: what pickling and ``__tensor_flatten__`` carry."""
        return (self.start, self.end, self.rows, self.shared)


_INHERIT = object()  # _like's default: the result shares the source's payloads, so keeps its _partial


class QuantizedTensor(torch.Tensor):
    """A high-precision tensor's quantized representation(s): ``rowwise`` and/or ``columnwise``.

    ``quantizer`` is the config that produced it (plain or hybrid); payload ``d`` was made by
    ``quantizer.for_direction(d)``.
    """

    _quantizer: Quantizer
    _payloads: dict[str, Payload]
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, quantizer: Quantizer, payloads: dict[str, Payload],
                requires_grad: bool = False, shape2d: tuple[int, int] | None = None, partial=None):
        if not payloads:
            raise ValueError("QuantizedTensor needs at least one direction's payload")
        for d in payloads:
            check_direction(d)
        device = next(iter(next(iter(payloads.values())).values())).device
        self = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device,
                                                   requires_grad=requires_grad)
        self._quantizer = quantizer
        self._payloads = {d: dict(payloads[d]) for d in DIRECTIONS if d in payloads}
        self._shape2d = tuple(shape2d) if shape2d is not None else shape_2d(shape)
        if math.prod(self._shape2d) != math.prod(shape):
            raise ValueError(f"QuantizedTensor: payload view {list(self._shape2d)} does not match shape {list(shape)}")
        self._partial = _Partial(*partial) if partial is not None else None
        return self

    # -- introspection -------------------------------------------------------------------------
    @property
    def quantizer(self) -> Quantizer:
        return self._quantizer

    @property
    def shape2d(self) -> tuple[int, int]:
        """The [M, K] matrix the payloads describe (a view may give the tensor another shape)."""
        return self._shape2d

    @property
    def directions(self) -> tuple[str, ...]:
        return tuple(self._payloads)

    def has(self, direction: str) -> bool:
        return check_direction(direction) in self._payloads

    def payload(self, direction: str) -> Payload:
        """The plain tensors of one direction (shared, not copied)."""
        if not self.has(direction):
            raise KeyError(f"this QuantizedTensor ({self._quantizer.format_name}) has no {direction} payload; "
                           f"it holds {list(self._payloads)}. Build it with update_usage({direction}=True, source=...)")
        return self._payloads[direction]

    def payload_nbytes(self, direction: str | None = None) -> int:
        dirs = self.directions if direction is None else (direction,)
        return sum(t.numel() * t.element_size() for d in dirs for t in self.payload(d).values())

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"QuantizedTensor(shape={list(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"quantizer={self._quantizer!r}, directions={list(self._payloads)})")

    # -- conversions ---------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype | None = None, *, direction: str | None = None) -> torch.Tensor:
        """High-precision values of one direction (rowwise if present and ``direction`` is None)."""
        return dequantize_payload(self._quantizer, self._payloads, self._shape2d, self.shape, dtype or self.dtype,
                                  direction)

    def update_usage(self, rowwise: bool | None = None, columnwise: bool | None = None,
                     source: torch.Tensor | None = None,
                     amax: dict[str, torch.Tensor] | torch.Tensor | None = None) -> "QuantizedTensor":
        """Drop directions (False) or build missing ones (True); None leaves a direction as it is.

        A missing direction is built, in this order of preference: exactly from a payload already
        held (same codes under one scale, 2-D blocks); from ``source`` (the high-precision tensor),
        with ``amax`` if given, else a tensor-wide amax already held for that same value (so a
        shard quantized with a global amax stays consistent), else ``source``'s own amax; from a
        lossless passthrough direction. Otherwise it raises, since requantizing dequantized values
        would not equal quantizing the original.
        """
        want = {ROWWISE: rowwise, COLUMNWISE: columnwise}
        if all(want[d] is False or (want[d] is None and d not in self._payloads) for d in DIRECTIONS):
            raise ValueError("update_usage would leave the tensor with no direction; keep at least one")
        for d in DIRECTIONS:
            if want[d] and d not in self._payloads:
                self._payloads[d] = self._build(d, source, amax)
        for d in DIRECTIONS:
            if want[d] is False:
                self._payloads.pop(d, None)
        self._payloads = {d: self._payloads[d] for d in DIRECTIONS if d in self._payloads}
        self._partial = _restrict(self._partial, self.directions)
        return self

    def with_directions(self, *directions: str) -> "QuantizedTensor":
        """A new tensor sharing this one's payloads of ``directions`` only (the original keeps all)."""
        missing = [d for d in directions if not self.has(d)]
        if missing:
            raise KeyError(f"this QuantizedTensor has no {missing} payload (it holds {list(self._payloads)})")
        return QuantizedTensor(self.shape, self.dtype, self._quantizer, {d: self._payloads[d] for d in directions},
                               shape2d=self._shape2d, partial=_restrict(self._partial, directions))

    def _build(self, d: str, source: torch.Tensor | None, amax) -> Payload:
        sub = self._quantizer.for_direction(d)
        codec = codec_for(sub)
        same = [(have, p) for have, p in self._payloads.items() if self._quantizer.for_direction(have) == sub]
        for have, payload in same:
            derived = codec.derive(sub, payload, have, d)
            if derived is not None:
                return derived
        if source is not None:
            if tuple(source.shape) != tuple(self.shape):
                raise ValueError(f"update_usage: source shape {list(source.shape)} != tensor shape {list(self.shape)}")
            if amax is None:
                held = [codec.reusable_amax(sub, p, have, d) for have, p in same]
                amax = next((a for a in held if a is not None), None)
            return quantize_payloads(self._quantizer, self._as_matrix(source), (d,), amax=amax)[d]
        for have in self._payloads:
            hsub = self._quantizer.for_direction(have)
            if codec_for(hsub).lossless(hsub, self.dtype):
                return quantize_payloads(self._quantizer, self._as_matrix(self.dequantize(direction=have)), (d,),
                                         amax=amax)[d]
        raise ValueError(
            f"cannot build the {d} payload of a {self._quantizer.format_name} tensor from its "
            f"{list(self._payloads)} payload without losing bits; pass source=<the high-precision tensor> "
            f"or quantize with {d}=True in the first place")

    def _as_matrix(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (this tensor's shape) as the [M, K] matrix the payloads describe (a view's shape may
        flatten to another one)."""
        return x if shape_2d(self.shape) == self._shape2d else x.reshape(self._shape2d)

    def _assign(self, value: torch.Tensor, op: str = "an in-place op") -> None:
        """Requantize ``value`` (this tensor's shape, or broadcastable to it) into the existing
        payload storage. The payloads describe the [M, K] matrix ``shape2d`` whatever the view's
        shape, so the value is quantized as that matrix: bitwise what quantizing the whole gives."""
        _check_writable(self, op)
        try:
            value = value.to(self.dtype).expand(self.shape)
        except RuntimeError as e:
            raise ValueError(f"dtq: {op} cannot write a value of shape {list(value.shape)} into {_describe(self)}: "
                             f"it does not broadcast to {list(self.shape)}") from e
        new = quantize_payloads(self._quantizer, self._as_matrix(value), self.directions)
        for d, payload in new.items():
            for k, t in payload.items():
                self._payloads[d][k].copy_(t)

    def __reduce_ex__(self, protocol):
        # Plain pickle (and torch.save) rebuild from the payloads; a wrapper has no storage of its
        # own. 1-byte float payloads travel as uint8 (torch cannot plain-pickle float8 tensors).
        payloads = {d: {k: ((v.view(torch.uint8), v.dtype) if v.element_size() == 1 and v.dtype.is_floating_point
                            else (v, None)) for k, v in p.items()} for d, p in self._payloads.items()}
        partial = self._partial.key() if self._partial is not None else None
        return (_rebuild_quantized, (tuple(self.shape), self.dtype, self._quantizer, payloads,
                                     self.requires_grad, self._shape2d, partial))

    # -- traceable-wrapper-subclass protocol (nn.Module.to() and friends swap whole tensors) -------
    def __tensor_flatten__(self):
        names = [f"{_FLAT}{d}__{k}" for d, p in self._payloads.items() for k in p]
        partial = self._partial.key() if self._partial is not None else None
        return names, (self._quantizer, self.dtype, self._shape2d, partial)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        quantizer, dtype, shape2d, partial = ctx
        payloads: dict = {}
        for name, t in inner.items():
            d, k = name[len(_FLAT):].split("__", 1)
            payloads.setdefault(d, {})[k] = t
        return QuantizedTensor(outer_size, dtype, quantizer, payloads, shape2d=shape2d, partial=partial)

    def __getattr__(self, name: str):
        if name.startswith(_FLAT):
            d, k = name[len(_FLAT):].split("__", 1)
            return self._payloads[d][k]
        raise AttributeError(f"'QuantizedTensor' object has no attribute {name!r}")

    # -- FSDP2 all-gather extension (quantized parameters) -----------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return gather.quantized_pre_all_gather(self, self._quantizer, self._payloads, mesh, outer_size, module)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return post_all_gather(all_gather_outputs, metadata, param_dtype, out)

    def refill(self, quantizer: Quantizer, payloads: dict[str, Payload], shape2d: tuple[int, int]) -> None:
        """Replace the payloads in place: FSDP2 keeps one unsharded parameter object across
        gathers (autograd accumulates into it; GEMMs saved it for backward)."""
        self._quantizer, self._payloads, self._shape2d = quantizer, payloads, tuple(shape2d)

    # -- dispatch ------------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(func, args, kwargs)
            if out is not NotImplemented:
                return out
        return _fallback(func, args, kwargs)


def post_all_gather(outputs, meta, param_dtype: torch.dtype, out: QuantizedTensor | None = None):
    """Both weight kinds' ``fsdp_post_all_gather``: the unsharded parameter, a QuantizedTensor
    over the gathered buffers (``out``, FSDP2's kept object, is refilled instead)."""
    payloads = gather.gathered_payloads(outputs, meta)
    if out is not None:
        out = local_tensor(out)  # a TP parameter: its local tensor is the object GEMMs saved
        out.refill(meta.quantizer, payloads, shape_2d(meta.full_shape))
        return None
    return QuantizedTensor(meta.full_shape, param_dtype, meta.quantizer, payloads), ()


# FSDP2 reads the hook's signature on every gather (it accepts two calling conventions);
# a precomputed one halves that per-parameter host time.
QuantizedTensor.fsdp_pre_all_gather.__signature__ = inspect.signature(QuantizedTensor.fsdp_pre_all_gather)

QUANTIZED = (QuantizedTensor, QuantizedData)  # isinstance checks of code that takes either


def _like(t: QuantizedTensor, payloads: dict[str, Payload], shape=None, dtype=None, quantizer=None,
          shape2d=None, partial=_INHERIT) -> QuantizedTensor:
    """A QuantizedTensor like ``t``; a new ``shape`` (without ``shape2d``) is a new [M, K] matrix.
    ``partial``: by default ``t``'s (the result shares its payloads); pass None for a result that
    owns its payloads."""
    if shape is None:
        shape, shape2d = t.shape, t._shape2d
    if partial is _INHERIT:
        partial = t._partial
    return QuantizedTensor(shape, dtype or t.dtype, quantizer or t._quantizer, payloads, shape2d=shape2d,
                           partial=partial)


# -- partial views ------------------------------------------------------------------------------


def _shared_fields(quantizer: Quantizer, directions) -> tuple[tuple[str, str], ...]:
    """(direction, field) of every tensor-wide field (``Codec.fields`` None) of ``directions``."""
    out = []
    for d in directions:
        sub = quantizer.for_direction(d)
        out += [(d, k) for k, rows in codec_for(sub).fields(sub, d).items() if rows is None]
    return tuple(out)


def _restrict(partial: _Partial | None, directions) -> _Partial | None:
    """``partial`` for a view that now holds only ``directions`` (None if none of them shares a field)."""
    if partial is None:
        return None
    shared = tuple((d, k) for d, k in partial.shared if d in directions)
    return partial._replace(shared=shared) if shared else None


def _describe(t: QuantizedTensor) -> str:
    what = f"a {t._quantizer.format_name} QuantizedTensor of shape {list(t.shape)}"
    if tuple(t._shape2d) != shape_2d(t.shape):
        what += f" (a view: its payloads describe the [M, K] = {list(t._shape2d)} matrix)"
    return what


def _partial_write_error(t: QuantizedTensor, op: str, copy_hint: bool = False) -> ValueError:
    p = t._partial
    one = len(p.shared) == 1
    fields = " and ".join(f"{d} {k}" for d, k in p.shared)
    formats = "/".join(sorted({t._quantizer.for_direction(d).format_name for d, _ in p.shared}))
    name = op.removeprefix("_foreach_")
    change = f"w[{p.start}:{p.end}].{name}({'' if name == 'zero_' else '...'})"
    hint = ("" if not copy_hint else
            ". A copy_ from a QuantizedTensor of the same quantizer is allowed when its tensor-wide values are bitwise "
            "the view's (e.g. a shard quantized with the whole's global amax), or when the whole's other rows keep "
            "their values under the source's (rows still zero, as in a torch.empty_like buffer filled slice by slice)")
    return ValueError(
        f"dtq: {op} cannot write into {_describe(t)}: it is a dim-0 slice covering rows [{p.start}, {p.end}) of the "
        f"{p.rows} rows of a tensor whose {fields} ({formats}) {'is' if one else 'are'} tensor-wide, shared by all "
        f"{p.rows} rows; writing into the slice would overwrite {'it' if one else 'them'} and change the other "
        f"{p.rows - (p.end - p.start)} rows. Modify the whole tensor t instead: w = t.dequantize(); {change}; "
        f"t.copy_(w) (rows of t's [M, K] view); or use a format with block or row scales for this tensor (MXFP8, FP8 "
        f"blocks, FP8 row-wise with the rowwise direction only)" + hint)


def _check_writable(t: QuantizedTensor, op: str) -> None:
    if t._partial is not None:
        raise _partial_write_error(t, op)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _others_unchanged(t: QuantizedTensor, new: dict[tuple[str, str], torch.Tensor]) -> bool:
    """Whether every row of the whole outside partial view ``t`` dequantizes to bitwise the same
    values with the tensor-wide fields ``new`` ((direction, field) -> tensor) as it does now."""
    p = t._partial
    if p.whole is None:
        return False
    k_cols = t._shape2d[1]
    for d in {d for d, _ in new}:
        if d not in p.whole:  # a direction built on the view itself (update_usage): not the whole's
            return False
        sub = t._quantizer.for_direction(d)
        codec = codec_for(sub)
        fields = codec.fields(sub, d)
        for a, b in ((0, p.start), (p.end, p.rows)):
            if a == b:
                continue
            old = {k: (v if fields[k] is None else v[a // fields[k]: -(-b // fields[k])])
                   for k, v in p.whole[d].items()}
            changed = dict(old, **{k: v for (dd, k), v in new.items() if dd == d})
            with torch.no_grad():
                before = codec.dequantize(sub, old, d, (b - a, k_cols))
                after = codec.dequantize(sub, changed, d, (b - a, k_cols))
            if not _same_bits(before, after):
                return False
    return True


def _map_payloads(t: QuantizedTensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Payload]:
    """``fn`` on every payload tensor; tensors shared between directions stay shared."""
    memo: dict[int, torch.Tensor] = {}

    def once(v):
        if id(v) not in memo:
            memo[id(v)] = fn(v)
        return memo[id(v)]

    return {d: {k: once(v) for k, v in p.items()} for d, p in t._payloads.items()}


def _written(func, args, kwargs) -> list:
    """The arguments ``func`` writes (its schema's ``a!`` ones; foreach ops write lists)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        written = args[i] if i < len(args) else kwargs.get(arg.name)
        out += list(written) if isinstance(written, (list, tuple)) else [written]
    return out


def _fallback(func, args, kwargs):
    if func._schema.is_mutable:  # refuse a write into a partial view before anything is written
        for t in _written(func, args, kwargs):
            if isinstance(t, QuantizedTensor):
                _check_writable(t, func.overloadpacket.__name__)
    plain = {}

    def unwrap(x):
        if isinstance(x, QuantizedTensor):
            hp = x.dequantize()
            plain[id(hp)] = x
            return hp
        return x

    uargs, ukwargs = tree_map(unwrap, (args, kwargs))
    out = func(*uargs, **ukwargs)
    if func._schema.is_mutable:
        for hp in _written(func, uargs, ukwargs):
            if isinstance(hp, torch.Tensor) and id(hp) in plain:
                plain[id(hp)]._assign(hp, func.overloadpacket.__name__)
    return tree_map(lambda x: plain.get(id(x), x) if isinstance(x, torch.Tensor) else x, out)


@_implements([aten.detach.default, aten.alias.default])
def _detach(func, args, kwargs):
    t = args[0]
    return _like(t, t._payloads)


@_implements([aten.clone.default])
def _clone(func, args, kwargs):
    return _like(args[0], _map_payloads(args[0], torch.clone), partial=None)


def _zero_payloads(t: QuantizedTensor, shape2: tuple[int, int], device, dtype) -> dict[str, Payload]:
    """Zero payloads of ``t``'s format for a [M, K] = ``shape2`` matrix."""
    out = {}
    for d in t.directions:
        sub = t._quantizer.for_direction(d)
        codec = codec_for(sub)
        codec.check_shape(sub, shape2, d)
        twin = t._quantizer.aliases(t.directions).get(d)
        out[d] = dict(out[twin]) if twin in out else codec.empty(sub, shape2, d, device, dtype)
    return out


@_implements([aten.empty_like.default, aten.zeros_like.default, aten.new_empty.default, aten.new_zeros.default])
def _new_like(func, args, kwargs):
    t = args[0]
    if func in (aten.new_empty.default, aten.new_zeros.default):
        shape = tuple(args[1])
        shape2 = shape_2d(shape)
    else:  # *_like: t's shape, and the [M, K] matrix t's payloads describe (t may be a view)
        shape, shape2 = tuple(t.shape), t._shape2d
    dtype = kwargs.get("dtype") or t.dtype
    if not dtype.is_floating_point:
        return NotImplemented
    device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else t.device
    out = _like(t, _zero_payloads(t, shape2, device, dtype), shape=shape, dtype=dtype, shape2d=shape2, partial=None)
    if kwargs.get("pin_memory"):
        out = _like(out, _map_payloads(out, lambda v: v.pin_memory()))
    return out


@_implements([aten.zero_.default])
def _zero_(func, args, kwargs):
    t = args[0]
    _check_writable(t, "zero_")
    for d, p in _zero_payloads(t, t._shape2d, t.device, t.dtype).items():
        for k, v in p.items():
            t._payloads[d][k].copy_(v)
    return t


@_implements([aten._to_copy.default])
def _to_copy(func, args, kwargs):
    t = args[0]
    dtype = kwargs.get("dtype") or t.dtype
    if not dtype.is_floating_point:
        return NotImplemented
    device = kwargs.get("device")
    nb = kwargs.get("non_blocking", False)
    pin = kwargs.get("pin_memory", False)

    def move(v):
        v = v.to(device=device, non_blocking=nb, copy=True) if device is not None else v.clone()
        return v.pin_memory() if pin else v

    return _like(t, _map_payloads(t, move), dtype=dtype, partial=None)


@_implements([aten._pin_memory.default])
def _pin(func, args, kwargs):
    return _like(args[0], _map_payloads(args[0], lambda v: v.pin_memory()), partial=None)


@_implements([aten.is_pinned.default])
def _is_pinned(func, args, kwargs):
    return all(v.is_pinned() for p in args[0]._payloads.values() for v in p.values())


@_implements([aten.copy_.default])
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    nb = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    if not isinstance(dst, QuantizedTensor):
        return dst.copy_(src.dequantize(dst.dtype), non_blocking=nb)
    if (isinstance(src, QuantizedTensor) and src._quantizer == dst._quantizer
            and tuple(src.shape) == tuple(dst.shape) and tuple(src._shape2d) == tuple(dst._shape2d)):
        # Same config: copy codes, never requantize them. A direction the source lacks comes
        # from an identical one it has, or the copy is refused (its bits cannot be recovered).
        source = {}
        for d in dst.directions:
            src_d = d if src.has(d) else next(
                (h for h in src.directions if src._quantizer.for_direction(h) == src._quantizer.for_direction(d)
                 and codec_for(src._quantizer.for_direction(d)).identical_directions(src._quantizer.for_direction(d))),
                None)
            if src_d is None:
                raise ValueError(f"copy_: the destination holds a {d} payload but the source ({list(src.directions)}) "
                                 f"cannot provide its exact bits; drop it first (update_usage({d}=False)) or copy from "
                                 f"a tensor quantized with {d}=True")
            source[d] = src._payloads[src_d]
        if dst._partial is not None:
            # Safe only if the whole's other rows keep their values: the shared tensor-wide fields
            # do not change, or those rows do not depend on them (still zeros).
            changed = {(d, k): source[d][k] for d, k in dst._partial.shared
                       if not _same_bits(dst._payloads[d][k], source[d][k])}
            if changed and not _others_unchanged(dst, changed):
                raise _partial_write_error(dst, "copy_", copy_hint=True)
        for d in dst.directions:
            for k, v in dst._payloads[d].items():
                v.copy_(source[d][k], non_blocking=nb)
        return dst
    _check_writable(dst, "copy_")
    hp = src.dequantize(dst.dtype) if isinstance(src, QuantizedTensor) else src
    dst._assign(hp.to(dst.device), "copy_")
    return dst


# -- dim-0 views -------------------------------------------------------------------------------


def _rows_per_index(t: QuantizedTensor) -> int | None:
    """Rows of the [M, K] payload matrix per dim-0 index, or None if the current view does not
    keep K as its last dim (then dim-0 slices are not row ranges)."""
    if t.dim() < 2 or t.shape[-1] != t._shape2d[1]:
        return None
    return math.prod(t.shape[1:-1])


def _slice_rows(t: QuantizedTensor, start: int, end: int, shape) -> QuantizedTensor | None:
    """Payload views of logical rows [start, end) of the [M, K] view, or None if misaligned."""
    m = t._shape2d[0]
    payloads = {}
    for d, p in t._payloads.items():
        sub = t._quantizer.for_direction(d)
        align = t._quantizer.block_rows(d)
        if start % align or (end % align and end != m):
            warn_once(f"misaligned:{type(sub).__name__}:{d}",
                      f"dtq: a dim-0 slice of a {sub.format_name} tensor of shape {list(t.shape)} covers rows "
                      f"[{start}, {end}) of its [M, K] view, not on the {d} block boundary (a multiple of "
                      f"{align} rows); the result is dequantized to high precision")
            return None
        fields = codec_for(sub).fields(sub, d)
        payloads[d] = {k: (v if fields[k] is None else v[start // fields[k]: -(-end // fields[k])])
                       for k, v in p.items()}
    # A slice of part of the rows shares the whole's tensor-wide fields: a partial view (in the
    # coordinates of the tensor that owns the payloads, when t is itself one).
    shared = _shared_fields(t._quantizer, t.directions)
    parent = t._partial
    partial = None
    if shared and parent is not None:
        partial = _Partial(parent.start + start, parent.start + end, parent.rows, shared, parent.whole)
    elif shared and (start, end) != (0, m):
        partial = _Partial(start, end, m, shared, {d: dict(p) for d, p in t._payloads.items()})
    return _like(t, payloads, shape=shape, partial=partial)


@_implements([aten.slice.Tensor])
def _slice(func, args, kwargs):
    t = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    r = _rows_per_index(t)
    if r is None or dim not in (0, -t.dim()) or step != 1:
        return NotImplemented
    n = t.shape[0]
    start = 0 if start is None else (start + n if start < 0 else start)
    end = n if end is None else (end + n if end < 0 else end)
    start, end = max(0, min(start, n)), max(0, min(end, n))
    end = max(start, end)
    out = _slice_rows(t, start * r, end * r, (end - start, *t.shape[1:]))
    return NotImplemented if out is None else out


@_implements([aten.split.Tensor, aten.split_with_sizes.default])
def _split(func, args, kwargs):
    t = args[0]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    r = _rows_per_index(t)
    if r is None or dim not in (0, -t.dim()):
        return NotImplemented
    n = t.shape[0]
    if func is aten.split.Tensor:
        step = args[1]
        sizes = [min(step, n - i) for i in range(0, n, step)] if n else [0]
    else:
        sizes = list(args[1])
    outs, start = [], 0
    for s in sizes:
        piece = _slice_rows(t, start * r, (start + s) * r, (s, *t.shape[1:]))
        if piece is None:
            return NotImplemented
        outs.append(piece)
        start += s
    return outs


@_implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
def _view(func, args, kwargs):
    # Any reshape is metadata: the payloads keep describing the same [M, K] matrix (FSDP2, for
    # one, keeps a flat view(-1) of every sharded parameter).
    t = args[0]
    size = list(args[1])
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = t.numel() // known if known else 0
    if math.prod(size) != t.numel():
        return NotImplemented
    return _like(t, t._payloads, shape=tuple(size), shape2d=t._shape2d)


@_implements([aten.as_strided.default])
def _as_strided(func, args, kwargs):
    t, size, stride = args[0], list(args[1]), list(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
    contiguous = [math.prod(size[i + 1:]) for i in range(len(size))]
    if math.prod(size) != t.numel() or (offset or 0) != 0 or any(
            st != c for st, c, n in zip(stride, contiguous, size) if n > 1):
        return NotImplemented
    return _like(t, t._payloads, shape=tuple(size), shape2d=t._shape2d)


def _rebuild_quantized(shape, dtype, quantizer, payloads, requires_grad, shape2d, partial=None) -> QuantizedTensor:
    payloads = {d: {k: (v if view is None else v.view(view)) for k, (v, view) in p.items()} for d, p in payloads.items()}
    return QuantizedTensor(shape, dtype, quantizer, payloads, requires_grad=requires_grad, shape2d=shape2d,
                           partial=partial)


# What torch.load(weights_only=True) needs from this module (dtq.weights.quantized_safe_globals adds the rest).
SAFE_GLOBALS = (QuantizedTensor, _rebuild_quantized)
