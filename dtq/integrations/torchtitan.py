"""dtq in torchtitan (0.3): a model converter and the hook that follows each optimizer build.

torchtitan builds a model from a tree of configs. ``ModelConfigConverter``s rewrite that tree
before anything is built; the model is then built on the meta device, sharded, materialized and
initialized (``init_states``). :class:`DtqConverter` replaces each Linear config it can convert by
a :class:`DtqLinear` config (keeping its ``param_init``); the built :class:`DtqLinear` is a
``dtq.nn.Linear`` (so an ``nn.Linear``) and a torchtitan ``Module`` with the recipe bound as its
default, so it quantizes also where torchtitan calls it outside the model's forward (the chunked
loss calls ``lm_head`` itself). By default its parameters stay high precision: they are the
master weights. ``DtqConverter.Config(quantized_gather=...)``: True, FSDP2 gathers them quantized;
False (torchao's ``enable_fsdp_float8_all_gather=False``), they are plain parameters that FSDP2
gathers unquantized, each GEMM quantizing the gathered weight (``dtq.parallel.gather_high_precision``);
"auto" (the default), quantized only where the job's ranks run on several hosts
(``dtq.parallel.resolve_quantized_gather``).

With ``DtqConverter.Config(quantized_params=True)`` each :class:`DtqLinear` weight is a dtq
quantized parameter (what ``dtq.convert(quantized_params=True)`` makes): created on the meta
device as a QuantizedTensor of zero payloads, so ``fully_shard`` shards the payloads; after
``to_empty``, ``init_states`` initializes a high-precision tensor of the same sharding
(``param_init``, else ``nn.Linear``'s default) and casts it into the payloads with
``dtq.parallel.quantize_master_weights`` (per-tensor amaxes reduced over the FSDP2 shards): the
payloads are bitwise the quantization of the whole initial weight. Such weights are stepped by
:class:`MasterWeightOptimizersContainer` (torchtitan's optimizer container, each optimizer a
``dtq.optim.MasterWeightOptimizer``), which torchtitan's checkpointer saves with the masters.

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

and for quantized parameters (not with tensor parallelism)::

    from dtq.integrations.torchtitan import master_weight_optimizers

    config.model_spec = model_registry("debugmodel", converters=[
        DtqConverter.Config(recipe="mxfp8", filter_fqns=["lm_head"], quantized_params=True)])
    config.optimizer = master_weight_optimizers(config.optimizer)

Not supported (refused, by name, when a :class:`DtqLinear` would meet them): the "full_dtensor" /
"spmd_types" backends, which distribute every parameter themselves; TP sharding configs that
dtq's styles cannot run (a rowwise output left partial, a colwise output gathered, ``local_map``,
...); a TP shard the recipe cannot quantize; delayed scaling under TP and pipeline parallelism
together; quantized parameters under tensor parallelism; quantized parameters stepped by a plain
optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module

from dtq._torch_private import local_tensor
from dtq.autocast import autocast
from dtq.convert import FILTERED, ConvertReport, quantize_module_weights
from dtq.integrations._common import (
    check_gather_settings,
    check_master_weights,
    has_dtq_modules,
    precompute_after_steps,
)
from dtq.integrations._torchtitan_tp import tp_style
from dtq.nn.linear import Linear
from dtq.nn.module import QuantizedModule
from dtq.optim import MasterWeightOptimizer, _is_quantized
from dtq.parallel.fsdp import gather_high_precision, resolve_quantized_gather
from dtq.parallel.master import quantize_master_weights
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
        quantized_params: bool = False
        """Store the weight as a dtq quantized parameter (``dtq.convert(quantized_params=True)``'s)."""
        quantized_gather: bool | Literal["auto"] = "auto"
        """False: a plain weight parameter, gathered unquantized by FSDP2 and quantized by the GEMM;
        "auto": False unless the job's ranks run on several hosts (``dtq.parallel.resolve_quantized_gather``)."""

    def __init__(self, config: Config):
        Linear.__init__(self, config.in_features, config.out_features, config.bias, name=config.name)
        recipe = recipe_from_name(config.recipe)
        recipe.key  # noqa: B018 - numbered in eager code, for compiled graphs
        self.gemm_state.default_recipe = recipe
        if recipe.delayed:  # its amax histories now, so a fresh model's state dict has their keys
            self.init_recipe_state(recipe)
        who = f"dtq.integrations.torchtitan: {config.name or 'a DtqLinear'}"
        check_gather_settings(who, config.quantized_params, config.quantized_gather)
        if config.quantized_params:  # on the meta device: zero payloads, written by init_states
            quantize_module_weights(self, recipe, fqn=config.name)
        if not resolve_quantized_gather(config.quantized_gather, quantized_params=config.quantized_params):
            gather_high_precision(self)

    # torchtitan's checkpointer (ModelWrapper) takes every state-dict value for a tensor, which the
    # extra state (a dict recording each quantized weight's format) is not; the payload entries'
    # keys name the format too (a digest of its settings), so loading another format still stops.
    get_extra_state = torch.nn.Module.get_extra_state
    set_extra_state = torch.nn.Module.set_extra_state

    def _init_self_parameters(self) -> None:
        """torchtitan's parameter initialization (after ``to_empty``). A quantized weight cannot be
        initialized in place (its payloads are codes, and an FSDP2 shard holds a part of a
        per-tensor scale's tensor), so a high-precision tensor of the same sharding is initialized
        instead (``param_init``, else ``nn.Linear``'s default) and cast into the payloads by the
        routine ``MasterWeightOptimizer`` casts its masters with: per-tensor amaxes are reduced
        over the shards, so the payloads are bitwise the quantization of the whole weight."""
        quantized = {n: p for n, p in self._parameters.items() if p is not None and _is_quantized(p)}
        if not quantized:
            Module._init_self_parameters(self)
            return
        masters = {n: _high_precision_like(p) for n, p in quantized.items()}
        self._parameters.update(masters)
        try:
            Module._init_self_parameters(self)
        finally:
            self._parameters.update(quantized)
        _cast_into(list(quantized.values()), list(masters.values()))

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
        if config is not None and parallel_dims.tp_enabled and any(_is_quantized(p) for p in self.parameters()):
            raise NotImplementedError(
                f"dtq.integrations.torchtitan: {self.name or 'a DtqLinear'} holds a quantized parameter "
                f"(DtqConverter.Config(quantized_params=True)) and would be tensor-parallelized "
                f"(tensor_parallel_degree={parallel_dims.tp}), which the torchtitan integration does not support: "
                "use quantized_params=False under tensor parallelism (high-precision master weights, gathered and "
                "multiplied quantized), or keep the layer out with DtqConverter.Config(filter_fqns=[...])"
            )
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


def _high_precision_like(p: torch.Tensor) -> torch.nn.Parameter:
    """An uninitialized high-precision tensor sharded as the quantized parameter ``p`` is (a
    DTensor on its mesh and placements under FSDP2), for ``param_init`` to fill."""
    local = local_tensor(p)
    data = torch.empty(local.shape, dtype=p.dtype, device=local.device)
    if isinstance(p, DTensor):
        data = DTensor.from_local(data, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return torch.nn.Parameter(data, requires_grad=False)


@torch.no_grad()
def _cast_into(params: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
    """Quantize each master into its parameter's payloads: FSDP2 shards with their amaxes reduced
    over the mesh (``quantize_master_weights``); a whole weight without a collective (``copy_``
    requantizes it), since ranks of different pipeline stages hold different weights."""
    sharded = [(p, local_tensor(m)) for p, m in zip(params, masters) if isinstance(p, DTensor)]
    for p, m in zip(params, masters):
        if not isinstance(p, DTensor):
            p.copy_(m)
    if sharded:
        quantize_master_weights(*zip(*sharded))


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
        quantized_params: bool = False
        """Store the converted weights as dtq quantized parameters (FSDP2 shards and gathers their
        payloads); step them with :class:`MasterWeightOptimizersContainer`."""
        quantized_gather: bool | Literal["auto"] = "auto"
        """False: plain high-precision weights, which FSDP2 gathers unquantized and each GEMM
        quantizes (torchao's ``enable_fsdp_float8_all_gather=False``): the faster step on GPUs of
        one host (docs/benchmarks.md, FSDP2). "auto": False unless the job's ranks run on several
        hosts, where the quantized gather's halved bytes count (``dtq.parallel.resolve_quantized_gather``)."""

    def __init__(self, config: Config):
        check_gather_settings(
            "dtq.integrations.torchtitan: DtqConverter.Config", config.quantized_params, config.quantized_gather
        )
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
                quantized_params=cfg.quantized_params,
                quantized_gather=cfg.quantized_gather,
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


class MasterWeightOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` (same config: parameter groups by pattern, implementation)
    whose every optimizer is a ``dtq.optim.MasterWeightOptimizer`` around the one its group names:
    it steps FP32 masters of the quantized parameters and casts them into their payloads. torchtitan
    checkpoints it as it does its own (flat, FQN-keyed state; each quantized parameter's master is
    one more state entry, ``master``)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Any:
        return functools.partial(
            MasterWeightOptimizer, optimizer_cls=OptimizersContainer._resolve_optimizer_factory(name)
        )


def master_weight_optimizers(config: OptimizersContainer.Config) -> MasterWeightOptimizersContainer.Config:
    """``config`` (e.g. torchtitan's ``default_adamw(lr=...)``) building a
    :class:`MasterWeightOptimizersContainer`: ``config.optimizer = master_weight_optimizers(config.optimizer)``."""
    return MasterWeightOptimizersContainer.Config(
        **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    )


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
        check_master_weights("dtq.integrations.torchtitan", part, list(optimizers), fix=_MASTER_FIX)
        recipe = _bound_recipe(part)
        if recipe is not None:
            _autocast_forward(part, recipe, _amax_group(recipe, parallel_dims))
    precompute = precompute_after_steps(optimizers, parts)
    precompute()  # the weights are initialized by now: the first step's gathers find their amaxes too


_MASTER_FIX = (
    "config.optimizer = dtq.integrations.torchtitan.master_weight_optimizers(config.optimizer) "
    "(DtqConverter.Config(quantized_params=True) needs it; quantized_params=False keeps high-precision parameters)"
)


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


__all__ = [
    "DtqConverter",
    "DtqLinear",
    "MasterWeightOptimizersContainer",
    "master_weight_optimizers",
    "post_optimizer_build_fn",
]
