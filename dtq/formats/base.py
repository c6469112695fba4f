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
        """``(values, factor)`` with ``values * factor ~= dequantize(...)``: the per-tensor factor is
        split off so an emulated GEMM applies it after the product, as native scaled GEMMs do.
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


def _wanted(rowwise: bool, columnwise: bool) -> tuple[str, ...]:
    dirs = tuple(d for d, on in zip(DIRECTIONS, (rowwise, columnwise)) if on)
    if not dirs:
        raise ValueError("quantize needs at least one of rowwise=True / columnwise=True")
    return dirs


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


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What quantizing a [M, K] tensor into some directions needs to know beyond its values:
    decided once per (quantizer, directions, shape), since the hot path runs every step."""

    subs: dict  # direction -> the plain quantizer producing it
    twins: dict  # direction -> the earlier direction whose payload it shares
    own: tuple  # the directions computed (not twins)
    uses_rng: bool
    amax_spaces: frozenset  # spaces of the tensor-wide amaxes the own directions need


_plans: dict = {}
_kernel_plans: dict = {}


def _plan(q: Quantizer, directions: tuple[str, ...], shape: tuple[int, int]) -> _Plan:
    key = (q, directions, shape)
    plan = _plans.get(key)
    if plan is None:
        subs = {d: q.for_direction(d) for d in directions}
        for d, sub in subs.items():
            codec_for(sub).check_shape(sub, shape, d)  # raises on every call with a bad shape: never cached
        twins = q.aliases(tuple(subs))
        plan = _Plan(subs, twins, tuple(d for d in subs if d not in twins),
                     any(codec_for(s).uses_rng(s, d) for d, s in subs.items()),
                     frozenset(codec_for(s).amax_space(s, d) for d, s in subs.items() if codec_for(s).needs_amax(s, d)))
        if len(_plans) > 4096:
            _plans.clear()
        _plans[key] = plan
    return plan


def quantize_payloads(q: Quantizer, x: torch.Tensor, directions: tuple[str, ...],
                      amax=None, seed=None) -> dict[str, Payload]:
    """Payloads of ``directions`` for ``x`` (the engine behind ``Quantizer.quantize``)."""
    x2 = _as_2d(x, q)
    shape = tuple(x2.shape)
    plan = _plan(q, tuple(directions), shape)
    subs = plan.subs
    if plan.uses_rng:
        if seed is None:
            gen_device = x.device if x.device.type != "meta" else torch.device("cpu")
            seed = torch.randint(0, 2**31 - 1, (), device=gen_device, dtype=torch.int64)
        elif not isinstance(seed, torch.Tensor):
            seed = torch.tensor(int(seed), dtype=torch.int64)
    xc = x2.contiguous()
    if isinstance(amax, torch.Tensor) and len(plan.amax_spaces) > 1:
        raise ValueError(f"{type(q).__name__}.quantize: one amax tensor was given, but its directions take their "
                         f"amax over different values ({sorted(plan.amax_spaces)}, e.g. the random-Hadamard columnwise "
                         "direction needs max|T x|); pass amax={direction: tensor}, as local_amax() returns")
    twins, own = plan.twins, plan.own
    given = {}
    if amax is not None:
        for d in own:
            sub = subs[d]
            if codec_for(sub).needs_amax(sub, d):
                a = amax if isinstance(amax, torch.Tensor) else amax.get(d)
                if a is not None:
                    given[d] = _given_amax(q, sub, d, a, shape).to(device=xc.device, dtype=torch.float32)
    out = _kernel_payloads(q, plan, xc, given, seed)
    for d in own:
        if d in out:
            continue
        sub = subs[d]
        codec = codec_for(sub)
        a = None
        if codec.needs_amax(sub, d):
            a = given[d] if d in given else codec.local_amax(sub, xc, d).to(device=xc.device, dtype=torch.float32)
        out[d] = codec.quantize(sub, xc, d, a, seed if codec.uses_rng(sub, d) else None)
    return {d: dict(out[twins[d]]) if d in twins else out[d] for d in subs}


