"""Recipes by name, for configurations that name one (``"mxfp8"``, ``"hybrid"``) rather than
build it: the example trainer's config files, torchtitan's converter config."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType

from dtq.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
    hybrid_recipe,
)
from dtq.recipes import FACTORIES

PRESETS: Mapping[str, Callable[[], Recipe]] = MappingProxyType(
    {
        "fp8": Float8CurrentScaling,  # per-tensor current scaling, E4M3 forward / E5M2 gradients
        "fp8-delayed": DelayedScaling,  # per-tensor scales from each module's amax history
        "fp8-block": Float8BlockScaling,  # 1x128 activations and gradients, 128x128 weights
        "fp8-row": Float8RowwiseScaling,  # one E4M3 scale per row of each GEMM's contraction
        "mxfp8": MXFP8BlockScaling,
        "nvfp4": NVFP4BlockScaling,
        # MXFP8 for the forward GEMM, NVFP4 (16x16 weights, stochastic rounding on gradients, random
        # Hadamard on the wgrad operands) for the backward GEMMs; each weight's columnwise (dgrad)
        # payload quantized from its dequantized MXFP8 rowwise payload, so backward sees the weight
        # forward saw. The best hybrid of the 1.07 B fidelity study (docs/benchmarks.md).
        "hybrid": lambda: hybrid_recipe(
            MXFP8BlockScaling(), NVFP4BlockScaling(), weight_columnwise_source="rowwise_dequantized"
        ),
        # The same with every columnwise payload quantized from the original (the default until then).
        "hybrid-original": lambda: hybrid_recipe(MXFP8BlockScaling(), NVFP4BlockScaling()),
        # Per-tensor FP8 forward, NVFP4 backward.
        "hybrid-fp8-nvfp4": lambda: hybrid_recipe(Float8CurrentScaling(), NVFP4BlockScaling()),
        # MXFP8 forward, FP8 1x128 / 128x128 blocks backward.
        "hybrid-mxfp8-fp8block": lambda: hybrid_recipe(MXFP8BlockScaling(), Float8BlockScaling()),
        # dtq.recipes' named factories (docs/recipes.md), e.g. "mxfp8_fwd_nvfp4_bwd"
        **{name: functools.partial(CustomRecipe, f) for name, f in FACTORIES.items()},
    }
)


def recipe_from_name(name: str) -> Recipe:
    """The recipe a preset name gives, or what ``"package.module:attr"`` names (a recipe, or a
    factory called without arguments)."""
    if name in PRESETS:
        return PRESETS[name]()
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(
            f"dtq: unknown recipe {name!r}; use one of {', '.join(sorted(PRESETS))}, or "
            "'package.module:function' for a factory that returns a dtq recipe"
        )
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"dtq: recipe {name!r}: cannot import {attr!r} from {module_name!r} ({e})") from None
    recipe = obj if isinstance(obj, Recipe) else obj()
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"dtq: recipe {name!r} gave {type(recipe).__name__}; it must give a dtq recipe "
            "(dtq.CustomRecipe(factory), dtq.MXFP8BlockScaling(), ...)"
        )
    return recipe


def as_recipe(recipe: Recipe | str) -> Recipe:
    """A recipe given as itself or by name (see :func:`recipe_from_name`)."""
    if isinstance(recipe, str):
        return recipe_from_name(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"dtq: expected a dtq recipe or a preset name ({', '.join(sorted(PRESETS))}), got {type(recipe).__name__}"
        )
    return recipe
