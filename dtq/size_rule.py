"""Which GEMMs are big enough to gain from quantization. A quantized GEMM pays for its casts, its
scales and its host time per call; below some size that costs more than the faster GEMM saves,
and the layer is faster in high precision. :class:`SizeRule` states the threshold on the weight
``[N, K]``; :meth:`SizeRule.measured` gives the one ``bench/gemm_sizes.py`` measured for a recipe
on a device; ``dtq.convert(size_rule=...)`` leaves smaller ``nn.Linear`` layers as they are and
:func:`apply_size_rule` keeps smaller dtq modules in high precision, each named in a report."""

from __future__ import annotations

import dataclasses
import logging

import torch

from dtq.nn.module import QuantizedModule
from dtq.recipe import TENSOR_TYPES, QuantizerRole, Recipe
from dtq.tensor import QuantizedTensor
from dtq.weights import local_tensor

log = logging.getLogger("dtq")

SMALL = "below the size rule"  # the start of every reason a rule gives (a skip the user asked for)

# What bench/gemm_sizes.py measured on one H100 (sm_90, torch 2.11 cu130, 2026-11-25): stacks of
# four Linear pairs {a, b} for a, b in 1024..8192, forward + backward + fused AdamW, against BF16
# in the same run. Each rule keeps every grid point it converts at >= 1.05x BF16, eager and (fp8,
# fp8_row) compiled; see docs/benchmarks.md, "Which GEMMs gain". One exception: fp8 at 16384
# tokens also converts 2048 x 2048 (pairs: 1.07x eager, 0.47x compiled), because the whole
# hidden-2048 stack of bench_e2e.py ran faster with those GEMMs in FP8 than without, eager and
# compiled. None: slower than BF16 at every size of the grid (mxfp8 0.16x-0.92x; nvfp4 within the
# mxfp8/nvfp4 hybrid, 0.13x-0.80x: both emulated on Hopper). Data, not a rule about formats: a
# format or device missing here raises until someone measures it.
# {(major, minor): {codec name: {tokens per GEMM: (min_features, min_weight_numel) or None}}}.
_MEASURED: dict[tuple[int, int], dict[str, dict[int, tuple[int, int] | None]]] = {
    (9, 0): {
        "fp8": {8192: (2048, 2048 * 8192), 16384: (2048, 2048 * 2048)},
        "fp8_row": {8192: (4096, 4096 * 8192), 16384: (2048, 2048 * 8192)},
        "fp8_block": {8192: (2048, 2048 * 8192), 16384: (2048, 2048 * 4096)},
        "mxfp8": {8192: None, 16384: None},
        "nvfp4": {8192: None},
    }
}


