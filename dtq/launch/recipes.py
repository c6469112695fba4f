"""Recipes by name, so a config can say ``recipe = "hybrid"``.

Every entry is a zero-argument factory returning a dtq recipe, or None for the high-precision
baseline. Anything else is a Python factory named as ``"package.module:function"`` (it may also
name a recipe object directly).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Callable

import dtq

RECIPES: dict[str, Callable[[], dtq.Recipe | None]] = {
    # No quantization: parameters and GEMMs in train.dtype (the BF16 baseline when dtype = "bfloat16").
    "bf16": lambda: None,
    "fp8": dtq.Float8CurrentScaling,  # per-tensor current scaling, E4M3 forward / E5M2 gradients
    "fp8-delayed": dtq.DelayedScaling,  # per-tensor scales from each module's amax history
    "fp8-block": dtq.Float8BlockScaling,  # 1x128 activations and gradients, 128x128 weights
    "fp8-row": dtq.Float8RowwiseScaling,  # one E4M3 scale per row of each GEMM's contraction
    "mxfp8": dtq.MXFP8BlockScaling,
    "nvfp4": dtq.NVFP4BlockScaling,
    # MXFP8 for the forward GEMM, NVFP4 (16x16 weights, stochastic rounding on gradients, random
    # Hadamard on the wgrad operands) for the backward GEMMs.
    "hybrid": lambda: dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling()),
    # Per-tensor FP8 forward, NVFP4 backward.
    "hybrid-fp8-nvfp4": lambda: dtq.hybrid_recipe(dtq.Float8CurrentScaling(), dtq.NVFP4BlockScaling()),
    # MXFP8 forward, FP8 1x128 / 128x128 blocks backward.
    "hybrid-mxfp8-fp8block": lambda: dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.Float8BlockScaling()),
    # dtq.recipes' named factories (docs/recipes.md), e.g. "mxfp8_fwd_nvfp4_bwd"
    **{name: functools.partial(dtq.CustomRecipe, f) for name, f in dtq.recipes.FACTORIES.items()},
}


def _unknown(name: str) -> ValueError:
    return ValueError(f"config: unknown recipe {name!r}; use one of {', '.join(sorted(RECIPES))}, or "
                      "'package.module:function' for a factory that returns a dtq recipe")


def check_recipe_name(name: str) -> None:
    """Fail early (at config time) for a name that is neither a preset nor ``module:function``."""
    if name not in RECIPES and (":" not in name or not all(name.partition(":")[::2])):
        raise _unknown(name)


def build_recipe(name: str, backward_override: str | None = None) -> dtq.Recipe | None:
    """The recipe a config names, with ``backward_override`` applied to it."""
    check_recipe_name(name)
    if name in RECIPES:
        recipe = RECIPES[name]()
    else:
        module_name, _, attr = name.partition(":")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"config: recipe {name!r}: cannot import {attr!r} from {module_name!r} ({e})") from None
        recipe = obj() if callable(obj) and not isinstance(obj, dtq.Recipe) else obj
        if recipe is not None and not isinstance(recipe, dtq.Recipe):
            raise TypeError(f"config: recipe {name!r} gave {type(recipe).__name__}; it must give a dtq recipe "
                            "(dtq.CustomRecipe(factory), dtq.MXFP8BlockScaling(), ...) or None")
    if backward_override is not None:
        if recipe is None:
            raise ValueError(f"config: train.backward_override = {backward_override!r} needs a quantizing recipe; "
                             f"recipe {name!r} quantizes nothing")
        recipe = dataclasses.replace(recipe, backward_override=backward_override)
    return recipe
