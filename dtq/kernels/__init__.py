"""CUDA kernels for quantize / dequantize (sources in ``csrc/``), built on first GPU use.

The pure-PyTorch references in ``dtq/formats`` define the bits; the kernels reproduce them exactly
and are only a faster path. They are used when the input is a CUDA tensor on an sm_90+ device
and the extension builds; otherwise (CPU, no nvcc, a build error, or ``DTQ_DISABLE_KERNELS=1``)
everything runs the references. Nothing here compiles at import time.

Build: ``torch.utils.cpp_extension.load`` (ninja) into ``$DTQ_KERNEL_BUILD_DIR`` or
``~/.cache/dtq/kernels/<python-torch-cuda>``, saying so on stderr when it compiles (about a minute);
``python -m dtq.kernels build`` (``dtq/kernels/__main__.py``) does it ahead of time.
``$DTQ_KERNEL_LIBRARY`` names a library built elsewhere (same Python, torch and CUDA): it is
imported as it is, with no build step, for machines without ``nvcc`` or time to build.

Formats reach the kernels only through ``Codec.kernel_spec`` (one :class:`KernelSpec` per
direction): the fused kernel reads the input once and writes up to two directions' payloads.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from dtq._library import define

# Slot kinds of the fused kernel (csrc/common.cuh SlotKind). FP8_ROW: one FP8 scale per whole row
# (block (1, 0)) or whole column ((0, 1)), from an amax vector computed before the launch.
# FP8_SCALED_T: per-tensor FP8 codes written transposed ([K, M]), beside the same FP8_SCALED slot.
NONE, FP8_SCALED, MXFP8, NVFP4, IDENTITY, FP8_ROW, FP8_SCALED_T = 0, 1, 2, 3, 4, 5, 6
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
E4M3_MAX_CODE = 0x7E  # the E4M3 byte of 448
_CONFIG_LEN = 14  # ints per slot config (csrc/quantize.cu make_cfg)
INPUT_DTYPES = tuple(_DTYPE_CODE)

# The repository's csrc/ (a checkout or an editable install), else the copy a wheel carries.
_PACKAGE = Path(__file__).resolve().parents[1]  # dtq/
CSRC = next((d for d in (_PACKAGE.parent / "csrc", _PACKAGE / "_csrc") if d.is_dir()), _PACKAGE / "_csrc")
SOURCES = (
    "bindings.cpp",
    "quantize.cu",
    "quantize_fast_bf16.cu",
    "quantize_fast_f16.cu",
    "quantize_fast_f32.cu",
    "amax.cu",
    "dequantize.cu",
    "transpose.cu",
    "swiglu.cu",
    "epilogue.cu",
    "pack.cu",
    "quantize_alloc.cpp",
    "ops.cpp",
    "linear.cpp",
)
# fp32 arithmetic must stay exactly the references': no FMA contraction, no fast math. No -std:
# torch's extension builder adds the standard its headers need (C++17 on torch 2.11, C++20 on 2.13
# and later; torch 2.15's headers do not compile as C++17).
CUDA_FLAGS = ("-O3", "-fmad=false", "-gencode=arch=compute_90,code=[sm_90,compute_90]")
CXX_FLAGS = ("-O3",)

_lock = threading.Lock()
_ext = None
_error: str | None = None


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """What the fused kernel must produce for one direction.

    ``fields``: the payload tensors the kernel writes, in the order its kind takes them
    (data, then block scales, then the per-tensor value), as ``(name, shape, dtype)``.
    ``block``: rows x cols sharing one scale; ``(0, 0)`` for one scale per tensor; a 0 beside a 1
    spans that whole dim (FP8_ROW: ``(1, 0)`` one scale per row, ``(0, 1)`` one per column).
    ``hadamard_signs``: for NVFP4 columnwise with the random Hadamard, bit j set iff sign j is -1.
    ``amax_vector``: ``"rows"`` / ``"cols"`` where the kernel reads one amax per row ([M]) / per
    column ([K]) that the caller computes (``axis_amax``, or the codec's ``local_amax`` in the
    Hadamard space) or was given.
    NVFP4 options: ``row_scaled`` (S_enc per row / column from that vector, which the kernel also
    stores as the ``amax`` field), ``four_over_six`` (0 off, 1 "mae", 2 "mse"), ``e4m3_max`` (the
    E4M3 byte of the bound in S_enc; 0x7E is 448).
    """

    kind: int
    block: tuple[int, int]
    fields: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    e5m2: bool = False
    pow2: bool = False
    floor: bool = False
    stochastic: bool = False
    stream: int = 0
    hadamard_signs: int | None = None
    out_dtype: torch.dtype | None = None
    amax_vector: str | None = None
    row_scaled: bool = False
    four_over_six: int = 0
    e4m3_max: int = E4M3_MAX_CODE

    @functools.cached_property
    def _config(self) -> tuple[int, ...]:  # asked at every launch: computed once per spec
        return (
            self.kind,
            self.block[0],
            self.block[1],
            int(self.e5m2),
            int(self.pow2),
            int(self.floor),
            int(self.stochastic),
            self.stream,
            int(self.hadamard_signs is not None),
            self.hadamard_signs or 0,
            _DTYPE_CODE.get(self.out_dtype, 0),
            int(self.row_scaled),
            self.four_over_six,
            self.e4m3_max,
        )

    def config(self) -> list[int]:
        return list(self._config)

    @property
    def amax_space(self) -> str:
        return "hadamard" if self.hadamard_signs is not None else "x"


def signs_mask(signs: torch.Tensor) -> int:
    """The +-1 Hadamard diagonal as the kernels' bit mask (bit j set: sign j is -1)."""
    return sum(1 << j for j, s in enumerate(signs.tolist()) if s < 0)


