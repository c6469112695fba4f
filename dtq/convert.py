"""``dtq.convert``: swap ``torch.nn.Linear`` modules for ``dtq.nn.Linear`` in place."""

from __future__ import annotations

from typing import Callable

import torch

from dtq.checkpoint.state_dict import make_loading_atomic
from dtq.nn.linear import Linear
from dtq.nn.module import QuantizedModule, as_weight
from dtq.recipe import Recipe


def quantize_module_weights(module: QuantizedModule, recipe: Recipe, memo: dict | None = None) -> None:
    """Replace each GEMM weight of ``module`` by a QuantizedTensor parameter made by ``recipe``'s
    weight quantizer (both directions, or rowwise only under a backward override). ``memo`` maps
    an original parameter to its replacement, so tied weights stay tied."""
    if recipe is None:
        raise ValueError("quantized_params=True needs a recipe to quantize the weights with, e.g. "
                         "dtq.convert(model, recipe=dtq.MXFP8BlockScaling(), quantized_params=True)")
    memo = {} if memo is None else memo
    for pname in module.weight_names():
        w = getattr(module, pname)
        if id(w) in memo:
            setattr(module, pname, memo[id(w)])
            continue
        q = module.weight_quantizer(pname, recipe)
        if q is None:
            continue
        with torch.no_grad():
            qw = _quantize_weight(q, w, columnwise=recipe.backward_override is None,
                                  name=f"{module.name or type(module).__name__}.{pname}")
        memo[id(w)] = torch.nn.Parameter(qw, requires_grad=w.requires_grad)
        setattr(module, pname, memo[id(w)])


def _quantize_weight(q, w: torch.Tensor, columnwise: bool, name: str) -> torch.Tensor:
    """Quantize a weight; a tensor-parallel (DTensor) weight shard by shard, with its amaxes
    reduced over the mesh so that every shard is the slice of the whole tensor's quantization."""
    if not hasattr(w, "device_mesh"):
        return q.quantize(w, rowwise=True, columnwise=columnwise)
    from torch.distributed.tensor import DTensor

    from dtq.parallel.amax import check_column_shards, sharded_dims
    from dtq.parallel.tp import reduce_amax

    check_column_shards(q, w, name)
    local = w._local_tensor
    local = local.__dtq_unwrap__() if hasattr(local, "__dtq_unwrap__") else local
    amax = q.local_amax(local, rowwise=True, columnwise=columnwise)
    for mesh_dim, dim in sharded_dims(w):
        if amax:
            amax = reduce_amax(q, local, w.device_mesh.get_group(mesh_dim), rowwise=True, columnwise=columnwise,
                               amax=amax, dim=dim)
    qt = q.quantize(local, rowwise=True, columnwise=columnwise, amax=amax or None)
    return DTensor.from_local(qt, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride())


def convert(module: torch.nn.Module, *, recipe: Recipe | None = None, quantized_params: bool = False,
            module_filter_fn: Callable[[torch.nn.Module, str], bool] | None = None) -> torch.nn.Module:
    """Swap every ``torch.nn.Linear`` (exact type) for ``dtq.nn.Linear`` in place and name each new
    module by its fully qualified name (its roles' ``name``). The converted module keeps the
    weight values (a new high-precision parameter whose FSDP2 all-gather is quantized: build the
    optimizer after converting), the same bias parameter, hooks and train/eval mode; a Linear
    reachable under two names is converted once. ``module_filter_fn(module, fqn)`` returning
    False keeps a Linear as it is. ``quantized_params=True`` makes the weights of every dtq module
    QuantizedTensor parameters quantized by ``recipe`` (tied weights stay tied). The returned
    model's ``load_state_dict`` checks every dtq weight before loading any. A ``recipe`` that keeps
    per-module state (``DelayedScaling``) gets it now, also without ``quantized_params``, so a
    fresh model's state dict has the keys ``torch.distributed.checkpoint.load`` must fill. Returns
    the module (a new one if ``module`` itself was a Linear)."""
    if recipe is not None and not quantized_params and not recipe.delayed:
        raise ValueError(f"dtq.convert(recipe=...) quantizes weights (quantized_params=True) or creates the per-module "
                         f"state of a recipe that keeps one (DelayedScaling's amax histories); {type(recipe).__name__} "
                         "keeps none, so without quantized_params choose it at run time with dtq.autocast(recipe)")
    swapped: dict[int, Linear] = {}
    weights: dict[int, torch.nn.Parameter] = {}

    def swap(child: torch.nn.Linear, fqn: str) -> Linear:
        if id(child) not in swapped:
            new = Linear(child.in_features, child.out_features, bias=child.bias is not None,
                         params_dtype=child.weight.dtype, device="meta", name=fqn)
            if id(child.weight) not in weights:
                weights[id(child.weight)] = as_weight(child.weight, requires_grad=child.weight.requires_grad)
            new.weight = weights[id(child.weight)]
            new.bias = child.bias
            new.train(child.training)
            for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
                getattr(new, hooks).update(getattr(child, hooks))
            swapped[id(child)] = new
        return swapped[id(child)]

    def keep(child, fqn):
        return type(child) is torch.nn.Linear and (module_filter_fn is None or module_filter_fn(child, fqn))

    if keep(module, ""):
        module = swap(module, "")
    else:
        for fqn, parent in list(module.named_modules(remove_duplicate=False)):
            for cname, child in list(parent._modules.items()):  # every name, duplicates included
                full = f"{fqn}.{cname}" if fqn else cname
                if child is not None and keep(child, full):
                    setattr(parent, cname, swap(child, full))
    if quantized_params:
        memo: dict = {}
        for m in module.modules():
            if isinstance(m, QuantizedModule):
                quantize_module_weights(m, recipe, memo)
    elif recipe is not None:
        for m in module.modules():
            if isinstance(m, QuantizedModule):
                m.init_recipe_state(recipe)
    make_loading_atomic(module)
    return module
