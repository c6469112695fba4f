"""dtq in torchtitan (0.3): a model converter and the hook that follows each optimizer build.

torchtitan builds a model from a tree of configs. ``ModelConfigConverter``s rewrite that tree
before anything is built; the model is then built on the meta device, sharded, materialized and
initialized (``init_states``). :class:`DtqConverter` replaces each Linear config it can convert by
a :class:`DtqLinear` config (keeping its ``param_init``); the built :class:`DtqLinear` is a
``dtq.nn.Linear`` (so an ``nn.Linear``) and a torchtitan ``Module`` with the recipe bound as its
default, so it quantizes also where torchtitan calls it outside the model's forward (the chunked
loss calls ``lm_head`` itself). Its parameters stay high precision: they are the master weights,
and FSDP2 gathers them quantized.

:func:`post_optimizer_build_fn` (``ModelSpec.post_optimizer_build_fn``) runs each model part's
forward inside ``dtq.autocast`` (delayed scaling: with the data x context parallel group as
``amax_group``), refuses quantized parameters stepped by a plain optimizer, and ends every
optimizer step with ``dtq.parallel.precompute_amax``.

The lines a torchtitan config adds (a ``config_registry`` function)::

    from dtq.integrations.torchtitan import DtqConverter, post_optimizer_build_fn

    config.model_spec = model_registry("debugmodel", converters=[
        DtqConverter.Config(recipe="mxfp8", filter_fqns=["lm_head"])])
    config.model_spec.post_optimizer_build_fn = post_optimizer_build_fn
    config.parallelism.spmd_backend = "partial_dtensor"

Not supported (refused, by name, when a :class:`DtqLinear` would meet them): torchtitan's own
sharding of a layer's weight, i.e. tensor parallelism through its sharding configs and the
"full_dtensor" / "spmd_types" backends. Quantized parameters need the weights' values before
``fully_shard`` and torchtitan creates them after it, so this converter keeps high-precision
parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import torch
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module

from dtq.autocast import autocast
from dtq.convert import FILTERED, ConvertReport
from dtq.integrations._common import check_master_weights, has_dtq_modules, precompute_after_steps
from dtq.nn.linear import Linear
from dtq.nn.module import QuantizedModule
from dtq.presets import recipe_from_name
from dtq.recipe import Recipe
from dtq.shapes import linear_problem


class DtqLinear(Linear, Module):
    """A ``dtq.nn.Linear`` built from a torchtitan config, bound to the recipe the config names.
    Initialized by the config's ``param_init`` (torchtitan's per-parameter initializers), else by
    ``nn.Linear``'s ``reset_parameters``."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        in_features: int
        out_features: int
        bias: bool = False
        recipe: str = "mxfp8"
        """A ``dtq.presets`` name ("fp8", "mxfp8", "nvfp4", "hybrid", ...) or "package.module:function"."""
        name: str = ""
        """The module's fully qualified name (its quantizer roles' name)."""

    def __init__(self, config: Config):
        Linear.__init__(self, config.in_features, config.out_features, config.bias, name=config.name)
        recipe = recipe_from_name(config.recipe)
        recipe.key  # noqa: B018 - numbered in eager code, for compiled graphs
        self.gemm_state.default_recipe = recipe
        if recipe.delayed:  # its amax histories now, so a fresh model's state dict has their keys
            self.init_recipe_state(recipe)

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        """torchtitan's buffer initialization (after ``to_empty``): empty amax histories."""
        with torch.no_grad():
            for name, buf in self.named_buffers(recurse=False):
                if name.startswith("amax_history_"):
                    buf.zero_()

    def parallelize(self, parallel_dims: Any) -> None:
        """torchtitan's config-driven sharding of this layer's own weight (tensor parallelism, or
        the "full_dtensor" / "spmd_types" backends, which distribute every parameter themselves)
        is not wired to dtq's quantized layouts: refuse it, by name, rather than run it unchecked.
        Under "partial_dtensor" without tensor parallelism torchtitan leaves the weight to
        ``fully_shard``, whose gathers dtq quantizes."""
        backend = getattr(parallel_dims, "spmd_backend", "partial_dtensor")
        if self._sharding_config is not None and (backend != "partial_dtensor" or parallel_dims.tp_enabled):
            why = (
                f"tensor_parallel_degree={parallel_dims.tp}"
                if parallel_dims.tp_enabled
                else f"spmd_backend={backend!r}"
            )
            raise NotImplementedError(
                f"dtq.integrations.torchtitan: {self.name or 'a DtqLinear'} would be sharded by torchtitan's sharding "
                f"config ({why}), which dtq does not support yet; set parallelism.spmd_backend = 'partial_dtensor' "
                "and tensor_parallel_degree = 1 (FSDP2 / HSDP shard it, gathering quantized), or keep the layer "
                "out with DtqConverter.Config(filter_fqns=[...])"
            )
        Module.parallelize(self, parallel_dims)


def _convertible(cfg: Any) -> str | None:
    """Why a config's module must stay as it is (None: it is a plain Linear)."""
    owner = getattr(type(cfg), "_owner", None)
    if owner is None or not issubclass(owner, torch.nn.Linear) or issubclass(owner, QuantizedModule):
        return "not a Linear"
    if owner.forward is not torch.nn.Linear.forward:
        return f"its module {owner.__name__} defines its own forward, which a DtqLinear would drop"
    return None


