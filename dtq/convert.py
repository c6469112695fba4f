"""``dtq.convert``: swap ``torch.nn.Linear`` modules for ``dtq.nn.Linear`` in place, skip (and
report) the layers a recipe cannot hold, and bind the recipe as the model's default."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Literal, overload

import torch

from dtq.checkpoint.state_dict import make_loading_atomic
from dtq.codec import wanted_directions
from dtq.nn.linear import Linear
from dtq.nn.module import QuantizedModule, as_weight
from dtq.recipe import Recipe
from dtq.shapes import linear_problem
from dtq.size_rule import SMALL, SizeRule
from dtq.tensor_ops import zero_quantized
from dtq.weights import local_data

log = logging.getLogger("dtq")

FILTERED = "left out by the filter"  # a skip the user asked for (not refused)


@dataclasses.dataclass(frozen=True)
class ConvertReport:
    """What ``dtq.convert`` did. ``converted``: the fully qualified names of the Linear layers it
    swapped; ``skipped``: every other ``nn.Linear`` (subclasses included) by name, with why it was
    kept as it is; ``recipe``: what shapes were checked against and bound (None: not checked);
    ``fsdp_world``: the FSDP2 shard count the weights were checked for."""

    converted: tuple[str, ...]
    skipped: Mapping[str, str]
    recipe: Recipe | None = None
    fsdp_world: int = 1

    @property
    def refused(self) -> dict[str, str]:
        """The skipped layers that dtq could not convert (not the ones ``module_filter_fn`` or the
        size rule kept)."""
        return {k: v for k, v in self.skipped.items() if not v.startswith((FILTERED, SMALL))}

    def check(self, who: str, how_to_filter: str) -> None:
        """Raise ValueError naming every layer that could not be converted (strict mode)."""
        if self.refused:
            raise ValueError(
                f"{who}: these Linear layers cannot be converted:\n  "
                + "\n  ".join(f"{k or '<root>'}: {v}" for k, v in self.refused.items())
                + f"\nLeave them out with {how_to_filter}, or convert without strict to keep and "
                "report them"
            )

    def log(self) -> None:
        """Log the summary (logger "dtq"): a warning when a layer was kept for a reason, else info."""
        (log.warning if self.refused else log.info)("%s", self)

    def __str__(self) -> str:
        if self.recipe is None:
            checked = "shapes not checked: no recipe given"
        else:
            checked = f"shapes checked against {type(self.recipe).__name__}" + (
                f" and FSDP2 over {self.fsdp_world} ranks" if self.fsdp_world > 1 else ""
            )
        lines = [
            f"dtq.convert: converted {len(self.converted)} Linear layers, kept {len(self.skipped)} as they are "
            f"({checked})"
        ]
        lines += [f"  kept {fqn or '<root>'}: {why}" for fqn, why in self.skipped.items()]
        return "\n".join(lines)


def quantize_module_weights(
    module: QuantizedModule, recipe: Recipe, memo: dict | None = None, fqn: str | None = None
) -> None:
    """Replace each GEMM weight of ``module`` by a QuantizedTensor parameter made by ``recipe``'s
    weight quantizer (both directions, or rowwise only under a backward override); a module that
    ``dtq.apply_size_rule`` keeps in high precision keeps its weights. A weight on the meta device
    becomes zero payloads of its layout, for the values to be cast in once they exist (torchtitan's
    ``init_states``, after ``fully_shard`` and ``to_empty``). ``memo`` maps
    an original parameter to its replacement, so tied weights stay tied. ``fqn``: the module's
    name in the model, for messages (default: its own name)."""
    if recipe is None:
        raise ValueError(
            "quantized_params=True needs a recipe to quantize the weights with, e.g. "
            "dtq.convert(model, recipe=dtq.MXFP8BlockScaling(), quantized_params=True)"
        )
    memo = {} if memo is None else memo
    prefix = fqn or module.name
    if module.gemm_state.high_precision is not None:
        return  # kept in high precision by a size rule: its weights stay the master weights
    for pname in module.weight_names():
        w = getattr(module, pname)
        if id(w) in memo:
            setattr(module, pname, memo[id(w)])
            continue
        q = module.weight_quantizer(pname, recipe)
        if q is None:
            continue
        with torch.no_grad():
            qw = _quantize_weight(
                q,
                w,
                columnwise=recipe.backward_override is None,
                name=f"{prefix}.{pname}" if prefix else f"{type(module).__name__}.{pname}",
            )
        memo[id(w)] = torch.nn.Parameter(qw, requires_grad=w.requires_grad)
        setattr(module, pname, memo[id(w)])


def _quantize_weight(q, w: torch.Tensor, columnwise: bool, name: str) -> torch.Tensor:
    """Quantize a weight; a tensor-parallel (DTensor) weight shard by shard, with its amaxes
    reduced over the mesh so that every shard is the slice of the whole tensor's quantization."""
    try:
        if w.device.type == "meta" and not hasattr(w, "device_mesh"):
            return _meta_quantized(q, w, columnwise)
        if not hasattr(w, "device_mesh"):
            return q.quantize(w, rowwise=True, columnwise=columnwise)
        return _quantize_sharded(q, w, columnwise, name)
    except ValueError as e:
        if name in str(e):
            raise
        raise ValueError(
            f"dtq.convert(quantized_params=True): cannot quantize {name} (shape {list(w.shape)}): {e} "
            "Leave its layer out (module_filter_fn), or convert with a recipe first so dtq.convert "
            "skips and reports the layers it cannot hold"
        ) from e


