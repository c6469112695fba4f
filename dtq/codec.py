"""Directions, payloads and codecs: the payload math below every other layer.

A *codec* is the stateless code that turns a 2-D fp32 tensor into the payload of one direction
and back, bound to one (plain quantizer, direction) pair: ``quantizer.codec(direction)``. Each
format registers its codec class for its quantizer class (:func:`register`, in its file under
``dtq/formats``), so a new format touches one file. This module also plans and runs quantization
(:class:`QuantizePlan`, :func:`quantize_payloads`) and holds :class:`QuantizedData`, the payloads
of one tensor without a tensor subclass (what dtq's GEMM path passes around). It knows quantizers
only by the methods it calls on them (``for_direction``, ``codec``, ``aliases``, ``block_rows``).

Conventions shared by every codec:

* the input is viewed as 2-D ``[M, K]`` (all leading dims flattened);
* both directions are stored in the logical orientation ``[M, K]``: the rowwise payload has its
  blocks along K, the columnwise payload its blocks along M. Dim-0 slices and concatenations of a
  payload are therefore plain row ranges of each payload tensor, which is what FSDP2 and sequence
  parallel gathers need; GEMMs transpose where a kernel wants another layout;
* ``fields`` tells, for every payload tensor, how many logical rows one of its rows covers
  (``None`` for per-tensor values that every slice shares). Generic code splits and concatenates
  payloads from that table alone.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, ClassVar

import torch

from dtq._warn import warn_once

if TYPE_CHECKING:
    from dtq.formats.base import Quantizer
    from dtq.kernels import KernelSpec

ROWWISE = "rowwise"
COLUMNWISE = "columnwise"
DIRECTIONS = (ROWWISE, COLUMNWISE)

Payload = dict  # dict[str, torch.Tensor]: the plain tensors of one direction


def check_direction(direction: str) -> str:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'rowwise' or 'columnwise', got {direction!r}")
    return direction


class Codec:
    """Format-specific behaviour of one direction, bound to the plain quantizer ``q`` that produces
    it: ``quantizer.codec(direction)`` returns the instance (built once per quantizer object, so
    binding costs a dict lookup), and callers then write ``c.quantize(x)``, ``c.fields()``,
    ``c.dequantize(payload, shape)``. A format subclasses this once (``@register(MyQuantizer)``)
    and overrides what differs from the defaults below; codecs hold no state besides ``q`` and
    ``direction``."""

    name: ClassVar[str]  # short format name used in byte counters: fp8, fp8_block, mxfp8, ...
    _unrotated: Codec | None = None  # the codec reading this one's payloads without undoing ``rotation``
    __slots__ = ("q", "direction")

    def __init__(self, q: Quantizer, direction: str):
        self.q, self.direction = q, direction

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.q!r}, {self.direction!r})"

    def fields(self) -> dict[str, int | None]:
        raise NotImplementedError

    def tile(self, shape: tuple[int, int]) -> tuple[int, int] | None:
        """The (rows, cols) block sharing one scale in this direction of a [M, K] tensor; None when
        there are no blocks (one scale per tensor, or none)."""
        return None

    def check_shape(self, shape: tuple[int, int]) -> None:
        """Raise ValueError if this direction cannot represent a [M, K] tensor."""

    def needs_amax(self) -> bool:
        """Whether the direction depends on an amax taken over every row (reduced across ranks when
        the rows are sharded): one tensor-wide value, or one per column (``amax_shape``)."""
        return False

    def amax_shape(self, shape: tuple[int, int]) -> tuple[int, ...]:
        """Shape of that amax for a [M, K] tensor: ``()`` tensor-wide (reduced over shards of
        either dim), ``(1, K)`` per column (reduced over dim-0 shards only)."""
        return ()

    def local_amax(self, x: torch.Tensor) -> torch.Tensor:
        """``max|x|`` over the whole tensor, as a 0-dim fp32 tensor (the default: one scale per
        tensor). On a GPU with dtq's kernels, one read of ``x`` instead of an ``abs`` copy and a
        reduction (the value is exact either way: a maximum rounds nothing)."""
        if not x.numel():
            return torch.zeros((), device=x.device)
        if x.is_cuda and x.dim() == 2 and x.is_contiguous():
            from dtq import kernels

            if x.dtype in kernels.INPUT_DTYPES and kernels.available(x.device):
                return kernels.amax(x, True, None)[0]
        return x.abs().amax().to(torch.float32)

    def amax_is_tensor_max(self) -> bool:
        """Whether :meth:`local_amax` is ``max|x|`` over the whole tensor (this class's default):
        then every direction taking it shares one value, and the amax of ``x`` cast to another
        float dtype is the cast of ``x``'s amax (rounding is monotone and symmetric). A format
        whose amax is taken another way (per column, after a transform) overrides ``local_amax``
        and so answers False."""
        return type(self).local_amax is Codec.local_amax

    def scales_from_block_amax(self) -> bool:
        """Whether each block scale is a function of the block's amax (and the tensor-wide, row or
        column amax) alone: a flat-slice master cast fills the elements it does not own with their
        block amax and relies on this."""
        return True

    def column_shardable(self) -> bool:
        """Whether a shard of the last dim (a row-parallel weight under tensor parallelism) can hold
        this direction as the slice of the whole tensor's payload."""
        return True

    def uses_rng(self) -> bool:
        return False

    def quantize(self, x: torch.Tensor, amax: torch.Tensor | None = None, seed: torch.Tensor | None = None) -> Payload:
        """``x`` is [M, K] contiguous in the caller's dtype (codecs compute in fp32). ``amax`` is
        given iff ``needs_amax``; ``seed`` iff ``uses_rng``."""
        raise NotImplementedError

    def traced_quantize(
        self, x: torch.Tensor, amax: torch.Tensor, transposed: bool = False, triton: bool = False
    ) -> Payload | None:
        """:meth:`quantize`'s payload as plain tensor ops for a graph a compiler fuses into the
        kernels around it (inductor's decompositions, ``dtq.nn._fused_input``), bitwise
        ``quantize``'s however it is compiled: no data-dependent branch, every division correctly
        rounded. ``amax``: max|x| over the whole tensor; ``transposed``: also ``data_t``, the codes
        [K, M]; ``triton``: the graph compiles to Triton on sm_89+ (see ``_bits.cast_fp8``), whose
        own conversions may stand in for ops that only other compilers need. None where the format
        has no such form (the caller then runs its op)."""
        return None

    def dequantize(
        self,
        payload: Payload,
        shape: tuple[int, int],
        dtype: torch.dtype = torch.float32,
        *,
        factored: bool = False,
        rotated: bool = False,
        kernel_only: bool = False,
    ):
        """The [M, K] values of ``payload`` in ``dtype`` (fp32, in the input's value space; another
        dtype: their rounding). The one entry point; the options select what GEMMs and tests read:

        * ``factored``: ``(values, factor)`` with ``values * factor ~= the values``: the per-tensor
          factor (0-dim; or [M, 1] / [1, K] per row / column, constant along the direction's blocks,
          so along the GEMM's output dims; None where there is none) is split off so an emulated
          GEMM applies it after the product, as native scaled GEMMs do. GEMMs only read the values:
          a passthrough format may hand out its stored tensor;
        * ``rotated`` (implies ``factored``): the values left in ``rotation()`` (NVFP4's Hadamard);
        * ``kernel_only``: only the values a CUDA kernel computes (with ``factored``, without the
          factor), or None where none applies (not on a GPU with kernels, no kernel for the format).
        """
        if kernel_only:
            if rotated:
                return (self._unrotated or self)._kernel(payload, shape, True, dtype)
            return self._kernel(payload, shape, factored, dtype)
        if rotated:
            return self._rotated(payload, shape, dtype)
        if factored:
            return self._factored(payload, shape, dtype)
        out = self._plain(payload, shape)
        return out if dtype == torch.float32 else out.to(dtype)

    # -- what dequantize runs (formats override these; callers use dequantize) --------------------
    def _reference(self, payload: Payload, shape: tuple[int, int]) -> torch.Tensor:
        """The PyTorch reference: [M, K] fp32, which defines the bits."""
        raise NotImplementedError

    def _plain(self, payload: Payload, shape: tuple[int, int]) -> torch.Tensor:
        out = self._kernel(payload, shape)
        return out if out is not None else self._reference(payload, shape)

    def _factored(
        self, payload: Payload, shape: tuple[int, int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # values come in ``dtype`` (a kernel writes them directly where it can)
        out = self._kernel(payload, shape, dtype=dtype)
        return (out if out is not None else self._plain(payload, shape).to(dtype)), None

    def _rotated(
        self, payload: Payload, shape: tuple[int, int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._factored(payload, shape, dtype)

    def _kernel(
        self, payload: Payload, shape: tuple[int, int], factored: bool = False, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor | None:
        """The values by a CUDA kernel, or None when the payload is not on a GPU with kernels, or
        the format has none."""
        data = payload.get("data")
        if data is None or not data.is_cuda:
            return None
        spec = self.kernel_spec(shape, torch.float32)
        if spec is None:
            return None
        from dtq import kernels

        return kernels.dequantize(spec, payload, shape, factored, dtype)

    def empty(self, shape: tuple[int, int], device: torch.device, dtype: torch.dtype) -> Payload:
        """Zero-filled payload of the right layout (dequantizes to zeros); draws no random numbers."""
        raise NotImplementedError

    def identical_directions(self) -> bool:
        """Whether both directions' payloads are bitwise the same (one scale per tensor, square
        tiles, passthrough): then either direction is the other, and only one needs moving."""
        return False

    def derive(self, payload: Payload, src: str) -> Payload | None:
        """This direction's payload computed exactly from the ``src`` direction's (same quantizer),
        or None if that loses bits."""
        return {k: v.clone() for k, v in payload.items()} if self.identical_directions() else None

    def amax_space(self) -> str:
        """What the direction's tensor-wide amax is taken over: "x", or a transform of x."""
        return "x"

    def reusable_amax(self, payload: Payload, src: str) -> torch.Tensor | None:
        """The tensor-wide amax held in a ``src`` payload (same quantizer) if this direction needs
        that same value, else None."""
        if "amax" in payload and self.q.codec(src).amax_space() == self.amax_space():
            return payload["amax"]
        return None

    def exact_dtype(self, payload: Payload, rotated: bool = False) -> torch.dtype:
        """The narrowest of bfloat16 / float32 holding the values of ``dequantize(factored=True)``
        (or ``rotated=True``) exactly: an emulated GEMM may feed such values to BF16 tensor cores
        (with fp32 accumulation) without changing a single product. (Values below bf16's normal
        range, 2^-126, keep fewer bits there than in fp32: only blocks whose amax is below ~1e-34
        can have them, and their products vanish next to any normal value.)"""
        return torch.float32

    def rotation(self):
        """A hashable name of the orthogonal transform ``T`` over rows that the payload holds its
        values in (NVFP4's random Hadamard), or None. Two operands with the same rotation along
        their contraction dim have the product of the unrotated ones: ``(T a)^T (T b) = a^T b``."""
        return None

    def lossless(self, dtype: torch.dtype) -> bool:
        """Whether dequantizing gives back a ``dtype`` input exactly (only passthrough formats)."""
        return False

    def kernel_spec(self, shape: tuple[int, int], dtype: torch.dtype) -> KernelSpec | None:
        """How the fused CUDA kernel (``dtq.kernels``) produces this direction of a [M, K] ``dtype``
        input, or None: no kernel for it, the reference runs (on any device)."""
        return None

    def transposed_codes_spec(self, shape: tuple[int, int], dtype: torch.dtype) -> KernelSpec | None:
        """How the fused kernel writes this direction's codes of a [M, K] ``dtype`` input a second
        time, transposed (a ``data_t`` [K, M] field beside the payload, the same codes), while it
        writes the other direction's payload: the layout Hopper's FP8 GEMMs read in dgrad and wgrad,
        which would otherwise take a transpose kernel per operand. None: the format has no such
        field (only identical-direction formats can: the codes are the other direction's)."""
        return None


_REGISTRY: dict[type, type[Codec]] = {}
_BY_NAME: dict[str, type] = {}


def register(quantizer_cls: type):
    """Class decorator: ``@register(MyQuantizer) class MyCodec(Codec): ...``."""

    def deco(codec_cls: type[Codec]) -> type[Codec]:
        if quantizer_cls in _REGISTRY:
            raise RuntimeError(f"{quantizer_cls.__name__} already has a codec")
        _REGISTRY[quantizer_cls] = codec_cls
        _BY_NAME[codec_cls.name] = quantizer_cls
        return codec_cls

    return deco


def codec_class(q: Quantizer) -> type[Codec]:
    """The codec class registered for the plain quantizer ``q``'s class."""
    try:
        return _REGISTRY[type(q)]
    except KeyError:
        raise TypeError(f"{type(q).__name__} has no registered codec (is it a plain format quantizer?)") from None


def bind_codecs(q: Quantizer, direction: str) -> Codec:
    """Build ``q``'s codecs of both directions once and keep them on ``q`` (see ``Quantizer.codec``)."""
    check_direction(direction)
    codecs = {}
    for d in DIRECTIONS:
        sub = q.for_direction(d)
        codecs[d] = codec_class(sub)(sub, d) if sub is q else sub.codec(d)
    object.__setattr__(q, "_codecs", codecs)  # not a field: equality, hashing, repr and pickling ignore it
    return codecs[direction]


def registered_quantizers() -> tuple[type, ...]:
    return tuple(_REGISTRY)


def quantizer_names() -> str:
    """The registered quantizer classes, for error messages ("Float8Quantizer, ...")."""
    return ", ".join(c.__name__ for c in _REGISTRY)


def dequantize_payload(
    quantizer: Quantizer,
    payloads: dict[str, Payload],
    shape2d: tuple[int, int],
    shape,
    dtype: torch.dtype,
    direction: str | None,
) -> torch.Tensor:
    """High-precision values of one direction (rowwise if present and ``direction`` is None) of the
    [M, K] matrix ``shape2d`` that ``payloads`` describe, viewed as ``shape``."""
    if direction is None:
        direction = ROWWISE if ROWWISE in payloads else COLUMNWISE
    if direction not in payloads:
        check_direction(direction)
        raise KeyError(
            f"this QuantizedTensor ({quantizer.format_name}) has no {direction} payload; "
            f"it holds {list(payloads)}. Build it with update_usage({direction}=True, source=...)"
        )
    with torch.no_grad():
        out = quantizer.codec(direction).dequantize(payloads[direction], shape2d)
    return out.reshape(shape).to(dtype)


class QuantizedData:
    """A quantized value's payloads and quantizer without the ``torch.Tensor`` wrapper: what dtq's
    GEMM path passes from a quantization to its GEMMs and saves for backward (as payload tensors).
    It reads like a ``dtq.QuantizedTensor`` (``quantizer``, ``payload``, ``directions``,
    ``shape2d``, ``dequantize``) but costs no tensor-subclass construction, which on the host is
    a large part of a small GEMM's time. Internal: never handed to users."""

    __slots__ = ("_quantizer", "_payloads", "shape", "dtype", "_shape2d", "device")

    def __init__(
        self,
        shape,
        dtype: torch.dtype,
        quantizer: Quantizer,
        payloads: dict[str, Payload],
        shape2d: tuple[int, int] | None = None,
        device: torch.device | None = None,
    ):
        self.shape, self.dtype, self._quantizer, self._payloads = shape, dtype, quantizer, payloads
        self._shape2d = shape2d if shape2d is not None else shape_2d(shape)
        self.device = device if device is not None else next(iter(next(iter(payloads.values())).values())).device

    @property
    def quantizer(self) -> Quantizer:
        return self._quantizer

    @property
    def shape2d(self) -> tuple[int, int]:
        return self._shape2d

    @property
    def directions(self) -> tuple[str, ...]:
        return tuple(self._payloads)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def has(self, direction: str) -> bool:
        return direction in self._payloads

    def payload(self, direction: str) -> Payload:
        return self._payloads[direction]

    def dequantize(self, dtype: torch.dtype | None = None, *, direction: str | None = None) -> torch.Tensor:
        return dequantize_payload(
            self._quantizer, self._payloads, self._shape2d, self.shape, dtype or self.dtype, direction
        )

    def with_directions(self, *directions: str) -> QuantizedData:
        return QuantizedData(
            self.shape,
            self.dtype,
            self._quantizer,
            {d: self._payloads[d] for d in directions},
            self._shape2d,
            self.device,
        )

    def __repr__(self) -> str:
        return (
            f"QuantizedData(shape={list(self.shape)}, quantizer={self._quantizer!r}, directions={list(self._payloads)})"
        )


def wanted_directions(rowwise: bool, columnwise: bool) -> tuple[str, ...]:
    if rowwise:
        return DIRECTIONS if columnwise else (ROWWISE,)
    if columnwise:
        return (COLUMNWISE,)
    raise ValueError("quantize needs at least one of rowwise=True / columnwise=True")


def as_2d(x: torch.Tensor, q: Quantizer) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(
            f"{type(q).__name__}.quantize expects a floating-point torch.Tensor, got {getattr(x, 'dtype', type(x))}"
        )
    if type(x) is not torch.Tensor and hasattr(x, "dequantize") and hasattr(x, "_payloads"):
        raise TypeError(
            f"{type(q).__name__}.quantize got a QuantizedTensor; call .dequantize() first "
            "or use copy_() to requantize into an existing one"
        )
    if x.dim() == 0:
        raise ValueError(f"{type(q).__name__} cannot quantize a 0-dim tensor; give it at least one dimension")
    if hasattr(x, "__dtq_unwrap__"):
        x = x.__dtq_unwrap__()  # a wrapper around high-precision data (dtq.parallel.HighPrecisionWeight)
    if x.requires_grad:  # (a detach of anything else is an alias that costs a tensor: host time)
        x = x.detach()
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def shape_2d(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        raise ValueError("quantized tensors need at least one dimension")
    k = shape[-1]
    m = 1
    for s in shape[:-1]:
        m *= s
    return m, k


class QuantizePlan:
    """Everything quantizing a [M, K] tensor of one dtype on one device into some directions needs
    beyond its values, decided once per (quantizer, directions, shape, dtype, device): the codec of
    each direction, the directions that share another's payload, the amaxes to compute, and the
    prepared CUDA kernel launch (:class:`dtq.kernels.QuantizeLaunch`) where one applies. Every call
    then does only the work (the hot path of every GEMM)."""

    __slots__ = (
        "q",
        "directions",
        "codecs",
        "twins",
        "own",
        "uses_rng",
        "amax_spaces",
        "needs_amax",
        "launch",
        "reference",
        "torch_amax",
        "derived",
        "transposed",
    )

    def __init__(
        self,
        q: Quantizer,
        directions: tuple[str, ...],
        shape: tuple[int, int],
        dtype: torch.dtype,
        device: torch.device,
        transposed: bool = False,
    ):
        self.q, self.directions = q, directions
        self.derived, self.transposed = None, False
        if COLUMNWISE in directions and q.columnwise_from_rowwise():
            self._plan_derived(directions, shape, dtype, device)
            return
        self.codecs = {d: q.codec(d) for d in directions}
        for c in self.codecs.values():
            c.check_shape(shape)  # raises on every call with a bad shape: never cached
        self.twins = q.aliases(tuple(self.codecs))
        self.own = tuple(d for d in self.codecs if d not in self.twins)
        codecs = {d: self.codecs[d] for d in self.own}
        self.uses_rng = any(c.uses_rng() for c in codecs.values())
        self.needs_amax = {d: c.needs_amax() for d, c in codecs.items()}
        self.amax_spaces = frozenset(codecs[d].amax_space() for d in self.own if self.needs_amax[d])
        self.launch, self.reference, self.torch_amax = None, self.own, ()
        if device.type == "cuda" and shape[0] * shape[1] > 0:
            from dtq import kernels

            if dtype in kernels.INPUT_DTYPES and kernels.available(device):
                specs = {d: s for d in self.own if (s := codecs[d].kernel_spec(shape, dtype)) is not None}
                if transposed and self.twins.get(COLUMNWISE) == ROWWISE and tuple(specs) == (ROWWISE,):
                    t = self.codecs[COLUMNWISE].transposed_codes_spec(shape, dtype)
                    if t is not None:  # the columnwise codes also written [K, M], from the same launch
                        specs[COLUMNWISE], self.transposed = t, True
                if specs:
                    needs = {**self.needs_amax, COLUMNWISE: True} if self.transposed else self.needs_amax
                    tensor_amax = tuple(d for d in specs if needs[d] and not specs[d].amax_vector)
                    self.launch = kernels.QuantizeLaunch(specs, tensor_amax)
                    self.reference = tuple(d for d in self.own if d not in specs)
                    # per-column amaxes of T x: no kernel pass computes them; the reference's ops do
                    self.torch_amax = tuple(d for d, s in specs.items() if s.amax_vector and s.amax_space == "hadamard")

    def _plan_derived(self, directions, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> None:
        """A hybrid whose columnwise payload is quantized from the dequantized rowwise one: the
        rowwise plan runs whatever is asked (its amax is needed either way), then the columnwise
        plan on its fp32 values. ``own`` lists both directions, so both amaxes are taken if given."""
        q = self.q
        rq, cq = q.for_direction(ROWWISE), q.for_direction(COLUMNWISE)
        self.codecs = {ROWWISE: q.codec(ROWWISE), COLUMNWISE: q.codec(COLUMNWISE)}
        self.derived = (
            quantize_plan(rq, (ROWWISE,), shape, dtype, device),
            quantize_plan(cq, (COLUMNWISE,), shape, torch.float32, device),
            ROWWISE in directions,
        )
        self.twins, self.own = {}, DIRECTIONS
        self.uses_rng = any(c.uses_rng() for c in self.codecs.values())
        self.needs_amax = {d: c.needs_amax() for d, c in self.codecs.items()}
        spaces = {
            ROWWISE: self.codecs[ROWWISE].amax_space(),
            COLUMNWISE: f"dequantized {ROWWISE} " + cq.codec(COLUMNWISE).amax_space(),
        }
        self.amax_spaces = frozenset(spaces[d] for d in DIRECTIONS if self.needs_amax[d])
        self.launch, self.reference, self.torch_amax = None, (), ()

    def _call_derived(self, xc: torch.Tensor, given: dict[str, torch.Tensor], seed) -> dict[str, Payload]:
        rows, cols, keep_rows = self.derived
        row = rows(xc, {ROWWISE: given[ROWWISE]} if ROWWISE in given else {}, seed)[ROWWISE]
        y = self.codecs[ROWWISE].dequantize(row, tuple(xc.shape))
        col = cols(y.contiguous(), {COLUMNWISE: given[COLUMNWISE]} if COLUMNWISE in given else {}, seed)
        return {ROWWISE: row, COLUMNWISE: col[COLUMNWISE]} if keep_rows else col

    def _call_transposed(self, xc: torch.Tensor, given: dict[str, torch.Tensor]) -> dict[str, Payload]:
        """Both directions of an identical-direction format from one launch that also writes the
        codes transposed: the columnwise payload is the rowwise one plus ``data_t``. Both kernel
        slots read one amax (the rowwise one if given, else the launch's own pass)."""
        a = given.get(ROWWISE)
        out = self.launch(xc, {ROWWISE: a, COLUMNWISE: a} if a is not None else _NO_AMAX, None)
        row = out[ROWWISE]
        return {ROWWISE: row, COLUMNWISE: {**row, **out[COLUMNWISE]}}

    def empty(self, shape: tuple[int, int], device: torch.device, dtype: torch.dtype) -> dict[str, Payload]:
        """Payloads of the layout a call returns (fields, shapes, dtypes, twins sharing tensors),
        empty and computing nothing: what fake (meta) implementations and saved layouts read."""
        if self.derived is not None:
            rows, cols, keep_rows = self.derived
            col = cols.empty(shape, device, torch.float32)
            return {ROWWISE: rows.empty(shape, device, dtype)[ROWWISE], **col} if keep_rows else col
        out = {d: self.codecs[d].empty(shape, device, dtype) for d in self.own}
        if self.transposed:
            ((name, tshape, tdtype),) = self.codecs[COLUMNWISE].transposed_codes_spec(shape, dtype).fields
            row = out[ROWWISE]
            return {ROWWISE: row, COLUMNWISE: {**row, name: torch.empty(tshape, dtype=tdtype, device=device)}}
        return {d: dict(out[self.twins[d]]) if d in self.twins else out[d] for d in self.codecs}

    def __call__(self, xc: torch.Tensor, given: dict[str, torch.Tensor], seed) -> dict[str, Payload]:
        """Payloads of the contiguous [M, K] ``xc``; ``given``: amaxes of own directions (checked
        shapes, fp32 on xc's device), ``seed``: a tensor when ``uses_rng``."""
        if self.derived is not None:
            return self._call_derived(xc, given, seed)
        out, reference = {}, self.reference
        if self.launch is not None:
            for d in self.torch_amax:
                if d not in given:
                    given = {**given, d: self.codecs[d].local_amax(xc)}
            if self.transposed:
                return self._call_transposed(xc, given)
            out = self.launch(xc, given, seed)
            if out is None:  # the generic kernel lacks an option of this quantizer: nothing launched
                _warn_reference(self.q)
                out, reference = {}, self.own
        for d in reference:
            codec = self.codecs[d]
            a = None
            if self.needs_amax[d]:
                a = given[d] if d in given else codec.local_amax(xc).to(device=xc.device, dtype=torch.float32)
            out[d] = codec.quantize(xc, a, seed if codec.uses_rng() else None)
        if self.twins:
            return {d: dict(out[self.twins[d]]) if d in self.twins else out[d] for d in self.codecs}
        return out if len(out) == 1 or self.own == tuple(out) else {d: out[d] for d in self.own}


def columnwise_from_rowwise(
    q: Quantizer, rowwise: Payload, shape: tuple[int, int], amax: torch.Tensor | None = None
) -> Payload:
    """The columnwise payload of a ``columnwise_from_rowwise`` hybrid ``q``, computed from its
    rowwise payload of a [M, K] tensor: bitwise what quantizing that tensor gives when the payload
    holds all of it (or when ``amax``, the columnwise amax of the whole, is given). Gathers that
    move only rowwise payloads derive the other direction with this."""
    y = q.codec(ROWWISE).dequantize(rowwise, shape)
    c = q.for_direction(COLUMNWISE)
    return quantize_payloads(c, y, (COLUMNWISE,), amax=None if amax is None else {COLUMNWISE: amax})[COLUMNWISE]


@functools.lru_cache(maxsize=4096)
def row_bytes(q: Quantizer, direction: str, shape: tuple[int, int]) -> int:
    """Bytes of the row-structured payload fields of one direction of a [M, K] tensor (what a
    gather moves; per-tensor fields are reduced, not gathered)."""
    codec = q.codec(direction)
    fields = codec.fields()
    empty = codec.empty(shape, torch.device("meta"), torch.float32)
    return sum(v.numel() * v.element_size() for k, v in empty.items() if fields[k] is not None)


def split_derived(q: Quantizer, directions: tuple[str, ...], shape: tuple[int, int]) -> tuple[tuple, tuple]:
    """``(moved, derived)``: which of ``directions`` a gather of a [M, K] shard moves, and which it
    derives from the moved ones afterwards. Only a ``columnwise_from_rowwise`` hybrid's columnwise
    payload is derived: always when the rowwise payload moves anyway, else when the rowwise
    payload is no larger than the columnwise one (the unsharded tensor then holds both)."""
    if COLUMNWISE not in directions or not q.columnwise_from_rowwise():
        return directions, ()
    if ROWWISE in directions or row_bytes(q, ROWWISE, shape) <= row_bytes(q, COLUMNWISE, shape):
        return (ROWWISE,), (COLUMNWISE,)
    return directions, ()


def _warn_reference(q: Quantizer) -> None:
    warn_once(
        f"generic-kernel {q!r}",
        f"{q!r}: the generic quantize kernel (this slot pair has no specialised "
        "kernel, or the input is not 16-byte aligned) lacks an option of this quantizer; the PyTorch "
        "reference runs instead (same bits, slower)",
    )


_plans: dict = {}


def quantize_plan(
    q: Quantizer,
    directions: tuple[str, ...],
    shape: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
    transposed: bool = False,
) -> QuantizePlan:
    """The (cached) plan of quantizing a [M, K] ``dtype`` tensor on ``device`` into ``directions``;
    ``transposed``: the columnwise payload also carries its codes transposed (``data_t``) where
    the format and the kernels can write them in the same launch (see
    :meth:`Codec.transposed_codes_spec`; ``plan.transposed`` says whether they will)."""
    if device.type == "cuda":  # whether the kernels run depends on DTQ_DISABLE_KERNELS (tests flip it)
        from dtq import kernels

        key = (q, directions, shape, dtype, device, kernels.disabled_token(), transposed)
    else:
        key = (q, directions, shape, dtype, device, transposed)
    plan = _plans.get(key)
    if plan is None:
        plan = QuantizePlan(q, directions, shape, dtype, device, transposed)
        if len(_plans) > 4096:
            _plans.clear()
        _plans[key] = plan
    return plan


def quantize_payloads(
    q: Quantizer, x: torch.Tensor, directions: tuple[str, ...], amax=None, seed=None
) -> dict[str, Payload]:
    """Payloads of ``directions`` for ``x`` (the engine behind ``Quantizer.quantize``)."""
    if type(x) is torch.Tensor and x.dim() == 2 and x.is_floating_point():  # as_2d's checks, passed
        xc = (x.detach() if x.requires_grad else x).contiguous()
    else:
        xc = as_2d(x, q).contiguous()
    shape = tuple(xc.shape)
    plan = quantize_plan(q, directions if type(directions) is tuple else tuple(directions), shape, xc.dtype, xc.device)
    return plan(
        xc,
        _given_amaxes(q, plan, amax, shape, xc.device) if amax is not None else _NO_AMAX,
        _seed(seed, x) if plan.uses_rng else None,
    )


_NO_AMAX: dict = {}  # read only (QuantizePlan.__call__ copies before adding)


def _seed(seed, x: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding's seed: drawn from torch's generator of the input's device unless given
    (activation recompute restores that RNG state, so it replays the same seed)."""
    if seed is None:
        gen_device = x.device if x.device.type != "meta" else torch.device("cpu")
        return torch.randint(0, 2**31 - 1, (), device=gen_device, dtype=torch.int64)
    return seed if isinstance(seed, torch.Tensor) else torch.tensor(int(seed), dtype=torch.int64)


def _given_amaxes(q: Quantizer, plan: QuantizePlan, amax, shape: tuple[int, int], device) -> dict[str, torch.Tensor]:
    if isinstance(amax, torch.Tensor) and len(plan.amax_spaces) > 1:
        raise ValueError(
            f"{type(q).__name__}.quantize: one amax tensor was given, but its directions take their "
            f"amax over different values ({sorted(plan.amax_spaces)}, e.g. the random-Hadamard columnwise "
            "direction needs max|T x|); pass amax={direction: tensor}, as local_amax() returns"
        )
    given = {}
    for d in plan.own:
        if plan.needs_amax[d]:
            a = amax if isinstance(amax, torch.Tensor) else amax.get(d)
            if a is not None:
                given[d] = _given_amax(q, plan.codecs[d], a, shape).to(device=device, dtype=torch.float32)
    return given


def _given_amax(q: Quantizer, codec: Codec, a: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    want = codec.amax_shape(shape)
    if a.numel() != torch.Size(want).numel():
        raise ValueError(
            f"{type(q).__name__}.quantize: the {codec.direction} amax has shape {list(a.shape)}, but a "
            f"tensor viewed as [M, K] = {list(shape)} needs {list(want) or 'one value (0-dim)'} for "
            f"{type(codec.q).__name__}; pass what local_amax() returns for this tensor, MAX-reduced "
            "over the ranks that hold its other rows"
        )
    return a.reshape(want)


def shape_error(q: Quantizer, shape: tuple[int, int], direction: str, requirement: str) -> ValueError:
    e = ValueError(
        f"{type(q).__name__} ({direction}) cannot quantize a tensor viewed as [M, K] = {list(shape)}: "
        f"{requirement}. Pad the tensor, choose a shape that meets this, or use another format for "
        f"this tensor (e.g. Float8BlockQuantizer allows partial blocks)."
    )
    e.requirement = f"{q.format_name} {direction}: {requirement}"  # the short form (dtq.shapes reports)
    return e