def build_dir() -> Path:
    env = os.environ.get("DTQ_KERNEL_BUILD_DIR")
    if env:
        return Path(env)
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}-cuda{torch.version.cuda}"
    return Path.home() / ".cache" / "dtq" / "kernels" / tag.replace("+", "_")


_DISABLE_VAR = "DTQ_DISABLE_KERNELS"
# os.environ keeps the process environment in a plain dict of encoded keys and values (and its
# setters update it): read there, the setting costs one dict lookup instead of os.environ's
# Python-level encode / decode. It is read on every quantize and GEMM.
_ENV_KEY = os.environ.encodekey(_DISABLE_VAR) if hasattr(os.environ, "encodekey") else None


def disabled_token() -> object:
    """The ``DTQ_DISABLE_KERNELS`` setting as it is now (compared only: caches of kernel
    decisions key on it)."""
    data = getattr(os.environ, "_data", None)
    if _ENV_KEY is not None and data is not None:
        return data.get(_ENV_KEY)
    return os.environ.get(_DISABLE_VAR)


def disabled() -> bool:
    return os.environ.get(_DISABLE_VAR, "").strip().lower() not in ("", "0", "false", "no")


_LIBRARY_VAR = "DTQ_KERNEL_LIBRARY"


def _import_library(path: str):
    """Import a prebuilt ``dtq_kernels`` library from ``path``: no sources, no compiler, no ninja."""
    import importlib.util

    file = Path(path)
    if not file.is_file():
        raise RuntimeError(
            f"{_LIBRARY_VAR}={path}: no such file; name a dtq_kernels*.so built by "
            f"`python -m dtq.kernels build` for this Python, torch and CUDA, or unset it to build here"
        )
    spec = importlib.util.spec_from_file_location("dtq_kernels", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(verbose: bool = False):
    prebuilt = os.environ.get(_LIBRARY_VAR)
    if prebuilt:
        return _import_library(prebuilt)
    from torch.utils.cpp_extension import load

    missing = [s for s in SOURCES if not (CSRC / s).is_file()]
    if missing:
        raise RuntimeError(
            f"CUDA sources not found in {CSRC} (missing {missing}): reinstall dtq from a "
            "checkout or a wheel built by its setup.py, which copies csrc/ into dtq/_csrc"
        )
    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    return load(
        name="dtq_kernels",
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=list(CXX_FLAGS),
        extra_cuda_cflags=list(CUDA_FLAGS),
        build_directory=str(d),
        verbose=verbose,
    )


def _needs_build() -> bool:
    """Whether loading will compile: no library in the build directory yet, or one older than a
    source (torch's loader then rebuilds)."""
    if os.environ.get(_LIBRARY_VAR):
        return False
    built = [p.stat().st_mtime for p in build_dir().glob("dtq_kernels*.so")]
    sources = [p.stat().st_mtime for p in CSRC.glob("*") if p.suffix in (".cu", ".cuh", ".cpp", ".h")]
    return not built or max(built) < max(sources, default=0.0)


def _say(message: str) -> None:
    """Build progress on stderr: from rank 0 only once a process group is up (every rank of a node
    waits on the same build)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(f"dtq: {message}", file=sys.stderr, flush=True)


def _load_announced(verbose: bool):
    """:func:`_load`, saying before and after when it compiles: the first GPU use would otherwise
    look hung for about a minute."""
    if not _needs_build():
        return _load(verbose)
    _say(
        f"compiling the CUDA kernels into {build_dir()} (once per Python, torch and CUDA version; about a "
        "minute). `python -m dtq.kernels build` does this ahead of time."
    )
    start = time.perf_counter()
    ext = _load(verbose)
    _say(f"CUDA kernels built in {time.perf_counter() - start:.0f} s")
    return ext


def extension(verbose: bool = False):
    """The built extension module, or None after a (once-warned) build failure."""
    global _ext, _error
    if _ext is not None or _error is not None:
        return _ext
    with _lock:
        if _ext is None and _error is None:
            try:
                _ext = _load_announced(verbose)
            except Exception as e:  # noqa: BLE001 - any build/import failure means "use the references"
                _error = f"{type(e).__name__}: {e}"
                head = "\n".join(str(e).strip().splitlines()[:12])
                warnings.warn(
                    f"dtq CUDA kernels are unavailable, quantization falls back to the PyTorch "
                    f"references (slower, same bits). Build error:\n{head}",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return _ext


def build_error() -> str | None:
    return _error


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability, cached: torch's lookup costs tens of microseconds of
    host time, and every GEMM and quantize asks."""
    return _capability(torch.cuda.current_device() if device.index is None else device.index)


_available: dict = {}


def available(device: torch.device | str | int | None = None) -> bool:
    """Whether the kernels can run on ``device`` (default: the current CUDA device): a CUDA build of
    torch, an sm_90+ GPU, kernels not disabled, and the extension built (building it if needed).
    Asked several times per quantize and GEMM: the answer is kept per device and setting of
    ``DTQ_DISABLE_KERNELS``."""
    key = (disabled_token(), device)
    ok = _available.get(key)
    if ok is None:
        ok = _available[key] = _available_now(device)
    return ok


def _available_now(device) -> bool:
    if disabled() or torch.version.cuda is None or not torch.cuda.is_available():
        return False
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda":
        return False
    if capability(dev)[0] < 9:
        return False
    return extension() is not None


# ---------------------------------------------------------------------------------------------
# Entry points (callers check ``available`` first)


def amax(x: torch.Tensor, want_x: bool, hadamard_signs: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max|x|, max|T x|)`` as fp32 0-dim tensors from one read of the [M, K] CUDA tensor ``x``
    (each only meaningful when asked for); NaN propagates."""
    buf = torch.empty(2, dtype=torch.int32, device=x.device)  # the kernel zeroes it first
    if hadamard_signs is None and not want_x:
        buf.zero_()
    else:
        extension().amax(x, buf, bool(want_x), -1 if hadamard_signs is None else int(hadamard_signs))
    f = buf.view(torch.float32)
    return f[0], f[1]


def cast_amax(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y.copy_(x)`` of a contiguous fp32 CUDA ``x`` into a contiguous bf16 or fp16 ``y`` of its
    size, and max|y| as a 0-dim fp32 tensor (the bits :func:`amax` takes from ``y``), from one read
    of ``x``: a gather's cast that also gives the gathered weight's per-tensor amax."""
    out = torch.empty((), dtype=torch.float32, device=x.device)  # the kernel zeroes it first
    extension().cast_amax(x, y, out)
    return out


def chunk_cat(tensors: list[torch.Tensor], out: torch.Tensor, chunks: int) -> bool:
    """``torch._chunk_cat(tensors, dim=0, num_chunks=chunks, out=out.view(chunks, -1))`` (FSDP2's
    gradient packing; over one chunk the flattened tensors concatenated) in one launch per 64
    tensors, for contiguous CUDA tensors of one dtype copied exactly: into ``out`` of that dtype,
    or BF16 / FP16 into FP32. False (nothing written) for any other call: run torch's then."""
    return bool(extension().chunk_cat(tensors, out, int(chunks)))


MAX_HISTORY = 8192  # the longest amax history delayed_amax takes (csrc/amax.cu kMaxHistory)


def delayed_amax(
    hist: torch.Tensor,
    x: torch.Tensor | None,
    cur: torch.Tensor | None,
    skip: int,
    most_recent: bool,
    factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax, entry)``: delayed scaling's step of the contiguous fp32 CUDA history ``hist`` (at
    most ``MAX_HISTORY`` entries) in one call and launch (``dtq.nn.slot.history_step`` is the
    reference, bit for bit): the scale's amax from ``hist[skip:]``, then ``hist`` shifts and takes
    ``entry`` at [0]: max|x| of the contiguous 2-D ``x`` (one more launch), else ``cur``."""
    amax, entry = extension().delayed_amax(x, cur, hist, int(skip), bool(most_recent), float(factor))
    return amax, entry


def axis_amax(x: torch.Tensor, rows: bool, cols: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(max|x| per row [M], max|x| per column [K])`` as fp32 from one read of the [M, K] CUDA
    tensor ``x``; each None unless asked for. NaN propagates (not canonicalized)."""
    m, k = x.shape
    r = torch.empty(m, dtype=torch.int32, device=x.device) if rows else None  # zeroed by the kernel
    c = torch.empty(k, dtype=torch.int32, device=x.device) if cols else None
    if rows or cols:
        extension().axis_amax(x, r, c)
    return (None if r is None else r.view(torch.float32)), (None if c is None else c.view(torch.float32))