class DtqConverter(ModelConfigConverter):
    """Replace the Linear configs of a torchtitan model config by :class:`DtqLinear` configs.

    Kept as they are (and logged, by full name): configs whose fully qualified name contains
    one of ``filter_fqns``, Linear subclasses with a forward of their own, and layers whose
    ``[out, in]`` weight the recipe cannot quantize or FSDP2 over ``fsdp_world`` ranks cannot shard
    (``strict=True`` raises instead)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        recipe: str = "mxfp8"
        """A ``dtq.presets`` name ("fp8", "fp8-block", "mxfp8", "nvfp4", "hybrid", ...) or
        "package.module:function" returning a dtq recipe."""
        filter_fqns: list[str] = dataclasses.field(default_factory=list)
        """Layers whose fully qualified name contains one of these stay as they are (e.g. "output")."""
        fsdp_world: int = 0
        """Ranks FSDP2 shards each weight over, for the shape check; 0: WORLD_SIZE (every rank)."""
        strict: bool = False
        """Raise, naming every layer the recipe cannot quantize, instead of keeping them."""

    def __init__(self, config: Config):
        self.config = config
        self.recipe = recipe_from_name(config.recipe)
        self.fsdp_world = config.fsdp_world or int(os.environ.get("WORLD_SIZE", "1"))

    def convert(self, model_config: Module.Config) -> Module.Config:
        cfg = self.config
        converted, skipped, swaps = [], {}, []
        for fqn, sub, parent, attr in model_config.traverse(Module.Config, recurse=True):
            if _convertible(sub) == "not a Linear":
                continue
            reason = f"{FILTERED} (filter_fqns)" if any(f in fqn for f in cfg.filter_fqns) else _convertible(sub)
            reason = reason or linear_problem(
                self.recipe, fqn, sub.out_features, sub.in_features, fsdp_world=self.fsdp_world
            )
            if reason is not None:
                skipped[fqn] = reason
                continue
            new = DtqLinear.Config(
                in_features=sub.in_features,
                out_features=sub.out_features,
                bias=sub.bias,
                param_init=sub.param_init,
                sharding_config=sub.sharding_config,
                recipe=cfg.recipe,
                name=fqn,
            )
            swaps.append((parent, attr, new))
            converted.append(fqn)
        report = ConvertReport(tuple(converted), skipped, self.recipe, self.fsdp_world)
        if cfg.strict:
            report.check("DtqConverter(strict=True)", "DtqConverter.Config(filter_fqns=[...])")
        report.log()
        for parent, attr, new in swaps:
            if parent is None:
                return new
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        return model_config


def _bound_recipe(part: torch.nn.Module) -> Recipe | None:
    """The one recipe the converter bound to ``part``'s dtq modules (None: it converted none)."""
    recipes = {
        m.gemm_state.default_recipe
        for m in part.modules()
        if isinstance(m, QuantizedModule) and m.gemm_state.default_recipe is not None
    }
    if len(recipes) > 1:
        raise ValueError(
            f"dtq.integrations.torchtitan: one model part holds dtq modules bound to {len(recipes)} "
            "recipes; apply one DtqConverter per model"
        )
    return next(iter(recipes), None)


def _autocast_forward(part: torch.nn.Module, recipe: Recipe, amax_group: Any) -> None:
    """Run ``part``'s forward (torchtitan's redistributing wrapper, where it set one) inside
    ``dtq.autocast(recipe, amax_group=...)``."""
    forward = part.forward

    @functools.wraps(forward)
    def forward_under_autocast(*args: Any, **kwargs: Any) -> Any:
        with autocast(recipe, amax_group=amax_group):
            return forward(*args, **kwargs)

    part.forward = forward_under_autocast


def post_optimizer_build_fn(
    optimizers: torch.optim.Optimizer, model_parts: list[torch.nn.Module], parallel_dims: Any = None
) -> None:
    """torchtitan's ``ModelSpec.post_optimizer_build_fn``. For each model part with dtq modules:
    its forward runs inside ``dtq.autocast`` of the converter's recipe (a delayed-scaling recipe
    with ``amax_group`` the data-parallel x context-parallel group, torchtitan's "loss" mesh, so
    those ranks keep identical amax histories); every step of ``optimizers`` (an
    ``OptimizersContainer``) ends with ``dtq.parallel.precompute_amax``, so the next forward's
    FSDP2 all-gathers find their weight amaxes reduced in one all-reduce per process group.
    Quantized parameters stepped by a plain optimizer are refused (updates would round away)."""
    parts = [p for p in model_parts if has_dtq_modules(p)]
    for part in parts:
        check_master_weights("dtq.integrations.torchtitan", part, list(optimizers))
        recipe = _bound_recipe(part)
        if recipe is not None:
            _autocast_forward(part, recipe, _amax_group(recipe, parallel_dims))
    precompute = precompute_after_steps(optimizers, parts)
    precompute()  # the weights are initialized by now: the first step's gathers find their amaxes too


def _amax_group(recipe: Recipe, parallel_dims: Any) -> Any:
    """Where delayed-scaling amax histories are kept identical: the data x context parallel
    ranks (they run the same modules on different tokens); None for recipes without histories."""
    if not recipe.delayed:
        return None
    if parallel_dims is not None:
        mesh = parallel_dims.get_optional_mesh("loss")
        return None if mesh is None else mesh.get_group()
    dist = torch.distributed
    return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


__all__ = ["DtqConverter", "DtqLinear", "post_optimizer_build_fn"]
