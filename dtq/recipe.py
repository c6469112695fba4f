"""Roles, recipes and the backward override.

Every quantized tensor slot of a dtq module asks its recipe once, with a :class:`QuantizerRole`,
which quantizer to use. A recipe is a frozen config: :class:`CustomRecipe` wraps any factory, and
the built-in recipes are factory presets of the same mechanism.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import torch

from dtq.codec import quantizer_names
from dtq.formats import (
    COLUMNWISE_SOURCES,
    Float8BlockQuantizer,
    Float8Quantizer,
    Float8RowwiseQuantizer,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)

BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")
TENSOR_TYPES = ("input", "weight", "grad_output")


@dataclasses.dataclass(frozen=True)
class QuantizerRole:
    """What a quantizer is for: ``module_type`` ("linear", "grouped_linear"), ``tensor_type``
    ("input", "weight", "grad_output"), ``name`` (the module's fully qualified name when it came
    from ``dtq.convert``, or the name given to the module; GEMM-specific suffixes such as ".fc1"
    distinguish the GEMMs of one module)."""

    module_type: str = ""
    tensor_type: str = ""
    name: str = ""


_KEYS: dict[Recipe, int] = {}  # equal recipes share a key (recipes are frozen and compare by value)
_RECIPES: dict[int, Recipe] = {}


def _intern(recipe: Recipe) -> None:
    try:
        key = _KEYS.setdefault(recipe, len(_KEYS) + 1)
    except TypeError:  # an unhashable setting (a CustomRecipe factory that is not hashable): its own key
        key = -(len(_RECIPES) + 1)
    _RECIPES.setdefault(key, recipe)
    object.__setattr__(recipe, "_key", key)


def recipe_key(recipe: Recipe) -> int:
    """The recipe's key (see ``Recipe.key``), taken now."""
    return recipe.key


def recipe_by_key(key: int) -> Recipe:
    return _RECIPES[key]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """Base of all recipes (frozen, keyword-only settings). ``backward_override``: None |
    "high_precision" | "dequantized". ``fprop_fast_accumulation``: the forward GEMM (fprop)
    accumulates in the FP8 tensor cores' fast mode where its path has one (Hopper's per-tensor
    and row-wise FP8 GEMMs: partial sums are not promoted to fp32 along the way; faster, less
    exact); dgrad and wgrad never do."""

    backward_override: str | None = None
    fprop_fast_accumulation: bool = False
    delayed: ClassVar[bool] = False  # modules keep amax histories for this recipe's slots
    # Whether quantizers depend on the role's module name (torch.compile then compiles each
    # module's GEMMs apart; otherwise blocks of one structure share a graph).
    name_dependent: ClassVar[bool] = False

    def __post_init__(self):
        if self.backward_override not in BACKWARD_OVERRIDES:
            raise ValueError(
                f"{type(self).__name__}: backward_override={self.backward_override!r} is not one of "
                f"{BACKWARD_OVERRIDES}"
            )

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_key"}

    def __setstate__(self, state: dict) -> None:  # pickle / deepcopy: a key of this process
        for k, v in state.items():
            object.__setattr__(self, k, v)
        _intern(self)

    @property
    def key(self) -> int:
        """A number naming this recipe's value to compiled graphs (an int is a graph constant, the
        object is not; equal recipes, e.g. one made anew each step, share it). Taken when
        ``dtq.autocast`` enters, outside compiled code."""
        if "_key" not in self.__dict__:
            _intern(self)
        return self._key

    def qfactory(self, role: QuantizerRole) -> Quantizer | None:
        raise NotImplementedError

    def quantizer(self, role: QuantizerRole | None) -> Quantizer | None:
        """The validated quantizer for one slot (None: that slot stays in high precision)."""
        if role is None:
            return None
        q = self.qfactory(role)
        ok = isinstance(q, Quantizer)
        if ok:
            try:
                for d in ("rowwise", "columnwise"):
                    q.codec(d)
            except TypeError:
                ok = False
        if q is not None and not ok:
            raise TypeError(
                f"{type(self).__name__}: the quantizer factory returned {type(q).__name__} for {role}; "
                f"it must return a dtq quantizer ({quantizer_names()}, HybridQuantizer) or None for high "
                "precision"
            )
        if q is not None and role.tensor_type == "grad_output" and q.columnwise_from_rowwise():
            raise ValueError(
                f"{type(self).__name__}: the quantizer factory returned {q!r} for {role}: a gradient's columnwise "
                "payload (wgrad) must come from the gradient itself, not from its quantized rowwise copy. Use "
                "columnwise_source='rowwise_dequantized' for weights (and inputs) only"
            )
        return q