# Payload field dtypes and amax modes of quantize_alloc (csrc/quantize_alloc.cpp mirrors both).
_FIELD_DTYPES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.uint8: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
    torch.int32: 6,
}
AMAX_GIVEN, AMAX_X, AMAX_HADAMARD, AMAX_ROWS, AMAX_COLS = 0, 1, 2, 3, 4
_NO_SLOT = [NONE] + [0] * (_CONFIG_LEN - 1)


class QuantizeLaunch:
    """One fused quantization of a [M, K] tensor, prepared once per (quantizer, directions, shape,
    dtype): each call is one crossing into the extension (``quantize_alloc``), which runs the amax
    pass a direction needs (unless its amax is given), allocates the payloads and launches the
    kernel. ``specs``: up to two directions' KernelSpecs; ``tensor_amax``: the directions whose
    kernel reads a tensor-wide amax (computed over x or over T x as the spec says). Per-column
    amaxes of T x (row-scaled NVFP4 with the Hadamard) have no pass here: the caller gives them."""

    __slots__ = ("dirs", "names", "count", "cfgs", "fields", "modes", "vectors", "signs", "stochastic")

    def __init__(self, specs: dict[str, KernelSpec], tensor_amax: tuple[str, ...]):
        if len(specs) > 2:
            raise ValueError("the fused kernel writes at most two directions")
        self.dirs = tuple(specs)
        self.names = tuple(tuple(name for name, _, _ in s.fields) for s in specs.values())
        self.count = len(self.names[0]) if self.names else 0
        self.cfgs = [s.config() for s in specs.values()] + [_NO_SLOT] * (2 - len(specs))
        self.fields = [
            [v for _, shape, dt in s.fields for v in (len(shape), *shape, _FIELD_DTYPES[dt])] for s in specs.values()
        ] + [[]] * (2 - len(specs))
        self.vectors = {d: s.amax_vector for d, s in specs.items() if s.amax_vector}
        modes = []
        for d, s in specs.items():
            if s.amax_vector and s.amax_space == "hadamard":
                modes.append(AMAX_GIVEN)
            elif s.amax_vector:
                modes.append(AMAX_ROWS if s.amax_vector == "rows" else AMAX_COLS)
            elif d in tensor_amax:
                modes.append(AMAX_HADAMARD if s.amax_space == "hadamard" else AMAX_X)
            else:
                modes.append(AMAX_GIVEN)
        self.modes = modes + [AMAX_GIVEN] * (2 - len(specs))
        signs = {s.hadamard_signs for d, s in specs.items() if d in tensor_amax and s.amax_space == "hadamard"}
        if len(signs) > 1:
            raise ValueError("one amax pass computes one Hadamard sign pattern")
        self.signs = next(iter(signs)) if signs else -1
        self.stochastic = any(s.stochastic for s in specs.values())

    def __call__(self, x: torch.Tensor, given: dict[str, torch.Tensor], seed: torch.Tensor | None) -> dict | None:
        """``{direction: payload}`` of the contiguous [M, K] CUDA tensor ``x``; ``given``: amaxes
        known already (their pass is skipped), ``seed``: an int64 tensor under stochastic rounding.
        None (nothing launched) where only the generic kernel would apply and it lacks an option
        (NVFP4 ``four_over_six`` with 16x16 blocks): the caller runs the reference."""
        amaxes, modes = [None, None], list(self.modes)
        for i, d in enumerate(self.dirs):
            a = given.get(d)
            if a is not None:
                amaxes[i], modes[i] = (a.reshape(-1).contiguous() if d in self.vectors else a), AMAX_GIVEN
        if not self.stochastic:
            seed = None
        elif not isinstance(seed, torch.Tensor):
            raise ValueError("stochastic rounding needs a seed tensor")
        elif seed.device != x.device or seed.dtype != torch.int64 or seed.dim():
            seed = seed.to(device=x.device, dtype=torch.int64).reshape(())
        outs = quantize_alloc(
            x,
            self.cfgs[0],
            self.fields[0],
            amaxes[0],
            modes[0],
            self.cfgs[1],
            self.fields[1],
            amaxes[1],
            modes[1],
            self.signs,
            seed,
        )
        if not outs:
            return None
        n = self.count
        out = {self.dirs[0]: dict(zip(self.names[0], outs[:n]))}
        if len(self.dirs) > 1:
            out[self.dirs[1]] = dict(zip(self.names[1], outs[n:]))
        return out


