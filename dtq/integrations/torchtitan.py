"""dtq in torchtitan (0.3): a model converter and the hook that follows each optimizer step.

torchtitan builds models from a tree of configs and applies ``ModelConfigConverter``s to that
tree before it builds anything (on the meta device), then shards (``Module.parallelize``,
``fully_shard``), materializes and initializes. :class:`DtqConverter` replaces every Linear
config it may convert by a :class:`DtqLinear` config; the built :class:`DtqLinear` is a
``dtq.nn.Linear`` (so an ``nn.Linear``) and a torchtitan ``Module``, with the recipe bound as its
default (no ``dtq.autocast`` needed around the forward; one still overrides it). Its parameters
stay high precision (they are the master weights) and FSDP2 gathers them quantized; tensor
parallelism from torchtitan's sharding configs (DTensor weights ``Shard(0)`` / ``Shard(1)``)
runs the GEMMs quantized on the local shards, as torch's own ``ColwiseParallel`` /
``RowwiseParallel`` do on a ``dtq.nn.Linear``. :func:`post_optimizer_build_fn` (torchtitan's
``ModelSpec.post_optimizer_build_fn``) makes every optimizer step end with
``dtq.parallel.precompute_amax``: one all-reduce for all weight amaxes the next gathers need.

The lines a torchtitan config adds (a ``config_registry`` function)::

    from dtq.integrations.torchtitan import DtqConverter, post_optimizer_build_fn

    config.model_spec = model_registry("debugmodel", converters=[
        DtqConverter.Config(recipe="mxfp8", filter_fqns=["output"])])
    config.model_spec.post_optimizer_build_fn = post_optimizer_build_fn

Quantized parameters (``dtq.convert(..., quantized_params=True)``) need the weights' values
before ``fully_shard``; torchtitan creates them after it, so this converter keeps high-precision
parameters, and the optimizer needs no master weights.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module

from dtq.convert import FILTERED, ConvertReport
from dtq.nn.linear import Linear
from dtq.nn.module import QuantizedModule
from dtq.integrations._common import precompute_after_steps
from dtq.presets import recipe_from_name
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
            reason = reason or linear_problem(self.recipe, fqn, sub.out_features, sub.in_features,
                                              fsdp_world=self.fsdp_world)
            if reason is not None:
                skipped[fqn] = reason
                continue
            new = DtqLinear.Config(in_features=sub.in_features, out_features=sub.out_features, bias=sub.bias,
                                   param_init=sub.param_init, sharding_config=sub.sharding_config,
                                   recipe=cfg.recipe, name=fqn)
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


def post_optimizer_build_fn(optimizers: torch.optim.Optimizer, model_parts: list[torch.nn.Module],
                            parallel_dims: Any = None) -> None:
    """torchtitan's ``ModelSpec.post_optimizer_build_fn``: after every step of ``optimizers`` (an
    ``OptimizersContainer``), reduce the amaxes of all FSDP2-sharded dtq weights of
    ``model_parts`` in one all-reduce per process group (``dtq.parallel.precompute_amax``), so the
    next forward's all-gathers start without one collective per weight."""

    precompute = precompute_after_steps(optimizers, model_parts)
    precompute()  # the weights are initialized by now: the first step's gathers find their amaxes too


__all__ = ["DtqConverter", "DtqLinear", "post_optimizer_build_fn"]