def _given_amax(q: Quantizer, sub: Quantizer, direction: str, a: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    want = codec_for(sub).amax_shape(sub, direction, shape)
    if a.numel() != torch.Size(want).numel():
        raise ValueError(f"{type(q).__name__}.quantize: the {direction} amax has shape {list(a.shape)}, but a tensor "
                         f"viewed as [M, K] = {list(shape)} needs {list(want) or 'one value (0-dim)'} for "
                         f"{type(sub).__name__}; pass what local_amax() returns for this tensor, MAX-reduced "
                         "over the ranks that hold its other rows")
    return a.reshape(want)


def _kernel_specs(q: Quantizer, plan: _Plan, shape: tuple[int, int], dtype: torch.dtype) -> tuple:
    """``(specs, todo, vectors)`` of the fused kernel for the own directions: their KernelSpecs,
    the directions needing a tensor-wide amax pass first, and those reading per-row / per-column
    amaxes; decided once per quantizer, directions, shape and dtype."""
    key = (q, plan.own, shape, dtype)
    found = _kernel_plans.get(key)
    if found is None:
        specs = {}
        for d in plan.own:
            spec = codec_for(plan.subs[d]).kernel_spec(plan.subs[d], d, shape, dtype)
            if spec is not None:
                specs[d] = spec
        vectors = {d: specs[d].amax_vector for d in specs if specs[d].amax_vector}
        todo = tuple(d for d in specs if codec_for(plan.subs[d]).needs_amax(plan.subs[d], d) and d not in vectors)
        found = (specs, todo, vectors)
        if len(_kernel_plans) > 4096:
            _kernel_plans.clear()
        _kernel_plans[key] = found
    return found


def _kernel_payloads(q: Quantizer, plan: _Plan, xc: torch.Tensor, given: dict[str, torch.Tensor],
                     seed) -> dict[str, Payload]:
    """The payloads the CUDA kernels produce (one read of ``xc`` for all of them; a tensor-wide
    amax pass first where a direction needs one and none was given); {} where they don't apply."""
    if not xc.is_cuda or xc.numel() == 0:
        return {}
    from dtq import kernels

    if xc.dtype not in kernels.INPUT_DTYPES or not kernels.available(xc.device):
        return {}
    specs, todo, vectors = _kernel_specs(q, plan, tuple(xc.shape), xc.dtype)
    if not specs:
        return {}
    amaxes = dict(given)
    todo = [d for d in todo if d not in given]
    if todo:
        signs = {specs[d].hadamard_signs for d in todo if specs[d].amax_space == "hadamard"}
        want_x = any(specs[d].amax_space == "x" for d in todo)
        ax, ah = kernels.amax(xc, want_x, next(iter(signs)) if signs else None)
        for d in todo:
            amaxes[d] = ah if specs[d].amax_space == "hadamard" else ax
    missing = {v for d, v in vectors.items() if d not in given}
    if missing:  # one read for every per-row / per-column amax not given
        rows, cols = kernels.axis_amax(xc, "rows" in missing, "cols" in missing)
        amaxes.update({d: rows if v == "rows" else cols for d, v in vectors.items() if d not in given})
    for d in vectors:
        amaxes[d] = amaxes[d].reshape(-1).contiguous()
    return kernels.quantize(xc, specs, amaxes, seed)


def shape_error(q: Quantizer, shape: tuple[int, int], direction: str, requirement: str) -> ValueError:
    e = ValueError(
        f"{type(q).__name__} ({direction}) cannot quantize a tensor viewed as [M, K] = {list(shape)}: "
        f"{requirement}. Pad the tensor, choose a shape that meets this, or use another format for "
        f"this tensor (e.g. Float8BlockQuantizer allows partial blocks)."
    )
    e.requirement = f"{q.format_name} {direction}: {requirement}"  # the short form (dtq.shapes reports)
    return e
