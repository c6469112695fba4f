"""``dtq.autocast``: the one piece of ambient state. Inside it dtq modules quantize with the active
recipe; outside it (or with ``enabled=False``) they compute in high precision."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from dtq.recipe import Float8CurrentScaling, Recipe

_local = threading.local()


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def autocast(recipe: Recipe | None = None, enabled: bool = True) -> Iterator[None]:
    """Run dtq modules under ``recipe`` (default: ``Float8CurrentScaling()``). Nests; the innermost
    wins, and ``enabled=False`` switches quantization off inside. The recipe may change between
    steps: modules look up (and cache) their quantizers per recipe."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"dtq.autocast(recipe=...) takes a dtq recipe (e.g. dtq.MXFP8BlockScaling(), "
                        f"dtq.CustomRecipe(factory)), got {type(recipe).__name__}")
    _stack().append((recipe or Float8CurrentScaling()) if enabled else None)
    try:
        yield
    finally:
        _stack().pop()


def active_recipe() -> Recipe | None:
    """The recipe dtq modules use right now, or None (high precision)."""
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def restore(recipe: Recipe | None) -> Iterator[None]:
    """Re-enter a recipe captured earlier (None: disabled), e.g. for a recompute in backward."""
    _stack().append(recipe)
    try:
        yield
    finally:
        _stack().pop()
