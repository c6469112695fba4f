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
  on a QuantizedTensor requantizes the result into its payloads.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Iterable

import torch
from torch.utils._pytree import tree_map

from dtq.formats.base import (COLUMNWISE, DIRECTIONS, ROWWISE, Payload, Quantizer, check_direction,
                              codec_for, quantize_payloads, shape_2d)

aten = torch.ops.aten
_FLAT = "_payload__"  # attribute-name prefix under which __tensor_flatten__ exposes payload tensors
_HANDLERS: dict = {}
_warned: set = set()


def _implements(ops: Iterable):
    def deco(fn: Callable):
        for op in ops:
            _HANDLERS[op] = fn
        return fn

    return deco


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


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
                requires_grad: bool = False, shape2d: tuple[int, int] | None = None):
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
        if direction is None:
            direction = ROWWISE if ROWWISE in self._payloads else COLUMNWISE
        payload = self.payload(direction)
        sub = self._quantizer.for_direction(direction)
        with torch.no_grad():
            out = codec_for(sub).dequantize(sub, payload, direction, self._shape2d)
        return out.reshape(self.shape).to(dtype or self.dtype)

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
        return self

    def with_directions(self, *directions: str) -> "QuantizedTensor":
        """A new tensor sharing this one's payloads of ``directions`` only (the original keeps all)."""
        missing = [d for d in directions if not self.has(d)]
        if missing:
            raise KeyError(f"this QuantizedTensor has no {missing} payload (it holds {list(self._payloads)})")
        return QuantizedTensor(self.shape, self.dtype, self._quantizer, {d: self._payloads[d] for d in directions},
                               shape2d=self._shape2d)

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
            return quantize_payloads(self._quantizer, source, (d,), amax=amax)[d]
        for have in self._payloads:
            hsub = self._quantizer.for_direction(have)
            if codec_for(hsub).lossless(hsub, self.dtype):
                return quantize_payloads(self._quantizer, self.dequantize(direction=have), (d,), amax=amax)[d]
        raise ValueError(
            f"cannot build the {d} payload of a {self._quantizer.format_name} tensor from its "
            f"{list(self._payloads)} payload without losing bits; pass source=<the high-precision tensor> "
            f"or quantize with {d}=True in the first place")

    def _assign(self, value: torch.Tensor) -> None:
        """Requantize ``value`` into this tensor's existing payload storage."""
        new = quantize_payloads(self._quantizer, value.to(self.dtype).expand(self.shape), self.directions)
        for d, payload in new.items():
            for k, t in payload.items():
                self._payloads[d][k].copy_(t)

    def __reduce_ex__(self, protocol):
        # Plain pickle (and torch.save) rebuild from the payloads; a wrapper has no storage of its
        # own. 1-byte float payloads travel as uint8 (torch cannot plain-pickle float8 tensors).
        payloads = {d: {k: ((v.view(torch.uint8), v.dtype) if v.element_size() == 1 and v.dtype.is_floating_point
                            else (v, None)) for k, v in p.items()} for d, p in self._payloads.items()}
        return (_rebuild_quantized, (tuple(self.shape), self.dtype, self._quantizer, payloads,
                                     self.requires_grad, self._shape2d))

    # -- traceable-wrapper-subclass protocol (nn.Module.to() and friends swap whole tensors) -------
    def __tensor_flatten__(self):
        names = [f"{_FLAT}{d}__{k}" for d, p in self._payloads.items() for k in p]
        return names, (self._quantizer, self.dtype, self._shape2d)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        quantizer, dtype, shape2d = ctx
        payloads: dict = {}
        for name, t in inner.items():
            d, k = name[len(_FLAT):].split("__", 1)
            payloads.setdefault(d, {})[k] = t
        return QuantizedTensor(outer_size, dtype, quantizer, payloads, shape2d=shape2d)

    def __getattr__(self, name: str):
        if name.startswith(_FLAT):
            d, k = name[len(_FLAT):].split("__", 1)
            return self._payloads[d][k]
        raise AttributeError(f"'QuantizedTensor' object has no attribute {name!r}")

    # -- FSDP2 all-gather extension (quantized parameters) -----------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        from dtq.parallel.fsdp import quantized_pre_all_gather

        return quantized_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        from dtq.parallel.fsdp import post_all_gather

        return post_all_gather(all_gather_outputs, metadata, param_dtype, out)

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


def _like(t: QuantizedTensor, payloads: dict[str, Payload], shape=None, dtype=None, quantizer=None,
          shape2d=None) -> QuantizedTensor:
    """A QuantizedTensor like ``t``; a new ``shape`` (without ``shape2d``) is a new [M, K] matrix."""
    if shape is None:
        shape, shape2d = t.shape, t._shape2d
    return QuantizedTensor(shape, dtype or t.dtype, quantizer or t._quantizer, payloads, shape2d=shape2d)


