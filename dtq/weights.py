"""GEMM weights as parameters: :class:`HighPrecisionWeight` (a high-precision weight whose FSDP2
all-gather moves quantized payloads), :func:`local_data`, the one way dtq unwraps a parameter
(DTensor shard, HighPrecisionWeight) to the tensor that holds its values, and the max|w| a gather
took of the weight it wrote (:func:`remember_gathered_amax`, :func:`gathered_amax`)."""

from __future__ import annotations

import inspect
import weakref

import torch
from torch.utils._pytree import tree_map

from dtq import tensor
from dtq._torch_private import local_tensor, register_foreach_type
from dtq.distributed import gather

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
        written = [
            (i, a.name)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        where = _WRITTEN[func] = tuple(written)
    for i, name in where:
        arg = args[i] if i < len(args) else (kwargs or {}).get(name)
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(t, HighPrecisionWeight):
                torch.autograd.graph.increment_version(t)


class HighPrecisionWeight(torch.Tensor):
    """A GEMM weight kept in high precision whose FSDP2 all-gather moves quantized payloads.

    A wrapper subclass around the real data (``_data``): the view and copy ops FSDP2 applies to a
    parameter (detach, chunk/split, slice, view, new_zeros, copy_, ...) keep the class and with it
    the all-gather hooks; every other op runs on the plain data and returns plain tensors."""

    _KEEP = {
        aten.detach.default,
        aten.alias.default,
        aten.view.default,
        aten._unsafe_view.default,
        aten.slice.Tensor,
        aten.split.Tensor,
        aten.split_with_sizes.default,
        aten.as_strided.default,
        aten.new_zeros.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten.empty_like.default,
        aten.zeros_like.default,
        aten.clone.default,
        aten._to_copy.default,
        aten._pin_memory.default,
        aten.t.default,
    }
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, requires_grad: bool = False):
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            layout=data.layout,
            requires_grad=requires_grad,
        )
        self._data = data
        self._amax_cache = None
        self._shard_cache = None
        self._gather_static = {}  # dtq.distributed.gather's per-plan decisions, by gathered directions
        return self

    @staticmethod
    def wrap(t: torch.Tensor) -> HighPrecisionWeight:
        return HighPrecisionWeight(t.detach())

    def __dtq_unwrap__(self) -> torch.Tensor:  # how dtq.formats (below this module) unwraps it for quantize()
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
    def _stable_hash_for_caching(self) -> str:
        return tensor.stable_hash(self)

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return HighPrecisionWeight(inner["_data"])

    # -- the global-amax cache of FSDP2 gathers (dtq.distributed.gather, dtq.parallel.precompute_amax)
    def cached_amax(self, key: tuple) -> dict | None:
        """The global amaxes remembered under ``key`` (see ``dtq.distributed.gather.amax_key``), or None."""
        cached = self._amax_cache
        return cached[1] if cached is not None and cached[0] == key else None

    def remember_amax(self, key: tuple, amax: dict) -> None:
        self._amax_cache = (key, amax)

    # -- the quantized shard a forward gather leaves for the backward gather (dtq.distributed.gather)
    def cached_shard(self, key: tuple) -> dict | None:
        """The shard payloads remembered under ``key`` (``amax_key``'s), or None."""
        cached = self._shard_cache
        return cached[1] if cached is not None and cached[0] == key else None

    def remember_shard(self, key: tuple | None, payloads: dict | None = None) -> None:
        """Keep ``payloads`` under ``key``; ``None``: keep nothing (frees the payloads)."""
        self._shard_cache = None if key is None else (key, payloads)

    # -- FSDP2 all-gather extension ---------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return gather.high_precision_pre_all_gather(self, self._data, mesh, outer_size, module, mp_policy)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return tensor.post_all_gather(all_gather_outputs, metadata, param_dtype, out)


# FSDP2 reads the hook's signature on every gather: precomputed, as for QuantizedTensor's.
HighPrecisionWeight.fsdp_pre_all_gather.__signature__ = inspect.signature(HighPrecisionWeight.fsdp_pre_all_gather)
# AdamW's default picks the same (multi-tensor) kernels for these weights as for FSDP2's DTensors of them.
register_foreach_type(HighPrecisionWeight)


def unwrap(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a :class:`HighPrecisionWeight`; any other tensor itself."""
    return t._data if isinstance(t, HighPrecisionWeight) else t


def local_data(p: torch.Tensor) -> torch.Tensor:
    """The tensor holding parameter ``p``'s values on this rank: a DTensor's local shard, unwrapped
    from a :class:`HighPrecisionWeight` (a QuantizedTensor stays one)."""
    return unwrap(local_tensor(p))


# tensors with memory of their own and no dispatch of their own (what a data pointer stands for)
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
# data_ptr of a gathered weight -> (a reference to it, its version, numel, max|w| as a 0-dim fp32)
_GATHERED: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}
_PRUNE_AT = [1024]  # entries past which those of freed or moved memory go (FSDP2 refills each step)


def remember_gathered_amax(t: torch.Tensor, amax: torch.Tensor) -> None:
    """Keep ``amax`` = max|t| for the contiguous ``t`` a gather has just written (FSDP2's one-rank
    cast, ``dtq.parallel.fsdp``), for the GEMMs that quantize ``t`` per tensor: the same bits as
    their own amax pass, without reading ``t`` again. (Once per weight and gather: kept lean.)"""
    ptr = t.data_ptr()
    _GATHERED[ptr] = (weakref.ref(t), t._version, t.numel(), amax)
    if len(_GATHERED) > _PRUNE_AT[0]:
        for key, (ref, *_) in list(_GATHERED.items()):
            if (held := ref()) is None or held.data_ptr() != key:
                del _GATHERED[key]
        _PRUNE_AT[0] = max(1024, 2 * len(_GATHERED))


def gathered_amax(w: torch.Tensor) -> torch.Tensor | None:
    """max|w| as :func:`remember_gathered_amax` kept it, where ``w`` (the gathered tensor or a
    contiguous view of all of it) still holds what the gather wrote: the same memory, and no
    write since (the version counter ``w`` shares with it); None otherwise. Writes that bypass
    version counters (through ``.data``, or under ``_unsafe_preserve_version_counter``) are not
    seen, as torch's own saved-tensor checks do not see them."""
    if not _GATHERED or type(w) not in PLAIN_TYPES or torch.compiler.is_compiling():
        return None  # (a subclass or a traced tensor: no memory of its own to look up)
    ptr = w.data_ptr()
    kept = _GATHERED.get(ptr)
    if kept is None:
        return None
    ref, version, numel, amax = kept
    t = ref()
    if t is None or w._version != version or t._version != version or t.data_ptr() != ptr:
        return None
    return amax if w.numel() == numel and w.is_contiguous() else None
