"""Quantizer configs, the codec interface, and the one registry that maps a config to its codec.

A *quantizer* is a small frozen dataclass: the settings of one format, with value equality and no
state. A *codec* is the stateless code that turns a 2-D fp32 tensor into the payload of one
direction and back. Everything outside ``dtq/formats`` reaches format-specific behaviour only
through :func:`codec_for`, so a new format is one new file here.

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

import dataclasses
from typing import TYPE_CHECKING, ClassVar, Mapping

import torch

if TYPE_CHECKING:
    from dtq.kernels import KernelSpec
    from dtq.tensor import QuantizedTensor

ROWWISE = "rowwise"
COLUMNWISE = "columnwise"
DIRECTIONS = (ROWWISE, COLUMNWISE)

Payload = dict  # dict[str, torch.Tensor]: the plain tensors of one direction


def check_direction(direction: str) -> str:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'rowwise' or 'columnwise', got {direction!r}")
    return direction


class Codec:
    """Format-specific behaviour of one direction. All methods are classmethods taking the
    (non-hybrid) quantizer config ``q``."""

    name: ClassVar[str]  # short format name used in byte counters: fp8, fp8_block, mxfp8, ...

    @classmethod
    def fields(cls, q, direction: str) -> dict[str, int | None]:
        raise NotImplementedError

    @classmethod
    def tile(cls, q, direction: str, shape: tuple[int, int]) -> tuple[int, int] | None:
        """The (rows, cols) block sharing one scale in ``direction`` of a [M, K] tensor; None when
        there are no blocks (one scale per tensor, or none)."""
        return None

    @classmethod
    def check_shape(cls, q, shape: tuple[int, int], direction: str) -> None:
        """Raise ValueError if this direction cannot represent a [M, K] tensor."""

    @classmethod
    def needs_amax(cls, q, direction: str) -> bool:
        """Whether the direction depends on an amax taken over every row (reduced across ranks when
        the rows are sharded): one tensor-wide value, or one per column (``amax_shape``)."""
        return False

    @classmethod
    def amax_shape(cls, q, direction: str, shape: tuple[int, int]) -> tuple[int, ...]:
        """Shape of that amax for a [M, K] tensor: ``()`` tensor-wide (reduced over shards of
        either dim), ``(1, K)`` per column (reduced over dim-0 shards only)."""
        return ()

    @classmethod
    def local_amax(cls, q, x: torch.Tensor, direction: str) -> torch.Tensor:
        return x.abs().amax().to(torch.float32) if x.numel() else torch.zeros((), device=x.device)

    @classmethod
    def scales_from_block_amax(cls, q, direction: str) -> bool:
        """Whether each block scale is a function of the block's amax (and the tensor-wide, row or
        column amax) alone: a flat-slice master cast fills the elements it does not own with their
        block amax and relies on this."""
        return True

    @classmethod
    def column_shardable(cls, q, direction: str) -> bool:
        """Whether a shard of the last dim (a row-parallel weight under tensor parallelism) can hold
        this direction as the slice of the whole tensor's payload."""
        return True

    @classmethod
    def uses_rng(cls, q, direction: str) -> bool:
        return False

    @classmethod
    def quantize(cls, q, x: torch.Tensor, direction: str, amax: torch.Tensor | None,
                 seed: torch.Tensor | None) -> Payload:
        """``x`` is [M, K] contiguous in the caller's dtype (codecs compute in fp32). ``amax`` is
        given iff ``needs_amax``; ``seed`` iff ``uses_rng``."""
        raise NotImplementedError

    @classmethod
    def dequantize(cls, q, payload: Payload, direction: str, shape: tuple[int, int]) -> torch.Tensor:
        """Back to [M, K] fp32 in the input's value space."""
        raise NotImplementedError

    @classmethod
    def dequantize_factored(cls, q, payload: Payload, direction: str, shape: tuple[int, int],
                            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(values, factor)`` with ``values * factor ~= dequantize(...)``: the per-tensor factor
        (0-dim; or [M, 1] / [1, K] per row / column, constant along the direction's blocks, so along
        the GEMM's output dims) is split off so an emulated GEMM applies it after the product, as
        native scaled GEMMs do.
        ``values`` come in ``dtype`` (a kernel writes them directly where it can); GEMMs only read
        them, and a passthrough format may hand out its stored tensor."""
        out = cls.kernel_dequantize(q, payload, direction, shape, dtype=dtype)
        return (out if out is not None else cls.dequantize(q, payload, direction, shape).to(dtype)), None

    @classmethod
    def empty(cls, q, shape: tuple[int, int], direction: str, device: torch.device,
              dtype: torch.dtype) -> Payload:
        """Zero-filled payload of the right layout (dequantizes to zeros); draws no random numbers."""
        raise NotImplementedError

    @classmethod
    def identical_directions(cls, q) -> bool:
        """Whether both directions' payloads are bitwise the same (one scale per tensor, square
        tiles, passthrough): then either direction is the other, and only one needs moving."""
        return False

    @classmethod
    def derive(cls, q, payload: Payload, src: str, dst: str) -> Payload | None:
        """The ``dst`` payload computed exactly from the ``src`` one, or None if that loses bits."""
        return {k: v.clone() for k, v in payload.items()} if cls.identical_directions(q) else None

    @classmethod
    def amax_space(cls, q, direction: str) -> str:
        """What the direction's tensor-wide amax is taken over: "x", or a transform of x."""
        return "x"

    @classmethod
    def reusable_amax(cls, q, payload: Payload, src: str, dst: str) -> torch.Tensor | None:
        """The tensor-wide amax held in a ``src`` payload if ``dst`` needs that same value, else None."""
        if "amax" in payload and cls.amax_space(q, src) == cls.amax_space(q, dst):
            return payload["amax"]
        return None

    @classmethod
    def exact_dtype(cls, q, payload: Payload, direction: str, rotated: bool = False) -> torch.dtype:
        """The narrowest of bfloat16 / float32 holding the values of ``dequantize_factored`` (or of
        ``dequantize_rotated`` when ``rotated``) exactly: an emulated GEMM may feed such values to
        BF16 tensor cores (with fp32 accumulation) without changing a single product. (Values below
        bf16's normal range, 2^-126, keep fewer bits there than in fp32: only blocks whose amax is
        below ~1e-34 can have them, and their products vanish next to any normal value.)"""
        return torch.float32

    @classmethod
    def rotation(cls, q, direction: str):
        """A hashable name of the orthogonal transform ``T`` over rows that the payload holds its
        values in (NVFP4's random Hadamard), or None. Two operands with the same rotation along
        their contraction dim have the product of the unrotated ones: ``(T a)^T (T b) = a^T b``."""
        return None

    @classmethod
    def dequantize_rotated(cls, q, payload: Payload, direction: str, shape: tuple[int, int],
                           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``dequantize_factored`` without undoing ``rotation``."""
        return cls.dequantize_factored(q, payload, direction, shape, dtype)

    @classmethod
    def lossless(cls, q, dtype: torch.dtype) -> bool:
        """Whether dequantizing gives back a ``dtype`` input exactly (only passthrough formats)."""
        return False

    @classmethod
    def kernel_spec(cls, q, direction: str, shape: tuple[int, int], dtype: torch.dtype) -> "KernelSpec | None":
        """How the fused CUDA kernel (``dtq.kernels``) produces this direction of a [M, K] ``dtype``
        input, or None: no kernel for it, the reference runs (on any device)."""
        return None

    @classmethod
    def kernel_dequantize(cls, q, payload: Payload, direction: str, shape: tuple[int, int],
                          factored: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """``dequantize`` (or the values of ``dequantize_factored``) by a CUDA kernel, or None when
        the payload is not on a GPU with kernels, or the format has none."""
        data = payload.get("data")
        if data is None or not data.is_cuda:
            return None
        spec = cls.kernel_spec(q, direction, shape, torch.float32)
        if spec is None:
            return None
        from dtq import kernels

        return kernels.dequantize(spec, payload, shape, factored, dtype)


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


def codec_for(q: "Quantizer") -> type[Codec]:
    try:
        return _REGISTRY[type(q)]
    except KeyError:
        raise TypeError(f"{type(q).__name__} has no registered codec (is it a plain format quantizer?)") from None


def registered_quantizers() -> tuple[type, ...]:
    return tuple(_REGISTRY)


def quantizer_names() -> str:
    """The registered quantizer classes, for error messages ("Float8Quantizer, ...")."""
    return ", ".join(c.__name__ for c in _REGISTRY)


@dataclasses.dataclass(frozen=True)
class Quantizer:
    """Base of every quantizer config. Subclasses are frozen dataclasses validated in ``__post_init__``."""

    def for_direction(self, direction: str) -> "Quantizer":
        """The plain quantizer that produces ``direction`` (itself, except for a hybrid)."""
        check_direction(direction)
        return self

    @property
    def format_name(self) -> str:
        return codec_for(self).name

    def block_rows(self, direction: str) -> int:
        """Dim-0 alignment of ``direction``: a dim-0 slice must start (and end, unless at the end)
        on a multiple of this."""
        sub = self.for_direction(direction)
        return max((r for r in codec_for(sub).fields(sub, direction).values() if r), default=1)

    def aliases(self, directions: tuple[str, ...]) -> dict[str, str]:
        """Of ``directions``, those whose payload is bitwise an earlier one's (per-tensor FP8,
        square tiles, passthrough), mapped to it: only the others need moving or storing."""
        out: dict[str, str] = {}
        for i, d in enumerate(directions):
            sub = self.for_direction(d)
            for src in directions[:i]:
                if src not in out and self.for_direction(src) == sub and codec_for(sub).identical_directions(sub):
                    out[d] = src
                    break
        return out

    def local_amax(self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True) -> dict[str, torch.Tensor]:
        """The amax each requested direction needs (``Codec.needs_amax``: tensor-wide, or one per
        column), computed on this (local) tensor. Reduce the values with MAX across the ranks that
        hold other rows and pass them to ``quantize(amax=...)`` so that shards quantize as slices
        of the whole."""
        x2 = _as_2d(x, self)
        out = {}
        for d in _wanted(rowwise, columnwise):
            sub = self.for_direction(d)
            codec = codec_for(sub)
            if codec.needs_amax(sub, d):
                codec.check_shape(sub, tuple(x2.shape), d)
                out[d] = codec.local_amax(sub, x2, d)
        return out

    def quantize(self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True,
                 amax: Mapping[str, torch.Tensor] | torch.Tensor | None = None,
                 seed: int | torch.Tensor | None = None) -> "QuantizedTensor":
        """Quantize a high-precision tensor into the requested directions.

        ``amax`` overrides the tensor-wide amax (a tensor for every direction that needs one, or a
        ``{direction: tensor}`` mapping, e.g. the all-reduced result of :meth:`local_amax`).
        ``seed`` fixes stochastic rounding; by default one seed is drawn from torch's generator
        of the input's device, so activation recompute (which restores RNG state) replays it.
        """
        from dtq.tensor import QuantizedTensor

        payloads = quantize_payloads(self, x, _wanted(rowwise, columnwise), amax=amax, seed=seed)
        return QuantizedTensor(x.shape, x.dtype, self, payloads, requires_grad=False)

    def quantize_data(self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True,
                      amax: Mapping[str, torch.Tensor] | torch.Tensor | None = None,
                      seed: int | torch.Tensor | None = None) -> QuantizedData:
        """:meth:`quantize` for dtq's own GEMM path: the same payloads, as a :class:`QuantizedData`."""
        payloads = quantize_payloads(self, x, _wanted(rowwise, columnwise), amax=amax, seed=seed)
        return QuantizedData(x.shape, x.dtype, self, payloads, device=x.device)


def dequantize_payload(quantizer: Quantizer, payloads: dict[str, Payload], shape2d: tuple[int, int], shape,
                       dtype: torch.dtype, direction: str | None) -> torch.Tensor:
    """High-precision values of one direction (rowwise if present and ``direction`` is None) of the
    [M, K] matrix ``shape2d`` that ``payloads`` describe, viewed as ``shape``."""
    if direction is None:
        direction = ROWWISE if ROWWISE in payloads else COLUMNWISE
    if direction not in payloads:
        check_direction(direction)
        raise KeyError(f"this QuantizedTensor ({quantizer.format_name}) has no {direction} payload; "
                       f"it holds {list(payloads)}. Build it with update_usage({direction}=True, source=...)")
    sub = quantizer.for_direction(direction)
    with torch.no_grad():
        out = codec_for(sub).dequantize(sub, payloads[direction], direction, shape2d)
    return out.reshape(shape).to(dtype)


class QuantizedData:
    """A quantized value's payloads and quantizer without the ``torch.Tensor`` wrapper: what dtq's
    GEMM path passes from a quantization to its GEMMs and saves for backward (as payload tensors).
    It reads like a ``dtq.QuantizedTensor`` (``quantizer``, ``payload``, ``directions``,
    ``shape2d``, ``dequantize``) but costs no tensor-subclass construction, which on the host is
    a large part of a small GEMM's time. Internal: never handed to users."""

    __slots__ = ("_quantizer", "_payloads", "shape", "dtype", "_shape2d", "device")

    def __init__(self, shape, dtype: torch.dtype, quantizer: "Quantizer", payloads: dict[str, Payload],
                 shape2d: tuple[int, int] | None = None, device: torch.device | None = None):
        self.shape, self.dtype, self._quantizer, self._payloads = shape, dtype, quantizer, payloads
        self._shape2d = shape2d if shape2d is not None else shape_2d(shape)
        self.device = device if device is not None else next(iter(next(iter(payloads.values())).values())).device

    @property
    def quantizer(self) -> "Quantizer":
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
        return dequantize_payload(self._quantizer, self._payloads, self._shape2d, self.shape, dtype or self.dtype,
                                  direction)

    def with_directions(self, *directions: str) -> "QuantizedData":
        return QuantizedData(self.shape, self.dtype, self._quantizer, {d: self._payloads[d] for d in directions},
                             self._shape2d, self.device)

    def __repr__(self) -> str:
        return (f"QuantizedData(shape={list(self.shape)}, quantizer={self._quantizer!r}, "
                f"directions={list(self._payloads)})")


def _wanted(rowwise: bool, columnwise: bool) -> tuple[str, ...]:
    if rowwise:
        return DIRECTIONS if columnwise else (ROWWISE,)
    if columnwise:
        return (COLUMNWISE,)
    raise ValueError("quantize needs at least one of rowwise=True / columnwise=True")


def _as_2d(x: torch.Tensor, q: Quantizer) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{type(q).__name__}.quantize expects a floating-point torch.Tensor, got "
                        f"{getattr(x, 'dtype', type(x))}")
    if type(x) is not torch.Tensor and hasattr(x, "dequantize") and hasattr(x, "_payloads"):
        raise TypeError(f"{type(q).__name__}.quantize got a QuantizedTensor; call .dequantize() first "
                        "or use copy_() to requantize into an existing one")
    if x.dim() == 0:
        raise ValueError(f"{type(q).__name__} cannot quantize a 0-dim tensor; give it at least one dimension")
    if hasattr(x, "__dtq_unwrap__"):
        x = x.__dtq_unwrap__()  # a wrapper around high-precision data (dtq.parallel.HighPrecisionWeight)
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
    beyond its values, decided once per (quantizer, directions, shape, dtype, device): the plain
    quantizer of each direction, the directions that share another's payload, the amaxes to
    compute, and the prepared CUDA kernel launch (:class:`dtq.kernels.QuantizeLaunch`) where one
    applies. Every call then does only the work (the hot path of every GEMM)."""

    __slots__ = ("q", "subs", "twins", "own", "uses_rng", "amax_spaces", "needs_amax", "launch", "reference",
                 "torch_amax")

    def __init__(self, q: Quantizer, directions: tuple[str, ...], shape: tuple[int, int], dtype: torch.dtype,
                 device: torch.device):
        self.q = q
        self.subs = {d: q.for_direction(d) for d in directions}
        for d, sub in self.subs.items():
            codec_for(sub).check_shape(sub, shape, d)  # raises on every call with a bad shape: never cached
        self.twins = q.aliases(tuple(self.subs))
        self.own = tuple(d for d in self.subs if d not in self.twins)
        codecs = {d: codec_for(self.subs[d]) for d in self.own}
        self.uses_rng = any(c.uses_rng(self.subs[d], d) for d, c in codecs.items())
        self.needs_amax = {d: c.needs_amax(self.subs[d], d) for d, c in codecs.items()}
        self.amax_spaces = frozenset(codecs[d].amax_space(self.subs[d], d) for d in self.own if self.needs_amax[d])
        self.launch, self.reference, self.torch_amax = None, self.own, ()
        if device.type == "cuda" and shape[0] * shape[1] > 0:
            from dtq import kernels

            if dtype in kernels.INPUT_DTYPES and kernels.available(device):
                specs = {d: s for d in self.own
                         if (s := codecs[d].kernel_spec(self.subs[d], d, shape, dtype)) is not None}
                if specs:
                    tensor_amax = tuple(d for d in specs if self.needs_amax[d] and not specs[d].amax_vector)
                    self.launch = kernels.QuantizeLaunch(specs, tensor_amax)
                    self.reference = tuple(d for d in self.own if d not in specs)
                    # per-column amaxes of T x: no kernel pass computes them; the reference's ops do
                    self.torch_amax = tuple(d for d, s in specs.items() if s.amax_vector and s.amax_space == "hadamard")

    def __call__(self, xc: torch.Tensor, given: dict[str, torch.Tensor], seed) -> dict[str, Payload]:
        """Payloads of the contiguous [M, K] ``xc``; ``given``: amaxes of own directions (checked
        shapes, fp32 on xc's device), ``seed``: a tensor when ``uses_rng``."""
        out, reference = {}, self.reference
        if self.launch is not None:
            for d in self.torch_amax:
                if d not in given:
                    given = {**given, d: codec_for(self.subs[d]).local_amax(self.subs[d], xc, d)}
            out = self.launch(xc, given, seed)
            if out is None:  # the generic kernel lacks an option of this quantizer: nothing launched
                _warn_reference(self.q)
                out, reference = {}, self.own
        for d in reference:
            sub = self.subs[d]
            codec = codec_for(sub)
            a = None
            if self.needs_amax[d]:
                a = given[d] if d in given else codec.local_amax(sub, xc, d).to(device=xc.device, dtype=torch.float32)
            out[d] = codec.quantize(sub, xc, d, a, seed if codec.uses_rng(sub, d) else None)
        if self.twins:
            return {d: dict(out[self.twins[d]]) if d in self.twins else out[d] for d in self.subs}
        return out if len(out) == 1 or self.own == tuple(out) else {d: out[d] for d in self.own}


def _warn_reference(q: Quantizer) -> None:
    from dtq._warn import warn_once

    warn_once(f"generic-kernel {q!r}", f"{q!r}: the generic quantize kernel (this slot pair has no specialised "
              "kernel, or the input is not 16-byte aligned) lacks an option of this quantizer; the PyTorch "
              "reference runs instead (same bits, slower)")


_plans: dict = {}


def quantize_plan(q: Quantizer, directions: tuple[str, ...], shape: tuple[int, int], dtype: torch.dtype,
                  device: torch.device) -> QuantizePlan:
    """The (cached) plan of quantizing a [M, K] ``dtype`` tensor on ``device`` into ``directions``."""
    if device.type == "cuda":  # whether the kernels run depends on DTQ_DISABLE_KERNELS (tests flip it)
        from dtq import kernels

        key = (q, directions, shape, dtype, device, kernels.disabled_token())
    else:
        key = (q, directions, shape, dtype, device)
    plan = _plans.get(key)
    if plan is None:
        plan = QuantizePlan(q, directions, shape, dtype, device)
        if len(_plans) > 4096:
            _plans.clear()
        _plans[key] = plan
    return plan


def quantize_payloads(q: Quantizer, x: torch.Tensor, directions: tuple[str, ...],
                      amax=None, seed=None) -> dict[str, Payload]:
    """Payloads of ``directions`` for ``x`` (the engine behind ``Quantizer.quantize``)."""
    x2 = _as_2d(x, q)
    xc = x2.contiguous()
    plan = quantize_plan(q, tuple(directions), tuple(xc.shape), xc.dtype, xc.device)
    return plan(xc, _given_amaxes(q, plan, amax, tuple(xc.shape), xc.device) if amax is not None else {},
                _seed(seed, x) if plan.uses_rng else None)


def _seed(seed, x: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding's seed: drawn from torch's generator of the input's device unless given
    (activation recompute restores that RNG state, so it replays the same seed)."""
    if seed is None:
        gen_device = x.device if x.device.type != "meta" else torch.device("cpu")
        return torch.randint(0, 2**31 - 1, (), device=gen_device, dtype=torch.int64)
    return seed if isinstance(seed, torch.Tensor) else torch.tensor(int(seed), dtype=torch.int64)


def _given_amaxes(q: Quantizer, plan: QuantizePlan, amax, shape: tuple[int, int], device) -> dict[str, torch.Tensor]:
    if isinstance(amax, torch.Tensor) and len(plan.amax_spaces) > 1:
        raise ValueError(f"{type(q).__name__}.quantize: one amax tensor was given, but its directions take their "
                         f"amax over different values ({sorted(plan.amax_spaces)}, e.g. the random-Hadamard columnwise "
                         "direction needs max|T x|); pass amax={direction: tensor}, as local_amax() returns")
    given = {}
    for d in plan.own:
        if plan.needs_amax[d]:
            a = amax if isinstance(amax, torch.Tensor) else amax.get(d)
            if a is not None:
                given[d] = _given_amax(q, plan.subs[d], d, a, shape).to(device=device, dtype=torch.float32)
    return given


def _given_amax(q: Quantizer, sub: Quantizer, direction: str, a: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    want = codec_for(sub).amax_shape(sub, direction, shape)
    if a.numel() != torch.Size(want).numel():
        raise ValueError(f"{type(q).__name__}.quantize: the {direction} amax has shape {list(a.shape)}, but a tensor "
                         f"viewed as [M, K] = {list(shape)} needs {list(want) or 'one value (0-dim)'} for "
                         f"{type(sub).__name__}; pass what local_amax() returns for this tensor, MAX-reduced "
                         "over the ranks that hold its other rows")
    return a.reshape(want)


def shape_error(q: Quantizer, shape: tuple[int, int], direction: str, requirement: str) -> ValueError:
    e = ValueError(
        f"{type(q).__name__} ({direction}) cannot quantize a tensor viewed as [M, K] = {list(shape)}: "
        f"{requirement}. Pad the tensor, choose a shape that meets this, or use another format for "
        f"this tensor (e.g. Float8BlockQuantizer allows partial blocks)."
    )
    e.requirement = f"{q.format_name} {direction}: {requirement}"  # the short form (dtq.shapes reports)
    return e
