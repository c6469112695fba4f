"""dtq's ``torch.library`` operators, defined with ``Library.define`` + one
``CompositeExplicitAutograd`` kernel instead of ``torch.library.custom_op``.

Both give torch.compile an opaque op with a fake (meta) implementation and registered autograd;
``custom_op`` also wraps every eager call in Python checks (output aliasing, kernel enable flags),
which cost more host time than the small GEMMs they guard. dtq's op bodies make their outputs
fresh, contiguous tensors themselves (``dtq.nn._ops._unaliased``), as the fake implementations say.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LIB = torch.library.Library("dtq", "FRAGMENT")  # module-level: the registrations live as long as dtq


def define(
    name: str, fn: Callable, fake: Callable, *, backward: Callable | None = None, setup_context: Callable | None = None
) -> torch._ops.OpOverload:
    """``torch.ops.dtq.<name>.default`` running ``fn`` (schema inferred from its annotations),
    ``fake`` for shape inference, and ``backward`` / ``setup_context`` as its autograd formula."""
    LIB.define(name + torch.library.infer_schema(fn, mutates_args=()))
    LIB.impl(name, fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"dtq::{name}", fake, lib=LIB)
    if backward is not None:
        torch.library.register_autograd(f"dtq::{name}", backward, setup_context=setup_context, lib=LIB)
    return getattr(torch.ops.dtq, name).default
