"""dtq's ``torch.library`` operators, defined with ``Library.define`` + one
``CompositeExplicitAutograd`` kernel instead of ``torch.library.custom_op``.

Both give torch.compile an opaque op with a fake (meta) implementation and registered autograd;
``custom_op`` also wraps every eager call in Python checks (output aliasing, kernel enable flags),
which cost more host time than the small GEMMs they guard. dtq's op bodies make their outputs
fresh, contiguous tensors themselves (``dtq.nn._ops._unaliased``), as the fake implementations say.

An op with an autograd formula is two ops: ``dtq::<name>``, whose Autograd kernel applies the
formula, and ``dtq::<name>_fw``, the computation alone, which that kernel calls. AOTAutograd traces
through the Autograd kernel, so compiled graphs call ``<name>_fw``: its autograd key is torch's C++
fall-through, where ``torch.library.register_autograd``'s Python kernel (a dataclass, a
``redispatch`` and a context manager) would run on every call a compiled graph makes (6.3 against
3.0 µs of dispatch per call, timed on a CPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LIB = torch.library.Library("dtq", "FRAGMENT")  # module-level: the registrations live as long as dtq


def define(
    name: str,
    fn: Callable,
    fake: Callable,
    *,
    backward: Callable | None = None,
    setup_context: Callable | None = None,
    tags: tuple[torch.Tag, ...] = (),
) -> torch._ops.OpOverload:
    """``torch.ops.dtq.<name>.default`` running ``fn`` (schema inferred from its annotations),
    ``fake`` for shape inference, and ``backward`` / ``setup_context`` as its autograd formula
    (``backward(ctx, grads)``: ``grads`` a list, one per output; it returns one gradient per input,
    a list input's as a list or None; ``grads`` is one tensor for an op returning one). With a
    formula, the op the graphs call is :func:`forward_op`. ``tags``: the op's (e.g. inductor's
    layout constraint on its inputs)."""
    schema = torch.library.infer_schema(fn, mutates_args=())
    LIB.define(name + schema, tags=tags)
    LIB.impl(name, fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"dtq::{name}", fake, lib=LIB)
    op = getattr(torch.ops.dtq, name).default
    if backward is None:
        return op
    inner = define(name + "_fw", fn, fake)
    returns_list = op._schema.returns[0].type.kind() == "ListType"
    fn_class = _autograd_function(name, inner, backward, setup_context, returns_list)

    def autograd_kernel(*args):
        if torch.is_grad_enabled() and _any_requires_grad(args):
            out = fn_class.apply(*args)
            return list(out) if returns_list else out
        return inner(*args)

    LIB.impl(name, autograd_kernel, "Autograd")
    _FORWARD[op] = inner
    return op


_FORWARD: dict = {}


def forward_op(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """The op compiled graphs call for ``op`` (its ``_fw`` op if it has an autograd formula)."""
    return _FORWARD.get(op, op)


def _any_requires_grad(args: tuple) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                return True
        elif isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.requires_grad for t in a):
            return True
    return False


def _autograd_function(name: str, inner, backward: Callable, setup_context: Callable | None, returns_list: bool):
    """The ``torch.autograd.Function`` of ``dtq::<name>``: forward runs ``inner``; a list output
    travels as a tuple (a Function's outputs are tensors), and the formula's list gradients of list
    inputs as None (a Function's non-tensor inputs take none)."""

    def forward(*args):
        out = inner(*args)
        return tuple(out) if isinstance(out, list) else out

    def setup(ctx, inputs, output):
        if setup_context is not None:
            setup_context(ctx, inputs, list(output) if isinstance(output, tuple) else output)

    def grad(ctx, *grads):
        result = backward(ctx, list(grads)) if returns_list else backward(ctx, *grads)
        result = result if isinstance(result, tuple) else (result,)
        return tuple(None if isinstance(g, list) else g for g in result)

    return type(
        f"DtqOp_{name}",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "setup_context": staticmethod(setup), "backward": staticmethod(grad)},
    )
