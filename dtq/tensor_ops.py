"""QuantizedTensor's op table: what each aten op does when a ``QuantizedTensor`` is an argument.

``QuantizedTensor.__torch_dispatch__`` looks the op up in the table this module fills
(``dtq.tensor._HANDLERS``; importing ``dtq`` imports this module, and the first dispatch does in
any case). One handler per op family keeps the payloads:

* ``detach``, ``alias``: the same payloads;
* ``clone``, ``_to_copy`` (``.to()``, ``.cpu()``, ``.cuda()``), ``_pin_memory``, ``is_pinned``:
  every payload copied or moved (a new floating dtype only changes the nominal dtype);
* ``empty_like``, ``new_empty``, ``new_zeros``, ``zeros_like``, ``zero_``: zero payloads of the
  same format (bitwise ``quantize(zeros)``), no quantization, no random numbers drawn;
* ``copy_``: raw payload copy when the quantizer configs are equal, requantization otherwise;
* dim-0 ``split`` / ``slice`` / ``narrow`` / ``chunk``: payload views, when dim-0 boundaries fall on
  every present direction's block rows (and the view's last dim is the payloads' K);
* ``view`` / ``reshape`` / contiguous ``as_strided`` to any shape of the same size: metadata only,
  the payloads keep describing the same [M, K] matrix (``shape2d``).

Nothing falls back silently. An op without a handler (or whose handler declines its arguments: a
slice along another dim or off the block rows, ``.to()`` an integer dtype) runs on the dequantized
values only where that is what torch's own machinery and dtq's users rely on: pointwise ops
(``torch.Tag.pointwise``: arithmetic, comparisons, ``torch.equal``; in place, a plain optimizer's
update), reductions (``torch.Tag.reduction``), their ``_foreach_`` forms, ``allclose``,
``fill_``, matrix products and transposes (``torch.matmul`` / ``F.linear`` on a quantized tensor
outside dtq's modules). Such a fallback warns once per op and counts every call
(:func:`fallback_counts`); an in-place one requantizes the result into the written tensor's
payloads (refused before anything is written for a partial view, see :mod:`dtq.tensor`). Any
other op raises ``NotImplementedError`` naming the op, the tensor's format and shape, and what
works: ``t.dequantize()`` first, or one of the ops above.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_flatten, tree_map

import dtq.tensor as _tensor
from dtq._warn import warn_once
from dtq.codec import Payload, shape_2d
from dtq.tensor import _HANDLERS, QuantizedTensor, _check_writable, _describe, _Partial, _partial_write_error

if TYPE_CHECKING:
    from dtq.formats import Quantizer

aten = torch.ops.aten


def implements(ops: Iterable):
    """Register the decorated ``handler(func, args, kwargs)`` for ``ops`` in QuantizedTensor's table."""

    def deco(fn: Callable):
        for op in ops:
            _HANDLERS[op] = fn
        return fn

    return deco


# -- ops without a handler -----------------------------------------------------------------------

# Beyond pointwise ops and reductions (by their torch tags), the ops that run on dequantized values.
_ALSO_DEQUANTIZED = {
    aten.allclose: "a comparison",
    aten.fill_: "a fill",
    **dict.fromkeys(
        (aten.mm, aten.addmm, aten.bmm, aten.t, aten.transpose, aten.permute),
        "a matrix product or transpose outside dtq's GEMM path",
    ),
}
_allowed: dict = {}  # op -> what kind of op its fallback is allowed as (None: refused); decided once per op
_counts: collections.Counter = collections.Counter()


def fallback_counts() -> dict[str, int]:
    """How often each op (``"aten.add.Tensor"``, ...) ran on dequantized QuantizedTensor values."""
    return dict(_counts)


def reset_fallback_counts() -> None:
    _counts.clear()


def _kind(func) -> str | None:
    """Why ``func`` may run on dequantized values (see the module docstring), or None."""
    if func in _HANDLERS:
        return "an op whose handler does not keep the payloads for these arguments"
    packet = func.overloadpacket
    if packet in _ALSO_DEQUANTIZED:
        return _ALSO_DEQUANTIZED[packet]
    name = packet.__name__
    packets = [packet]
    if name.startswith("_foreach_") and hasattr(aten, name[len("_foreach_") :]):
        packets.append(getattr(aten, name[len("_foreach_") :]))  # a foreach op is its single-tensor op's kind
    tags = {t for p in packets for o in p.overloads() for t in getattr(p, o).tags}
    if torch.Tag.pointwise in tags:
        return "a pointwise op"
    if torch.Tag.reduction in tags:
        return "a reduction"
    return None


def _quantized_args(args, kwargs) -> list[QuantizedTensor]:
    return [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, QuantizedTensor)]