@dataclasses.dataclass(frozen=True)
class SizeRule:
    """Quantize a GEMM whose weight ``[N, K]`` has ``min(N, K) >= min_features`` and
    ``N * K >= min_weight_numel``; keep smaller ones in high precision. ``keep_all``: no size
    gains (the recipe's GEMMs are emulated where it was measured). ``source`` says where the
    thresholds come from; reports quote it."""

    min_features: int = 0
    min_weight_numel: int = 0
    keep_all: bool = False
    source: str = "given"

    def __post_init__(self):
        for field in ("min_features", "min_weight_numel"):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"dtq.SizeRule: {field}={v!r} must be an int >= 0")
        if not isinstance(self.keep_all, bool):
            raise ValueError(f"dtq.SizeRule: keep_all={self.keep_all!r} must be a bool")

    def why_small(self, out_features: int, in_features: int) -> str | None:
        """Why a GEMM with weight ``[out_features, in_features]`` stays in high precision under
        this rule (one line starting with ``SMALL``), or None when it is quantized."""
        if self.keep_all:
            return f"{SMALL}: {self.source}"
        n, k = out_features, in_features
        if min(n, k) >= self.min_features and n * k >= self.min_weight_numel:
            return None
        return (
            f"{SMALL}: weight [{n}, {k}] needs min(N, K) >= {self.min_features} and N*K >= "
            f"{self.min_weight_numel} to gain ({self.source})"
        )

    @classmethod
    def measured(cls, recipe: Recipe, *, tokens: int = 8192, device: torch.device | str | None = None) -> SizeRule:
        """The rule ``bench/gemm_sizes.py`` measured for ``recipe``'s formats on ``device`` (default:
        the current CUDA device, else the CPU) at ``tokens`` rows per GEMM (the largest measured
        count not above it: more tokens gain more). A format measured slower than high precision at
        every size keeps every GEMM, as does the CPU (where dtq emulates every quantized GEMM).
        Raises ValueError for a device, format or token count nothing was measured for."""
        if not isinstance(recipe, Recipe):
            raise TypeError(f"dtq.SizeRule.measured: recipe must be a dtq recipe, got {type(recipe).__name__}")
        names = _codec_names(recipe)
        if not names:
            return cls(source=f"{type(recipe).__name__} quantizes nothing")
        dev = torch.device(device) if device is not None else _current_device()
        label = f"{type(recipe).__name__} ({', '.join(sorted(names))})"
        if dev.type != "cuda":
            return cls(keep_all=True, source=f"on {dev.type} dtq emulates every quantized GEMM ({label})")
        major, minor = torch.cuda.get_device_capability(dev)
        sm = f"sm_{major}{minor}"
        table = _MEASURED.get((major, minor), {})
        missing = sorted(n for n in names if n not in table)
        if missing:
            raise ValueError(
                f"dtq.SizeRule.measured: no size rule was measured for {label} on {sm} (none for "
                f"{', '.join(missing)}); measure one with bench/gemm_sizes.py and pass "
                "dtq.SizeRule(min_features=..., min_weight_numel=...)"
            )
        rules = []
        for name in sorted(names):
            by_tokens = table[name]
            fit = [t for t in by_tokens if t <= tokens]
            if not fit:
                raise ValueError(
                    f"dtq.SizeRule.measured: {label} on {sm} was measured at {min(by_tokens)} tokens per GEMM and up, "
                    f"not at {tokens} (fewer tokens gain less); measure with bench/gemm_sizes.py --tokens {tokens} "
                    "and pass dtq.SizeRule(min_features=..., min_weight_numel=...)"
                )
            rules.append((name, max(fit), by_tokens[max(fit)]))
        losing = [f"{name} at {t} tokens" for name, t, rule in rules if rule is None]
        if losing:
            return cls(
                keep_all=True,
                source=f"measured on {sm}: {', '.join(losing)} slower than high precision at every size",
            )
        features, numel = max(r[0] for *_, r in rules), max(r[1] for *_, r in rules)
        measured_at = ", ".join(f"{name} at {t} tokens" for name, t, _ in rules)
        return cls(features, numel, source=f"measured on {sm}: {measured_at}")


def _current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _codec_names(recipe: Recipe) -> set[str]:
    """The formats ``recipe`` gives a Linear's operands, both directions (identity left out)."""
    names = set()
    for tensor_type in TENSOR_TYPES:
        q = recipe.quantizer(QuantizerRole("linear", tensor_type, ""))
        if q is None:
            continue
        for d in ("rowwise", "columnwise"):
            names.add(q.codec(d).name)
    names.discard("identity")
    return names


def apply_size_rule(model: torch.nn.Module, rule: SizeRule) -> dict[str, str]:
    """Keep every dtq module of ``model`` whose GEMMs are all below ``rule`` in high precision
    under every recipe (its ``gemm_state.high_precision`` says why); modules with a GEMM the rule
    quantizes follow the recipe. Returns ``{fully qualified name: why}`` of the modules kept,
    and logs the count (logger "dtq"). Apply it before quantizing parameters."""
    if not isinstance(rule, SizeRule):
        raise TypeError(f"dtq.apply_size_rule: rule must be a dtq.SizeRule, got {type(rule).__name__}")
    kept: dict[str, str] = {}
    total = 0
    for fqn, module in model.named_modules():
        if not isinstance(module, QuantizedModule):
            continue
        total += 1
        reasons = []
        for leaf in module.weight_names():
            w = getattr(module, leaf)
            if isinstance(local_tensor(w), QuantizedTensor):
                raise ValueError(
                    f"dtq.apply_size_rule: {fqn}.{leaf} is already a quantized parameter; apply the size rule "
                    "before quantizing parameters (dtq.convert(..., quantized_params=True) keeps the small layers "
                    "in high precision then)"
                )
            why = rule.why_small(*w.shape)
            if why is None:
                reasons = []
                break
            reasons.append(f"{leaf}: {why}" if len(module.weight_names()) > 1 else why)
        module.gemm_state.high_precision = "; ".join(reasons) if reasons else None
        if reasons:
            kept[fqn] = module.gemm_state.high_precision
    log.info("dtq.apply_size_rule: %d of %d dtq modules kept in high precision (%s)", len(kept), total, rule.source)
    return kept
