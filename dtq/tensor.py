"""``QuantizedTensor``: a torch.Tensor subclass holding per-direction payloads and its quantizer.

The outer tensor is a storage-less wrapper with the logical shape and the nominal (high-precision)
dtype; the payload tensors (codes, scales, amax) are the real data. What torch ops do with it is
the op table of :mod:`dtq.tensor_ops` (its docstring states the policy): ops with a handler keep
the payloads (detach, clone, ``.to()``, ``copy_``, dim-0 slices, views, ...); pointwise ops,
reductions, matrix products and transposes run on the dequantized values with a one-time warning
(in place: the result is requantized); any other op raises ``NotImplementedError``.

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

import hashlib
import inspect
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import torch

from dtq._torch_private import local_tensor
from dtq.codec import (
    COLUMNWISE,
    DIRECTIONS,
    ROWWISE,
    Payload,
    QuantizedData,
    check_direction,
    columnwise_from_rowwise,
    dequantize_payload,
    quantize_payloads,
    shape_2d,
)
from dtq.distributed import gather

if TYPE_CHECKING:
    from dtq.formats import Quantizer

_FLAT = "_payload__"  # attribute-name prefix under which __tensor_flatten__ exposes payload tensors

# The op table QuantizedTensor.__torch_dispatch__ reads: aten op -> handler(func, args, kwargs),
# returning the result or NotImplemented (declined: the op goes on as if it had no handler), and
# ``_unhandled``, the policy for ops without a result. dtq.tensor_ops (which stands on this module)
# fills both when imported; ``import dtq`` imports it.
_HANDLERS: dict = {}


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


def stable_hash(t: torch.Tensor) -> str:
    """What AOTAutograd's cache keys one of dtq's tensor subclasses by (``_stable_hash_for_caching``):
    its type, metadata and flatten context, and its inner tensors' metadata, never values (a
    graph's inputs and parameters change; their layout is what the graph was built for)."""
    names, ctx = t.__tensor_flatten__()
    inner = [
        (n, tuple(x.shape), tuple(x.stride()), str(x.dtype), x.device.type)
        for n, x in ((n, getattr(t, n)) for n in names)
    ]
    key = (type(t).__qualname__, tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad, repr(ctx), inner)
    return hashlib.sha256(repr(key).encode()).hexdigest()