def _unsupported(func, args, kwargs) -> NotImplementedError:
    t = _quantized_args(args, kwargs)[0]
    kept = ", ".join(sorted({op.overloadpacket.__name__ for op in _HANDLERS if op.namespace == "aten"}))
    return NotImplementedError(
        f"dtq: {func} is not supported on {_describe(t)}: QuantizedTensor has no handler for it, and runs only "
        f"pointwise ops, reductions, matrix products and transposes on its dequantized values. Call t.dequantize() "
        f"first to run {func.overloadpacket.__name__} in high precision (a plain tensor: quantize the result again "
        f"if you need one); the ops that keep the quantized payloads are {kept}"
    )


def unhandled(func, args, kwargs):
    """An op no handler took: run it on dequantized values where allowed (warned once per op,
    counted; an in-place write requantizes into the written tensor), else raise."""
    kind = _allowed.get(func, False)
    if kind is False:
        kind = _allowed[func] = _kind(func)
    if kind is None:
        raise _unsupported(func, args, kwargs)
    written = (
        [t for t in _written(func, args, kwargs) if isinstance(t, QuantizedTensor)] if func._schema.is_mutable else []
    )
    for t in written:  # refuse a write into a partial view before anything is written
        _check_writable(t, func.overloadpacket.__name__)
    _counts[str(func)] += 1
    t = written[0] if written else _quantized_args(args, kwargs)[0]
    warn_once(
        f"fallback:{func}",
        f"dtq: {func} ran on the dequantized values of {_describe(t)} ({kind})"
        + (", and its result was requantized into the tensor's payloads" if written else "")
        + ". Warned once per op; dtq.tensor_ops.fallback_counts() counts every call. Dequantize explicitly "
        "(t.dequantize()) where high precision is meant",
    )
    return _dequantized(func, args, kwargs)


def _written(func, args, kwargs) -> list:
    """The arguments ``func`` writes (its schema's ``a!`` ones; foreach ops write lists)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        written = args[i] if i < len(args) else kwargs.get(arg.name)
        out += list(written) if isinstance(written, (list, tuple)) else [written]
    return out


def _dequantized(func, args, kwargs):
    """``func`` on the high-precision values of its QuantizedTensor arguments; those it writes
    take the result back, requantized."""
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


# -- results like a tensor -------------------------------------------------------------------------

_INHERIT = object()  # _like's default: the result shares the source's payloads, so keeps its _partial


def _like(
    t: QuantizedTensor,
    payloads: dict[str, Payload],
    shape=None,
    dtype=None,
    quantizer=None,
    shape2d=None,
    partial=_INHERIT,
) -> QuantizedTensor:
    """A QuantizedTensor like ``t``; a new ``shape`` (without ``shape2d``) is a new [M, K] matrix.
    ``partial``: by default ``t``'s (the result shares its payloads); pass None for a result that
    owns its payloads."""
    if shape is None:
        shape, shape2d = t.shape, t._shape2d
    if partial is _INHERIT:
        partial = t._partial
    return QuantizedTensor(
        shape, dtype or t.dtype, quantizer or t._quantizer, payloads, shape2d=shape2d, partial=partial
    )


def _map_payloads(t: QuantizedTensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Payload]:
    """``fn`` on every payload tensor; tensors shared between directions stay shared."""
    memo: dict[int, torch.Tensor] = {}

    def once(v):
        if id(v) not in memo:
            memo[id(v)] = fn(v)
        return memo[id(v)]

    return {d: {k: once(v) for k, v in p.items()} for d, p in t._payloads.items()}


# -- aliases and copies ----------------------------------------------------------------------------


@implements([aten.detach.default, aten.alias.default])
def _detach(func, args, kwargs):
    t = args[0]
    return _like(t, t._payloads)


@implements([aten.clone.default])
def _clone(func, args, kwargs):
    return _like(args[0], _map_payloads(args[0], torch.clone), partial=None)


@implements([aten._to_copy.default])
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


@implements([aten._pin_memory.default])
def _pin(func, args, kwargs):
    return _like(args[0], _map_payloads(args[0], lambda v: v.pin_memory()), partial=None)


@implements([aten.is_pinned.default])
def _is_pinned(func, args, kwargs):
    return all(v.is_pinned() for p in args[0]._payloads.values() for v in p.values())


# -- zero tensors of the same format ---------------------------------------------------------------


def _zero_payloads(t: QuantizedTensor, shape2: tuple[int, int], device, dtype) -> dict[str, Payload]:
    """Zero payloads of ``t``'s format for a [M, K] = ``shape2`` matrix."""
    return _zeros(t._quantizer, t.directions, shape2, device, dtype)


def _zeros(quantizer, directions: tuple[str, ...], shape2: tuple[int, int], device, dtype) -> dict[str, Payload]:
    out = {}
    for d in directions:
        codec = quantizer.codec(d)
        codec.check_shape(shape2)
        twin = quantizer.aliases(directions).get(d)
        out[d] = dict(out[twin]) if twin in out else codec.empty(shape2, device, dtype)
    return out