@dataclasses.dataclass(frozen=True)
class CustomRecipe(Recipe):
    """``qfactory(role) -> quantizer | None`` is called once per quantized slot of every module.
    (A module-level function or a frozen dataclass keeps the recipe picklable.)"""

    qfactory: Callable[[QuantizerRole], Quantizer | None]
    name_dependent: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if self.qfactory is Recipe.qfactory:  # the dataclass took the base class's method as a default
            raise TypeError(
                "CustomRecipe needs a quantizer factory: CustomRecipe(qfactory) with qfactory(role) -> quantizer | None"
            )
        if not callable(self.qfactory):
            raise TypeError(
                f"CustomRecipe: qfactory must be callable (role -> quantizer), got {type(self.qfactory).__name__}"
            )


def _fp8_dtypes(fp8_format: str, owner: str = "recipe") -> tuple[torch.dtype, torch.dtype]:
    """(forward dtype, grad dtype) of a TransformerEngine-style format name."""
    table = {"E4M3": (torch.float8_e4m3fn, torch.float8_e4m3fn), "HYBRID": (torch.float8_e4m3fn, torch.float8_e5m2)}
    if fp8_format not in table:
        raise ValueError(f"{owner}: fp8_format={fp8_format!r}; use 'HYBRID' (E4M3 forward, E5M2 gradients) or 'E4M3'")
    return table[fp8_format]


@dataclasses.dataclass(frozen=True)
class _Float8Recipe(Recipe):
    """One FP8 quantizer class for every slot, E4M3 or E5M2 by ``fp8_format`` and role."""

    fp8_format: str = "HYBRID"
    pow2_scales: bool = False
    # on by default, as TransformerEngine's FP8 recipes and torchao's float8 training have it
    fprop_fast_accumulation: bool = dataclasses.field(default=True, kw_only=True)
    quantizer_cls: ClassVar[type] = Float8Quantizer

    def __post_init__(self):
        super().__post_init__()
        _fp8_dtypes(self.fp8_format, type(self).__name__)

    def qfactory(self, role):
        fwd, bwd = _fp8_dtypes(self.fp8_format)
        return self.quantizer_cls(bwd if role.tensor_type == "grad_output" else fwd, pow2_scales=self.pow2_scales)


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(_Float8Recipe):
    """FP8 per-tensor, scale from the current amax."""


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Float8CurrentScaling):
    """FP8 per-tensor, scale from an amax history kept by each module (``amax_history_len`` steps,
    reduced by ``amax_compute_algo``), divided by ``2**margin``."""

    margin: int = 0
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    delayed: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if self.backward_override is not None:
            raise ValueError(
                f"DelayedScaling does not support backward_override={self.backward_override!r}: its "
                "gradient amax history needs quantized gradients. Use Float8CurrentScaling("
                f"backward_override={self.backward_override!r}) instead"
            )
        if self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling: amax_history_len={self.amax_history_len} must be >= 1")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"DelayedScaling: amax_compute_algo={self.amax_compute_algo!r}; use 'max' or 'most_recent'"
            )


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """FP8 with 1x128 blocks for activations and gradients, 128x128 blocks for weights."""

    fp8_format: str = "E4M3"

    def __post_init__(self):
        super().__post_init__()
        _fp8_dtypes(self.fp8_format, type(self).__name__)

    def qfactory(self, role):
        fwd, bwd = _fp8_dtypes(self.fp8_format)
        if role.tensor_type == "weight":
            return Float8BlockQuantizer((128, 128), fwd)
        return Float8BlockQuantizer((1, 128), bwd if role.tensor_type == "grad_output" else fwd)


