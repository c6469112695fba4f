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
forward inside ``dtq.autocast`` (delayed scaling: with the data x context parallel group, and
under tensor parallelism every rank, as ``amax_group``), refuses quantized parameters stepped by
a plain optimizer, and ends every optimizer step with ``dtq.parallel.precompute_amax``.

Under tensor parallelism (``tensor_parallel_degree > 1``) a :class:`DtqLinear` runs the colwise /
rowwise sharding config torchtitan declares for it through dtq's own styles
(``dtq.parallel.ColwiseParallel`` / ``RowwiseParallel``, mapped by
:mod:`dtq.integrations._torchtitan_tp`): weights become DTensors on the TP mesh, the GEMMs run on
the local shards, and a sequence shard declared as the layer's input, or as a rowwise output's
destination, is gathered (the input; the output's gradient) quantized.

The lines a torchtitan config adds (a ``config_registry`` function)::

    from dtq.integrations.torchtitan import DtqConverter, post_optimizer_build_fn

    config.model_spec = model_registry("debugmodel", converters=[
        DtqConverter.Config(recipe="mxfp8", filter_fqns=["lm_head"])])
    config.model_spec.post_optimizer_build_fn = post_optimizer_build_fn
    config.parallelism.spmd_backend = "partial_dtensor"
    config.parallelism.tensor_parallel_degree = 2  # optional: run by dtq's styles

Not supported (refused, by name, when a :class:`DtqLinear` would meet them): the "full_dtensor" /
"spmd_types" backends, which distribute every parameter themselves; TP sharding configs that
dtq's styles cannot run (a rowwise output left partial, a colwise output gathered, ``local_map``,
...); a TP shard the recipe cannot quantize; delayed scaling under TP and pipeline parallelism
together. Quantized parameters need the weights' values before ``fully_shard`` and torchtitan
creates them after it, so this converter keeps high-precision parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import torch
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module

from dtq.autocast import autocast
from dtq.convert import FILTERED, ConvertReport
from dtq.integrations._common import check_master_weights, has_dtq_modules, precompute_after_steps
from dtq.integrations._torchtitan_tp import tp_style
from dtq.nn.linear import Linear
from dtq.nn.module import QuantizedModule
from dtq.presets import recipe_from_name
from dtq.recipe import Recipe
from dtq.shapes import linear_problem, shape_problems


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
        """torchtitan's config-driven sharding of this layer. Under "partial_dtensor" without tensor
        parallelism torchtitan leaves the weight to ``fully_shard``, whose gathers dtq quantizes;
        with it, the layer's colwise / rowwise sharding config is run by dtq's own style (see
        :mod:`dtq.integrations._torchtitan_tp`). The "full_dtensor" / "spmd_types" backends, which
        distribute every parameter themselves, are refused by name."""
        config = self._sharding_config
        backend = getattr(parallel_dims, "spmd_backend", "partial_dtensor")
        if config is not None and backend != "partial_dtensor":
            raise NotImplementedError(
                f"dtq.integrations.torchtitan: {self.name or 'a DtqLinear'} would be sharded by torchtitan's sharding "
                f"config (spmd_backend={backend!r}), which dtq does not support yet; set parallelism.spmd_backend = "
                "'partial_dtensor' (FSDP2 / HSDP shard the weight and gather it quantized, tensor parallelism runs "
                "dtq's styles), or keep the layer out with DtqConverter.Config(filter_fqns=[...])"
            )
        if config is None or not parallel_dims.tp_enabled:
            Module.parallelize(self, parallel_dims)
            return
        style = tp_style(config, self.name or "a DtqLinear", has_bias=self.bias is not None)
        self._check_tp_shapes(style, parallel_dims)
        self._sharding_config = None  # torchtitan's once-only guard runs, and finds nothing to shard itself
        try:
            Module.parallelize(self, parallel_dims)
        finally:
            self._sharding_config = config
        parallelize_module(self, parallel_dims.get_mesh("tp"), style)

    def _check_tp_shapes(self, style: Any, parallel_dims: Any) -> None:
        """The recipe must quantize this rank's TP shard of the weight (and FSDP2's rows of it):
        the converter checked the whole weight before torchtitan declared any sharding."""
        recipe = self.gemm_state.default_recipe
        problems = shape_problems(
            self,
            recipe,
            fsdp_world=parallel_dims.dp_shard * parallel_dims.cp,
            tp=parallel_dims.tp,
            tp_dims={id(self): style.weight_dims},
        )
        if problems:
            raise ValueError(
                f"dtq.integrations.torchtitan: under tensor_parallel_degree={parallel_dims.tp}, "
                f"{type(recipe).__name__} cannot quantize {problems[0]}; keep the layer out with "
                "DtqConverter.Config(filter_fqns=[...])"
            )


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
    with ``amax_group`` the data-parallel x context-parallel group, torchtitan's "loss" mesh, and
    under tensor parallelism every rank, so those ranks keep identical amax histories); every
    step of ``optimizers`` (an ``OptimizersContainer``) ends with ``dtq.parallel.precompute_amax``,
    so the next forward's FSDP2 all-gathers find their weight amaxes reduced in one all-reduce per
    process group.
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
    ranks (they run the same modules on different tokens) and, under tensor parallelism, the TP
    ranks too (they hold shares of the same weights and activations, and a sequence-parallel
    gather quantizes every rank's rows with the one scale the histories give); None for recipes
    without histories."""
    if not recipe.delayed:
        return None
    dist = torch.distributed
    if parallel_dims is not None and parallel_dims.tp_enabled:
        if parallel_dims.pp_enabled:
            raise NotImplementedError(
                f"dtq.integrations.torchtitan: {type(recipe).__name__} (delayed scaling) under tensor_parallel_degree="
                f"{parallel_dims.tp} and pipeline_parallel_degree={parallel_dims.pp} is not supported: its amax "
                "histories must agree over the data, context and tensor parallel ranks of each pipeline stage; use "
                "a current-scaling recipe (e.g. 'fp8', 'mxfp8') or no pipeline parallelism"
            )
        return dist.group.WORLD  # every rank runs the same modules
    if parallel_dims is not None:
        mesh = parallel_dims.get_optional_mesh("loss")
        return None if mesh is None else mesh.get_group()
    return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


__all__ = ["DtqConverter", "DtqLinear", "post_optimizer_build_fn"]