def zero_quantized(
    quantizer, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, directions: tuple[str, ...]
) -> QuantizedTensor:
    """A QuantizedTensor of zeros in ``quantizer``'s layout (bitwise ``quantize(zeros)``), made
    without reading or drawing a value: what a weight on the meta device becomes, its payloads
    written once its values exist (after ``to_empty``)."""
    payloads = _zeros(quantizer, tuple(directions), shape_2d(shape), torch.device(device), dtype)
    return QuantizedTensor(shape, dtype, quantizer, payloads)


@implements([aten.empty_like.default, aten.zeros_like.default, aten.new_empty.default, aten.new_zeros.default])
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


@implements([aten.zero_.default])
def _zero_(func, args, kwargs):
    t = args[0]
    _check_writable(t, "zero_")
    for d, p in _zero_payloads(t, t._shape2d, t.device, t.dtype).items():
        for k, v in p.items():
            t._payloads[d][k].copy_(v)
    return t


# -- copy_ ---------------------------------------------------------------------------------------


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
        codec = t._quantizer.codec(d)
        fields = codec.fields()
        for a, b in ((0, p.start), (p.end, p.rows)):
            if a == b:
                continue
            old = {
                k: (v if fields[k] is None else v[a // fields[k] : -(-b // fields[k])]) for k, v in p.whole[d].items()
            }
            changed = dict(old, **{k: v for (dd, k), v in new.items() if dd == d})
            with torch.no_grad():
                before = codec.dequantize(old, (b - a, k_cols))
                after = codec.dequantize(changed, (b - a, k_cols))
            if not _same_bits(before, after):
                return False
    return True


@implements([aten.copy_.default])
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    nb = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    if not isinstance(dst, QuantizedTensor):
        return dst.copy_(src.dequantize(dst.dtype), non_blocking=nb)
    if (
        isinstance(src, QuantizedTensor)
        and src._quantizer == dst._quantizer
        and tuple(src.shape) == tuple(dst.shape)
        and tuple(src._shape2d) == tuple(dst._shape2d)
    ):
        # Same config: copy codes, never requantize them. A direction the source lacks comes
        # from an identical one it has, or the copy is refused (its bits cannot be recovered).
        source = {}
        for d in dst.directions:
            src_d = (
                d
                if src.has(d)
                else next(
                    (
                        h
                        for h in src.directions
                        if src._quantizer.for_direction(h) == src._quantizer.for_direction(d)
                        and src._quantizer.codec(d).identical_directions()
                    ),
                    None,
                )
            )
            if src_d is None:
                raise ValueError(
                    f"copy_: the destination holds a {d} payload but the source ({list(src.directions)}) "
                    f"cannot provide its exact bits; drop it first (update_usage({d}=False)) or copy from "
                    f"a tensor quantized with {d}=True"
                )
            source[d] = src._payloads[src_d]
        if dst._partial is not None:
            # Safe only if the whole's other rows keep their values: the shared tensor-wide fields
            # do not change, or those rows do not depend on them (still zeros).
            changed = {
                (d, k): source[d][k]
                for d, k in dst._partial.shared
                if not _same_bits(dst._payloads[d][k], source[d][k])
            }
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


# -- dim-0 slices ----------------------------------------------------------------------------------


def _shared_fields(quantizer: Quantizer, directions) -> tuple[tuple[str, str], ...]:
    """(direction, field) of every tensor-wide field (``Codec.fields`` None) of ``directions``."""
    out = []
    for d in directions:
        out += [(d, k) for k, rows in quantizer.codec(d).fields().items() if rows is None]
    return tuple(out)


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
        codec = t._quantizer.codec(d)
        align = t._quantizer.block_rows(d)
        if start % align or (end % align and end != m):
            warn_once(
                f"misaligned:{type(codec.q).__name__}:{d}",
                f"dtq: a dim-0 slice of a {codec.name} tensor of shape {list(t.shape)} covers rows "
                f"[{start}, {end}) of its [M, K] view, not on the {d} block boundary (a multiple of "
                f"{align} rows); the result is dequantized to high precision",
            )
            return None
        fields = codec.fields()
        payloads[d] = {
            k: (v if fields[k] is None else v[start // fields[k] : -(-end // fields[k])]) for k, v in p.items()
        }
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


@implements([aten.slice.Tensor])
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


@implements([aten.split.Tensor, aten.split_with_sizes.default])
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


# -- views of the same [M, K] matrix ---------------------------------------------------------------


@implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
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


@implements([aten.as_strided.default])
def _as_strided(func, args, kwargs):
    t, size, stride = args[0], list(args[1]), list(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
    contiguous = [math.prod(size[i + 1 :]) for i in range(len(size))]
    if (
        math.prod(size) != t.numel()
        or (offset or 0) != 0
        or any(st != c for st, c, n in zip(stride, contiguous, size) if n > 1)
    ):
        return NotImplemented
    return _like(t, t._payloads, shape=tuple(size), shape2d=t._shape2d)


_tensor._unhandled = unhandled  # ops no handler took now follow the policy above