def quantize_alloc(x: torch.Tensor, *args) -> list[torch.Tensor]:
    """The extension's one-call quantization (see :class:`QuantizeLaunch`); a module-level name so
    tests can see that the kernel path ran."""
    return extension().quantize_alloc(x, *args)


def dequantize(
    spec: KernelSpec,
    payload: dict[str, torch.Tensor],
    shape: tuple[int, int],
    factored: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor | None:
    """[M, K] values of one payload in ``dtype`` (fp32, or bf16: the RNE rounding of the fp32
    values), or None where no kernel applies (not CUDA, identity, another dtype)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return None
    data = payload["data"]
    if spec.kind not in (FP8_SCALED, MXFP8, NVFP4) or not data.is_cuda or not available(data.device):
        return None
    if 0 in shape:  # nothing to launch (an empty batch); the kernel would find no scales to read
        return torch.empty(shape, dtype=dtype, device=data.device)
    names = [n for n, _, _ in spec.fields]
    per_tensor = spec.kind == NVFP4 or spec.block == (0, 0)
    scale = None if spec.block == (0, 0) else payload[names[1]]
    tensor = payload[names[-1]].to(device=data.device, dtype=torch.float32).contiguous() if per_tensor else None
    out = torch.empty(shape, dtype=dtype, device=data.device)
    cfg = [
        spec.kind,
        spec.block[0],
        spec.block[1],
        int(spec.e5m2),
        int(spec.hadamard_signs is not None),
        spec.hadamard_signs or 0,
        int(factored),
        int(spec.row_scaled),
        spec.e4m3_max,
    ]
    extension().dequantize(
        data.contiguous().view(torch.uint8), None if scale is None else scale.contiguous(), tensor, cfg, out
    )
    return out


def transposed(x: torch.Tensor) -> torch.Tensor:
    """Contiguous ``[K, M]`` copy of the 2-D tensor ``x``. FP8 codes on the GPU (1-byte, both dims
    multiples of 16, aligned) take the tiled byte-transpose kernel; anything else torch's copy."""
    x = x.contiguous()
    ok = (
        x.dim() == 2
        and x.element_size() == 1
        and x.is_cuda
        and x.shape[0] % 16 == 0
        and x.shape[1] % 16 == 0
        and x.data_ptr() % 16 == 0
        and available(x.device)
    )
    if not ok:
        return x.t().contiguous()
    return extension().transposed_u8(x)


def _transposed_codes_impl(x: torch.Tensor) -> torch.Tensor:
    out = transposed(x)
    # A [1, K] or [K, 1] tensor transposes to a view of itself; an op's output must be fresh.
    return out.clone() if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else out


def _transposed_codes_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[1], x.shape[0]))