class QuantizedTensor(torch.Tensor):
    """A high-precision tensor's quantized representation(s): ``rowwise`` and/or ``columnwise``.

    ``quantizer`` is the config that produced it (plain or hybrid); payload ``d`` was made by
    ``quantizer.for_direction(d)``.
    """

    _quantizer: Quantizer
    _payloads: dict[str, Payload]
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        shape,
        dtype: torch.dtype,
        quantizer: Quantizer,
        payloads: dict[str, Payload],
        requires_grad: bool = False,
        shape2d: tuple[int, int] | None = None,
        partial=None,
    ):
        if not payloads:
            raise ValueError("QuantizedTensor needs at least one direction's payload")
        for d in payloads:
            check_direction(d)
        device = next(iter(next(iter(payloads.values())).values())).device
        self = torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=device, requires_grad=requires_grad
        )
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
            raise KeyError(
                f"this QuantizedTensor ({self._quantizer.format_name}) has no {direction} payload; "
                f"it holds {list(self._payloads)}. Build it with update_usage({direction}=True, source=...)"
            )
        return self._payloads[direction]

    def payload_nbytes(self, direction: str | None = None) -> int:
        dirs = self.directions if direction is None else (direction,)
        return sum(t.numel() * t.element_size() for d in dirs for t in self.payload(d).values())

    def __repr__(self, *, tensor_contents=None) -> str:
        return (
            f"QuantizedTensor(shape={list(self.shape)}, dtype={self.dtype}, device={self.device}, "
            f"quantizer={self._quantizer!r}, directions={list(self._payloads)})"
        )

    # -- conversions ---------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype | None = None, *, direction: str | None = None) -> torch.Tensor:
        """High-precision values of one direction (rowwise if present and ``direction`` is None)."""
        return dequantize_payload(
            self._quantizer, self._payloads, self._shape2d, self.shape, dtype or self.dtype, direction
        )

    def update_usage(
        self,
        rowwise: bool | None = None,
        columnwise: bool | None = None,
        source: torch.Tensor | None = None,
        amax: dict[str, torch.Tensor] | torch.Tensor | None = None,
    ) -> QuantizedTensor:
        """Drop directions (False) or build missing ones (True); None leaves a direction as it is.

        A missing direction is built, in this order of preference: exactly from a payload already
        held (same codes under one scale, 2-D blocks; a ``columnwise_source="rowwise_dequantized"``
        hybrid's columnwise payload from its rowwise one, with ``amax`` (the columnwise amax of the
        whole tensor, for a shard) if given); from ``source`` (the high-precision tensor),
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

    def with_directions(self, *directions: str) -> QuantizedTensor:
        """A new tensor sharing this one's payloads of ``directions`` only (the original keeps all)."""
        missing = [d for d in directions if not self.has(d)]
        if missing:
            raise KeyError(f"this QuantizedTensor has no {missing} payload (it holds {list(self._payloads)})")
        return QuantizedTensor(
            self.shape,
            self.dtype,
            self._quantizer,
            {d: self._payloads[d] for d in directions},
            shape2d=self._shape2d,
            partial=_restrict(self._partial, directions),
        )

    def _build(self, d: str, source: torch.Tensor | None, amax) -> Payload:
        if d == COLUMNWISE and ROWWISE in self._payloads and self._quantizer.columnwise_from_rowwise():
            a = amax.get(COLUMNWISE) if isinstance(amax, Mapping) else amax
            return columnwise_from_rowwise(self._quantizer, self._payloads[ROWWISE], self._shape2d, a)
        codec = self._quantizer.codec(d)
        same = [(have, p) for have, p in self._payloads.items() if self._quantizer.for_direction(have) == codec.q]
        for have, payload in same:
            derived = codec.derive(payload, have)
            if derived is not None:
                return derived
        if source is not None:
            if tuple(source.shape) != tuple(self.shape):
                raise ValueError(f"update_usage: source shape {list(source.shape)} != tensor shape {list(self.shape)}")
            if amax is None:
                held = [codec.reusable_amax(p, have) for have, p in same]
                amax = next((a for a in held if a is not None), None)
            return quantize_payloads(self._quantizer, self._as_matrix(source), (d,), amax=amax)[d]
        for have in self._payloads:
            if self._quantizer.codec(have).lossless(self.dtype):
                return quantize_payloads(
                    self._quantizer, self._as_matrix(self.dequantize(direction=have)), (d,), amax=amax
                )[d]
        raise ValueError(
            f"cannot build the {d} payload of a {self._quantizer.format_name} tensor from its "
            f"{list(self._payloads)} payload without losing bits; pass source=<the high-precision tensor> "
            f"or quantize with {d}=True in the first place"
        )

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
            raise ValueError(
                f"dtq: {op} cannot write a value of shape {list(value.shape)} into {_describe(self)}: "
                f"it does not broadcast to {list(self.shape)}"
            ) from e
        new = quantize_payloads(self._quantizer, self._as_matrix(value), self.directions)
        for d, payload in new.items():
            for k, t in payload.items():
                self._payloads[d][k].copy_(t)

    def __reduce_ex__(self, protocol):
        # Plain pickle (and torch.save) rebuild from the payloads; a wrapper has no storage of its
        # own. 1-byte float payloads travel as uint8 (torch cannot plain-pickle float8 tensors).
        payloads = {
            d: {
                k: (
                    (v.view(torch.uint8), v.dtype) if v.element_size() == 1 and v.dtype.is_floating_point else (v, None)
                )
                for k, v in p.items()
            }
            for d, p in self._payloads.items()
        }
        partial = self._partial.key() if self._partial is not None else None
        return (
            _rebuild_quantized,
            (tuple(self.shape), self.dtype, self._quantizer, payloads, self.requires_grad, self._shape2d, partial),
        )

    # -- traceable-wrapper-subclass protocol (nn.Module.to() and friends swap whole tensors) -------
    def _stable_hash_for_caching(self) -> str:
        return stable_hash(self)

    def __tensor_flatten__(self):
        names = [f"{_FLAT}{d}__{k}" for d, p in self._payloads.items() for k in p]
        partial = self._partial.key() if self._partial is not None else None
        return names, (self._quantizer, self.dtype, self._shape2d, partial)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        quantizer, dtype, shape2d, partial = ctx
        payloads: dict = {}
        for name, t in inner.items():
            d, k = name[len(_FLAT) :].split("__", 1)
            payloads.setdefault(d, {})[k] = t
        return QuantizedTensor(outer_size, dtype, quantizer, payloads, shape2d=shape2d, partial=partial)

    def __getattr__(self, name: str):
        if name.startswith(_FLAT):
            d, k = name[len(_FLAT) :].split("__", 1)
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
        return _unhandled(func, args, kwargs)


def _no_op_table(func, args, kwargs):
    raise RuntimeError(
        f"dtq: a QuantizedTensor met {func} before its op table was installed; import dtq "
        "(which imports dtq.tensor_ops) before using dtq.tensor on its own"
    )


_unhandled: Callable = _no_op_table


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


# -- partial views ------------------------------------------------------------------------------


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
    hint = (
        ""
        if not copy_hint
        else ". A copy_ from a QuantizedTensor of the same quantizer is allowed when its tensor-wide values are "
        "bitwise "
        "the view's (e.g. a shard quantized with the whole's global amax), or when the whole's other rows keep "
        "their values under the source's (rows still zero, as in a torch.empty_like buffer filled slice by slice)"
    )
    return ValueError(
        f"dtq: {op} cannot write into {_describe(t)}: it is a dim-0 slice covering rows [{p.start}, {p.end}) of the "
        f"{p.rows} rows of a tensor whose {fields} ({formats}) {'is' if one else 'are'} tensor-wide, shared by all "
        f"{p.rows} rows; writing into the slice would overwrite {'it' if one else 'them'} and change the other "
        f"{p.rows - (p.end - p.start)} rows. Modify the whole tensor t instead: w = t.dequantize(); {change}; "
        f"t.copy_(w) (rows of t's [M, K] view); or use a format with block or row scales for this tensor (MXFP8, FP8 "
        f"blocks, FP8 row-wise with the rowwise direction only)" + hint
    )


def _check_writable(t: QuantizedTensor, op: str) -> None:
    if t._partial is not None:
        raise _partial_write_error(t, op)


def _rebuild_quantized(shape, dtype, quantizer, payloads, requires_grad, shape2d, partial=None) -> QuantizedTensor:
    payloads = {
        d: {k: (v if view is None else v.view(view)) for k, (v, view) in p.items()} for d, p in payloads.items()
    }
    return QuantizedTensor(
        shape, dtype, quantizer, payloads, requires_grad=requires_grad, shape2d=shape2d, partial=partial
    )


# What torch.load(weights_only=True) needs from this module (dtq.weights.quantized_safe_globals adds the rest).
SAFE_GLOBALS = (QuantizedTensor, _rebuild_quantized)