@dataclasses.dataclass(frozen=True)
class Float8RowwiseScaling(_Float8Recipe):
    """FP8 with one scale per row of each GEMM's contraction (torchao's "rowwise" recipe): finer
    than one scale per tensor, and still a native FP8 GEMM on Hopper. E4M3 everywhere by default."""

    fp8_format: str = "E4M3"
    quantizer_cls: ClassVar[type] = Float8RowwiseQuantizer


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8 for every tensor (E8M0 scales per 32 elements)."""

    fp8_format: str = "E4M3"
    scale_rounding: str = "ceil"

    def __post_init__(self):
        super().__post_init__()
        _fp8_dtypes(self.fp8_format, type(self).__name__)
        MXFP8Quantizer(scale_rounding=self.scale_rounding)

    def qfactory(self, role):
        fwd, bwd = _fp8_dtypes(self.fp8_format)
        return MXFP8Quantizer(bwd if role.tensor_type == "grad_output" else fwd, self.scale_rounding)


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: 16x16 blocks for weights, 1x16 for activations and gradients, stochastic rounding on
    gradients and a random Hadamard transform on the wgrad operands (input and gradient columnwise).

    ``stochastic_rounding`` / ``random_hadamard`` default to on, and to off under a backward
    override (which quantizes no gradient and builds no columnwise payload); asking for them
    explicitly together with an override is an error."""

    weight_2d: bool = True
    stochastic_rounding: bool | None = None
    random_hadamard: bool | None = None
    hadamard_seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        for opt in ("stochastic_rounding", "random_hadamard"):
            val = getattr(self, opt)
            if self.backward_override is not None and val:
                raise ValueError(
                    f"NVFP4BlockScaling: {opt}=True has no effect with backward_override="
                    f"{self.backward_override!r} (gradients are not quantized and no columnwise "
                    f"payload is built); drop one of the two"
                )
            if val is None:
                object.__setattr__(self, opt, self.backward_override is None)

    def qfactory(self, role):
        if role.tensor_type == "weight":
            return NVFP4Quantizer((16, 16) if self.weight_2d else (1, 16))
        grad = role.tensor_type == "grad_output"
        return NVFP4Quantizer(
            (1, 16),
            stochastic_rounding=bool(self.stochastic_rounding and grad),
            random_hadamard=bool(self.random_hadamard),
            hadamard_seed=self.hadamard_seed,
        )


@dataclasses.dataclass(frozen=True)
class HybridRecipe(Recipe):
    """Inputs and weights quantized rowwise as ``rowwise`` says and columnwise as ``columnwise``
    says; gradients as ``grad`` (default: ``columnwise``). A slot one side keeps in high precision
    gets an ``IdentityQuantizer`` for that direction. ``weight_columnwise_source="rowwise_dequantized"``
    quantizes each weight's columnwise payload from its dequantized rowwise one (``HybridQuantizer``'s
    ``columnwise_source``), so dgrad sees the weight fprop saw; inputs keep ``"original"``."""

    rowwise: Recipe
    columnwise: Recipe
    grad: Recipe | None = None
    weight_columnwise_source: str = "original"

    def __post_init__(self):
        super().__post_init__()
        if self.weight_columnwise_source not in COLUMNWISE_SOURCES:
            raise ValueError(
                f"HybridRecipe: weight_columnwise_source={self.weight_columnwise_source!r}; use one of "
                f"{', '.join(map(repr, COLUMNWISE_SOURCES))}"
            )
        for part in ("rowwise", "columnwise", "grad"):
            r = getattr(self, part)
            if r is None:
                continue
            if not isinstance(r, Recipe):
                raise TypeError(f"HybridRecipe: {part}= must be a dtq recipe, got {type(r).__name__}")
            if r.delayed:
                raise ValueError(
                    f"HybridRecipe: {part}={type(r).__name__} keeps amax histories per module, which a "
                    "hybrid does not; use Float8CurrentScaling for that part"
                )
            if r.backward_override is not None:
                raise ValueError(
                    f"HybridRecipe: {part}= has backward_override={r.backward_override!r}; set the "
                    "override on the HybridRecipe itself"
                )
        if self.backward_override is not None:
            raise ValueError(
                f"HybridRecipe with backward_override={self.backward_override!r}: the override builds no "
                "columnwise payload and quantizes no gradient, so the columnwise and grad parts would be "
                "ignored; use the rowwise recipe with the override instead"
            )

    def qfactory(self, role: QuantizerRole) -> Quantizer | None:
        if role.tensor_type == "grad_output":
            return (self.grad or self.columnwise).quantizer(role)
        r, c = self.rowwise.quantizer(role), self.columnwise.quantizer(role)
        if r is None and c is None:
            return None
        return HybridQuantizer(
            rowwise=r.for_direction("rowwise") if r is not None else IdentityQuantizer(),
            columnwise=c.for_direction("columnwise") if c is not None else IdentityQuantizer(),
            columnwise_source=self.weight_columnwise_source if role.tensor_type == "weight" else "original",
        )


def hybrid_recipe(
    rowwise: Recipe, columnwise: Recipe, grad: Recipe | None = None, weight_columnwise_source: str = "original"
) -> HybridRecipe:
    """Shorthand for :class:`HybridRecipe`."""
    return HybridRecipe(
        rowwise=rowwise, columnwise=columnwise, grad=grad, weight_columnwise_source=weight_columnwise_source
    )