# :func:`transposed` as an op, so that a compiled graph writes transposed FP8 codes with the tiled
# kernel: inductor's own transposing copy of 1-byte codes runs at about half the bandwidth. Its
# CUDA kernel is C++ (csrc/ops.cpp, registered when the extension loads): a compiled step calls
# it about a hundred times, and this Python kernel then runs only until the extension is loaded
# and for CPU tensors. Its input may have any strides (both kernels copy it contiguous first), and
# says so to inductor (``flexible_layout``): under a stride constraint inductor gave the op a copy
# of codes it had not stored yet, so the cast kernel that writes them for the GEMM stored them a
# second time for the transpose.
transposed_codes = define(
    "transposed_codes", _transposed_codes_impl, _transposed_codes_fake, tags=(torch.Tag.flexible_layout,)
)


def swiglu(x: torch.Tensor, block: int, want_amax: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``silu(gate) * up`` of the contiguous [T, 2F] CUDA tensor ``x`` (gate/up in blocks of
    ``block`` columns) as [T, F], bits of ``dtq.nn.functional.swiglu_reference``; with
    ``want_amax``, also max|h| as a 0-dim fp32 tensor (what :func:`amax` of h gives)."""
    h = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    buf = torch.empty(1, dtype=torch.int32, device=x.device) if want_amax else None  # zeroed by the call
    extension().swiglu_forward(x, h, block, buf)
    return h, (None if buf is None else buf.view(torch.float32).reshape(()))


def swiglu_backward(
    dh: torch.Tensor, x: torch.Tensor, block: int, want_amax: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradient of the [T, 2F] input of :func:`swiglu` from ``dh`` [T, F] (both contiguous);
    with ``want_amax``, also its max|.| (0-dim fp32)."""
    dx = torch.empty_like(x)
    buf = torch.empty(1, dtype=torch.int32, device=x.device) if want_amax else None
    extension().swiglu_backward(dh, x, dx, block, buf)
    return dx, (None if buf is None else buf.view(torch.float32).reshape(()))


def inverse_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor | None:
    """``1 / per_tensor_scale(amax, fmax)`` (``dtq._bits``; no power-of-two rounding) of fp32 CUDA
    amaxes, in one launch; None where the kernel does not apply. The emulated NVFP4 GEMMs take
    this factor per operand and call, where torch's ops cost seven launches."""
    if amax.dtype != torch.float32 or not amax.is_cuda or not available(amax.device):
        return None
    amax = amax.contiguous()
    out = torch.empty(amax.shape, dtype=torch.float32, device=amax.device)
    extension().inverse_scale(amax, out, fmax)
    return out


def scale_cast(
    out: torch.Tensor, fa: torch.Tensor | None, fb: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor | None:
    """``((out * fa) * fb).to(dtype)`` for a contiguous fp32 CUDA ``out`` and 0-dim fp32 factors on
    its device (either None) in one pass; None where the kernel does not apply. With ``dtype``
    float32 the result is written into ``out`` itself (callers pass a buffer of their own)."""
    factors_ok = all(
        f is None or (f.device == out.device and f.dtype == torch.float32 and f.numel() == 1) for f in (fa, fb)
    )
    if (
        not factors_ok
        or out.dtype != torch.float32
        or dtype not in _DTYPE_CODE
        or not out.is_cuda
        or not out.is_contiguous()
        or not available(out.device)
    ):
        return None
    dst = out if dtype == torch.float32 else torch.empty(out.shape, dtype=dtype, device=out.device)
    extension().scale_cast(out, fa, fb, dst)
    return dst
