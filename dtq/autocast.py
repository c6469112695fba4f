"""``dtq.autocast``: the one piece of ambient state. Inside it dtq modules quantize with the active
recipe; outside it (or with ``enabled=False``) they compute in high precision."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from dtq.recipe import Float8CurrentScaling, Recipe, recipe_key

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from dtq.distributed.amax import AmaxSync

_local = threading.local()


def _stack() -> list:
    """Entries ``(recipe or None, AmaxSync or None)``, innermost last (asked several times per GEMM:
    one attribute lookup on the common path)."""
    try:
        return _local.stack
    except AttributeError:
        _local.stack = []
        return _local.stack


@contextlib.contextmanager
def autocast(
    recipe: Recipe | None = None, enabled: bool = True, *, amax_group: ProcessGroup | None = None
) -> Iterator[None]:
    """Run dtq modules under ``recipe`` (default: ``Float8CurrentScaling()``). Nests; the innermost
    wins, and ``enabled=False`` switches quantization off inside. The recipe may change between
    steps: modules look up (and cache) their quantizers per recipe.

    ``amax_group``: a process group (typically the data-parallel one) whose ranks keep identical
    delayed-scaling amax histories, as TransformerEngine's ``fp8_group`` does: the amaxes this
    region's modules record are MAX-reduced over it in one all-reduce when the region exits, and
    those of their backward in one all-reduce at the end of the backward pass (see
    :class:`dtq.distributed.amax.AmaxSync`). Every rank of the group must run the same dtq modules
    in the same order. Recipes without histories ignore it; nested regions without their own
    share the enclosing one's."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(
            f"dtq.autocast(recipe=...) takes a dtq recipe (e.g. dtq.MXFP8BlockScaling(), "
            f"dtq.CustomRecipe(factory)), got {type(recipe).__name__}"
        )
    stack = _stack()
    if amax_group is not None:
        from dtq.distributed.amax import AmaxSync

        sync = AmaxSync(amax_group)
    else:
        sync = stack[-1][1] if stack else None
    if recipe is None and enabled:
        recipe = Float8CurrentScaling()
    if recipe is not None:
        recipe_key(recipe)  # in eager code: compiled graphs read recipe.key without side effects
    stack.append((recipe if enabled else None, sync))
    try:
        yield
    finally:
        stack.pop()
    if amax_group is not None:  # only on a normal exit: an exception must not start a collective
        sync.flush()


def active_recipe() -> Recipe | None:
    """The recipe dtq modules use right now, or None (high precision)."""
    stack = _stack()
    return stack[-1][0] if stack else None


def autocast_active() -> bool:
    """Whether any ``dtq.autocast`` region (enabled or not) is open on this thread."""
    return len(_stack()) > 0  # (torch 2.11's dynamo cannot trace bool() of a list: a graph break)


def active_amax_sync() -> AmaxSync | None:
    """The :class:`dtq.distributed.amax.AmaxSync` of the innermost ``autocast(amax_group=...)``, or None."""
    stack = _stack()
    return stack[-1][1] if stack else None
