"""``dtq.convert``: swap ``torch.nn.Linear`` modules for ``dtq.nn.Linear`` in place."""

from __future__ import annotations

from typing import Callable

import torch

from dtq.formats import COLUMNWISE, ROWWISE
from dtq.nn.linear import Linear
from dtq.nn.module import QuantizedModule
from dtq.recipe import Recipe


def quantize_module_weights(module: QuantizedModule, recipe: Recipe) -> None:
    """Replace each GEMM weight of ``module`` by a QuantizedTensor parameter made by ``recipe``'s
    weight quantizer (both directions, or rowwise only under a backward override)."""
    if recipe is None:
        raise ValueError("quantized_params=True needs a recipe to quantize the weights with, e.g. "
                         "dtq.convert(model, recipe=dtq.MXFP8BlockScaling(), quantized_params=True)")
    weights = [n for n, p in module.named_parameters(recurse=False) if n.startswith(("weight", "fc1_weight", "fc2_weight"))]
    roles = [r for r in module.quantizer_roles() if r is not None and r.tensor_type == "weight"]
    for pname, role in zip(sorted(weights, key=_gemm_order), roles):
        q = recipe.quantizer(role)
        if q is None:
            continue
        w = getattr(module, pname)
        with torch.no_grad():
            qw = q.quantize(w, rowwise=True, columnwise=recipe.backward_override is None)
        setattr(module, pname, torch.nn.Parameter(qw, requires_grad=w.requires_grad))


def _gemm_order(pname: str):
    # weight0 < weight1 < ... ; fc1_weight < fc2_weight; plain "weight" alone.
    digits = "".join(c for c in pname if c.isdigit())
    return int(digits) if digits else 0


def convert(module: torch.nn.Module, *, recipe: Recipe | None = None, quantized_params: bool = False,
            module_filter_fn: Callable[[torch.nn.Module, str], bool] | None = None) -> torch.nn.Module:
    """Swap every ``torch.nn.Linear`` (exact type) for ``dtq.nn.Linear`` in place, keeping the same
    parameter objects, and name each new module by its fully qualified name (its roles' ``name``).
    ``module_filter_fn(module, fqn)`` returning False keeps a Linear as it is. With
    ``quantized_params=True`` the weights of every dtq module become QuantizedTensor parameters
    quantized by ``recipe``. Returns the module (a new one if ``module`` itself was a Linear)."""
    def swap(child: torch.nn.Linear, fqn: str) -> Linear:
        new = Linear(child.in_features, child.out_features, bias=child.bias is not None,
                     params_dtype=child.weight.dtype, device="meta", name=fqn)
        new.weight = child.weight
        new.bias = child.bias
        return new

    def keep(child, fqn):
        return type(child) is torch.nn.Linear and (module_filter_fn is None or module_filter_fn(child, fqn))

    if keep(module, ""):
        module = swap(module, "")
    else:
        for fqn, child in list(module.named_modules()):
            for cname, grandchild in list(child.named_children()):
                full = f"{fqn}.{cname}" if fqn else cname
                if keep(grandchild, full):
                    setattr(child, cname, swap(grandchild, full))
    if quantized_params:
        for m in module.modules():
            if isinstance(m, QuantizedModule):
                quantize_module_weights(m, recipe)
    return module