def _meta_quantized(q, w: torch.Tensor, columnwise: bool) -> torch.Tensor:
    """A meta-device weight (a model built on the meta device, values created after sharding)
    becomes a meta QuantizedTensor of the same layout, so that ``fully_shard`` shards the quantized
    parameter; its payloads are written from the values once they exist."""
    return zero_quantized(q, tuple(w.shape), w.dtype, w.device, wanted_directions(True, columnwise))


def _quantize_sharded(q, w: torch.Tensor, columnwise: bool, name: str) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    from dtq.distributed.amax import check_column_shards, reduce_over_shards, sharded_amax, sharded_dims

    check_column_shards(q, w, name)
    local = local_data(w)
    shards = [(w.device_mesh.get_group(mesh_dim), dim) for mesh_dim, dim in sharded_dims(w)]

    def reduce(amax: dict) -> dict:
        for group, dim in shards:
            amax = reduce_over_shards(amax, group, dim)
        return amax

    amax = sharded_amax(q, local, reduce, rowwise=True, columnwise=columnwise)
    qt = q.quantize(local, rowwise=True, columnwise=columnwise, amax=amax or None)
    return DTensor.from_local(qt, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride())


def _default_fsdp_world() -> int:
    """Without ``fsdp_world=``: the default process group's size (FSDP2 over every rank), else 1."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


_LINEAR_STATE = frozenset(vars(torch.nn.Linear(1, 1, device="meta")))


def _unsafe(child: torch.nn.Linear, parent: torch.nn.Module, cname: str) -> str | None:
    """Why swapping this ``nn.Linear`` (or subclass) for a ``dtq.nn.Linear`` would change what the
    model computes, or None when it is safe."""
    if isinstance(parent, torch.nn.MultiheadAttention) and cname == "out_proj":
        return (
            "nn.MultiheadAttention computes with out_proj's weight itself (F.multi_head_attention_forward) "
            "and never calls its forward: a dtq Linear there would not quantize anything"
        )
    if hasattr(child.weight, "device_mesh"):
        return (
            "its weight is already a DTensor (sharded before dtq.convert): convert first, then apply "
            "dtq.parallel's tensor-parallel styles and fully_shard"
        )
    if type(child) is torch.nn.Linear:
        return None
    cls = type(child).__name__
    own = [
        k
        for c in type(child).__mro__[: type(child).__mro__.index(torch.nn.Linear)]
        for k in vars(c)
        if not k.startswith("__") or k == "__call__"
    ]
    if own:
        return f"its type {cls} (an nn.Linear subclass) defines {sorted(set(own))}, which a dtq.nn.Linear would drop"
    extra = sorted(set(vars(child)) - _LINEAR_STATE) + [n for n, _ in child.named_children()]
    extra += [n for n, _ in child.named_parameters(recurse=False) if n not in ("weight", "bias")]
    extra += [n for n, _ in child.named_buffers(recurse=False)]
    if extra:
        return f"its type {cls} (an nn.Linear subclass) carries state nn.Linear has not: {sorted(set(extra))}"
    return None


def _size_rule(size_rule, recipe: Recipe | None) -> SizeRule | None:
    if size_rule is None or isinstance(size_rule, SizeRule):
        return size_rule
    if size_rule != "auto":
        raise ValueError(
            f"dtq.convert: size_rule={size_rule!r}; pass a dtq.SizeRule, 'auto' (the rule measured for the "
            "recipe on this device) or None"
        )
    if recipe is None:
        raise ValueError(
            "dtq.convert(size_rule='auto') needs the recipe the rule is measured for, e.g. "
            "dtq.convert(model, recipe=dtq.Float8CurrentScaling(), size_rule='auto')"
        )
    return SizeRule.measured(recipe)


@overload
def convert(
    module: torch.nn.Module,
    *,
    recipe: Recipe | None = ...,
    quantized_params: bool = ...,
    module_filter_fn: Callable[[torch.nn.Module, str], bool] | None = ...,
    strict: bool = ...,
    fsdp_world: int | None = ...,
    size_rule: SizeRule | Literal["auto"] | None = ...,
    report: Literal[False] = ...,
) -> torch.nn.Module: ...


@overload
def convert(
    module: torch.nn.Module,
    *,
    recipe: Recipe | None = ...,
    quantized_params: bool = ...,
    module_filter_fn: Callable[[torch.nn.Module, str], bool] | None = ...,
    strict: bool = ...,
    fsdp_world: int | None = ...,
    size_rule: SizeRule | Literal["auto"] | None = ...,
    report: Literal[True],
) -> tuple[torch.nn.Module, ConvertReport]: ...


def convert(
    module,
    *,
    recipe=None,
    quantized_params=False,
    module_filter_fn=None,
    strict=False,
    fsdp_world=None,
    size_rule=None,
    report=False,
):
    """Swap every ``torch.nn.Linear`` for a ``dtq.nn.Linear`` in place and name each new module by
    its fully qualified name (its roles' ``name``). The converted module keeps the weight values
    (a new high-precision parameter whose FSDP2 all-gather is quantized: build the optimizer after
    converting), the same bias parameter, hooks and train/eval mode; a Linear reachable under two
    names is converted once. ``module_filter_fn(module, fqn)`` returning False keeps a Linear.

    Kept, and reported, are layers a swap would change: ``nn.Linear`` subclasses that add methods
    or state, ``nn.MultiheadAttention.out_proj`` (its parent never calls it), weights already
    sharded as DTensors; and, given a ``recipe``, layers whose weight ``[N, K]`` the recipe's
    formats cannot block, or whose FSDP2 shards over ``fsdp_world`` ranks (default: the default
    process group's size, 1 without one) would split a block. Given a ``size_rule``
    (``dtq.SizeRule``, or ``"auto"``: ``dtq.SizeRule.measured(recipe)``, measured at 8192 tokens
    per GEMM on the current device), Linears too small to gain from quantization are kept too
    (reported, not refused). ``strict=True`` raises instead,
    naming every such layer. The summary is logged (logger "dtq": a warning when a layer was
    kept for a reason, else info); ``report=True`` also returns it: ``(module, ConvertReport)``.

    ``recipe`` becomes the model's default: every dtq module in it quantizes under it outside
    ``dtq.autocast`` (an active autocast, ``enabled=False`` included, overrides it). A recipe that
    keeps per-module state (``DelayedScaling``) gets it now, so a fresh model's state dict has the
    keys ``torch.distributed.checkpoint.load`` must fill. ``quantized_params=True`` makes the
    weights of every dtq module QuantizedTensor parameters quantized by ``recipe`` (tied weights
    stay tied). The returned model's ``load_state_dict`` checks every dtq weight before loading
    any. Returns the module (a new one if ``module`` itself was a Linear)."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(
            f"dtq.convert(recipe=...) takes a dtq recipe (e.g. dtq.MXFP8BlockScaling()), got {type(recipe).__name__}"
        )
    rule = _size_rule(size_rule, recipe)
    world = _default_fsdp_world() if fsdp_world is None else fsdp_world
    if world < 1:
        raise ValueError(f"dtq.convert: fsdp_world={fsdp_world} must be >= 1")
    swapped: dict[int, Linear] = {}
    weights: dict[int, torch.nn.Parameter] = {}
    converted: list[str] = []
    skipped: dict[str, str] = {}

    def swap(child: torch.nn.Linear, fqn: str) -> Linear:
        if id(child) not in swapped:
            new = Linear(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                params_dtype=child.weight.dtype,
                device="meta",
                name=fqn,
            )
            if id(child.weight) not in weights:
                weights[id(child.weight)] = as_weight(child.weight, requires_grad=child.weight.requires_grad)
            new.weight = weights[id(child.weight)]
            new.bias = child.bias
            new.train(child.training)
            for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
                getattr(new, hooks).update(getattr(child, hooks))
            swapped[id(child)] = new
            converted.append(fqn)
        return swapped[id(child)]

    def why_not(child, parent, cname: str, fqn: str) -> str | None:
        if id(child) in swapped:
            return None
        if module_filter_fn is not None and not module_filter_fn(child, fqn):
            return f"{FILTERED} (module_filter_fn)"
        reason = _unsafe(child, parent, cname)
        if reason is None and recipe is not None:
            reason = linear_problem(recipe, fqn, child.out_features, child.in_features, fsdp_world=world)
        if reason is None and rule is not None:
            reason = rule.why_small(child.out_features, child.in_features)
        return reason

    def candidate(child) -> bool:
        return isinstance(child, torch.nn.Linear) and not isinstance(child, QuantizedModule)

    if candidate(module):
        reason = why_not(module, None, "", "")
        if reason is None:
            module = swap(module, "")
        else:
            skipped[""] = reason
    else:
        named = list(module.named_modules(remove_duplicate=False))  # every name, duplicates included, in order
        modules = dict(named)
        for full, child in named:
            if not full or not candidate(child):
                continue
            parent_name, _, cname = full.rpartition(".")
            parent = modules[parent_name]
            reason = why_not(child, parent, cname, full)
            if reason is None:
                setattr(parent, cname, swap(child, full))
            elif full not in skipped:
                skipped[full] = reason
    result = ConvertReport(tuple(converted), dict(skipped), recipe, world)
    if strict:
        result.check("dtq.convert(strict=True)", "module_filter_fn (e.g. lambda m, fqn: fqn not in {...})")
    result.log()
    if recipe is not None:
        recipe.key  # noqa: B018 - numbered now, in eager code: compiled graphs read it without side effects
        for m in module.modules():
            if isinstance(m, QuantizedModule):
                m.gemm_state.default_recipe = recipe
    if quantized_params:
        memo: dict = {}
        for fqn, m in module.named_modules():
            if isinstance(m, QuantizedModule):
                quantize_module_weights(m, recipe, memo, fqn=fqn)
    elif recipe is not None and recipe.delayed:
        for m in module.modules():
            if isinstance(m, QuantizedModule):
                m.init_recipe_state(recipe)
    make_loading_atomic(module)
    return (module, result) if report else module