def _map_payloads(t: QuantizedTensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Payload]:
    """``fn`` on every payload tensor; tensors shared between directions stay shared."""
    memo: dict[int, torch.Tensor] = {}

    def once(v):
        if id(v) not in memo:
            memo[id(v)] = fn(v)
        return memo[id(v)]

    return {d: {k: once(v) for k, v in p.items()} for d, p in t._payloads.items()}


def _fallback(func, args, kwargs):
    plain = {}

    def unwrap(x):
        if isinstance(x, QuantizedTensor):
            hp = x.dequantize()
            plain[id(hp)] = x
            return hp
        return x

    uargs, ukwargs = tree_map(unwrap, (args, kwargs))
    out = func(*uargs, **ukwargs)
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        written = uargs[i] if i < len(uargs) else ukwargs.get(arg.name)
        for hp in (written if isinstance(written, (list, tuple)) else [written]):  # foreach ops write lists
            if isinstance(hp, torch.Tensor) and id(hp) in plain:
                plain[id(hp)]._assign(hp)
    return tree_map(lambda x: plain.get(id(x), x) if isinstance(x, torch.Tensor) else x, out)


@_implements([aten.detach.default, aten.alias.default])
def _detach(func, args, kwargs):
    t = args[0]
    return _like(t, t._payloads)


@_implements([aten.clone.default])
def _clone(func, args, kwargs):
    return _like(args[0], _map_payloads(args[0], torch.clone))


def _zero_payloads(t: QuantizedTensor, shape, device, dtype) -> dict[str, Payload]:
    shape2 = shape_2d(shape)
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
    shape = tuple(args[1]) if func in (aten.new_empty.default, aten.new_zeros.default) else tuple(t.shape)
    dtype = kwargs.get("dtype") or t.dtype
    if not dtype.is_floating_point:
        return NotImplemented
    device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else t.device
    out = _like(t, _zero_payloads(t, shape, device, dtype), shape=shape, dtype=dtype)
    if kwargs.get("pin_memory"):
        out = _like(out, _map_payloads(out, lambda v: v.pin_memory()))
    return out


@_implements([aten.zero_.default])
def _zero_(func, args, kwargs):
    t = args[0]
    for d, p in _zero_payloads(t, t.shape, t.device, t.dtype).items():
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

    return _like(t, _map_payloads(t, move), dtype=dtype)


@_implements([aten._pin_memory.default])
def _pin(func, args, kwargs):
    return _like(args[0], _map_payloads(args[0], lambda v: v.pin_memory()))


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
            and tuple(src.shape) == tuple(dst.shape)):
        # Same config: copy codes, never requantize them. A direction the source lacks comes
        # from an identical one it has, or the copy is refused (its bits cannot be recovered).
        for d in dst.directions:
            src_d = d if src.has(d) else next(
                (h for h in src.directions if src._quantizer.for_direction(h) == src._quantizer.for_direction(d)
                 and codec_for(src._quantizer.for_direction(d)).identical_directions(src._quantizer.for_direction(d))),
                None)
            if src_d is None:
                raise ValueError(f"copy_: the destination holds a {d} payload but the source ({list(src.directions)}) "
                                 f"cannot provide its exact bits; drop it first (update_usage({d}=False)) or copy from "
                                 f"a tensor quantized with {d}=True")
            for k, v in dst._payloads[d].items():
                v.copy_(src._payloads[src_d][k], non_blocking=nb)
        return dst
    hp = src.dequantize(dst.dtype) if isinstance(src, QuantizedTensor) else src
    dst._assign(hp.to(dst.device))
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
    return _like(t, payloads, shape=shape)


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


def _rebuild_quantized(shape, dtype, quantizer, payloads, requires_grad, shape2d) -> QuantizedTensor:
    payloads = {d: {k: (v if view is None else v.view(view)) for k, (v, view) in p.items()} for d, p in payloads.items()}
    return QuantizedTensor(shape, dtype, quantizer, payloads, requires_grad=requires_grad, shape2d=shape2d)


def quantized_safe_globals() -> list:
    """Classes that ``torch.load(weights_only=True)`` must accept to rebuild QuantizedTensors."""
    from dtq.formats import HybridQuantizer, registered_quantizers

    from dtq.parallel.fsdp import HighPrecisionWeight

    return [QuantizedTensor, _rebuild_quantized, HybridQuantizer, HighPrecisionWeight, *registered_quantizers()]
