"""Recipes by name, so a config can say ``recipe = "hybrid"``.

Every entry is a zero-argument factory returning a dtq recipe, or None for the high-precision
baseline. Anything else is a Python factory named as ``"package.module:function"`` (it may also
name a recipe object directly).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import dtq
from dtq.presets import PRESETS

# The library's presets (dtq.presets), plus the high-precision baseline: parameters and GEMMs in
# train.dtype (the BF16 baseline when dtype = "bfloat16").
RECIPES: dict[str, Callable[[], dtq.Recipe | None]] = {"bf16": lambda: None, **PRESETS}


def _unknown(name: str) -> ValueError:
    return ValueError(
        f"config: unknown recipe {name!r}; use one of {', '.join(sorted(RECIPES))}, or "
        "'package.module:function' for a factory that returns a dtq recipe"
    )


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
            raise TypeError(
                f"config: recipe {name!r} gave {type(recipe).__name__}; it must give a dtq recipe "
                "(dtq.CustomRecipe(factory), dtq.MXFP8BlockScaling(), ...) or None"
            )
    if backward_override is not None:
        if recipe is None:
            raise ValueError(
                f"config: train.backward_override = {backward_override!r} needs a quantizing recipe; "
                f"recipe {name!r} quantizes nothing"
            )
        recipe = dataclasses.replace(recipe, backward_override=backward_override)
    return recipe
