"""dtq in PyTorch Lightning: a ``Precision`` plugin.

``Trainer(plugins=[DtqPrecision("mxfp8")])`` converts the LightningModule's ``nn.Linear`` layers
with ``dtq.convert`` (binding the recipe), runs every step's forward under ``dtq.autocast`` (with
the data-parallel amax group for delayed scaling) and ends every optimizer step with
``dtq.parallel.precompute_amax``, so FSDP2 gathers find their weight amaxes reduced in one
all-reduce. Lightning calls ``convert_module`` before it wraps the model (DDP, single device)
and builds the optimizers after, as ``dtq.convert`` needs. Under ``ModelParallelStrategy``
(FSDP2, tensor parallelism) Lightning calls it only after ``configure_model`` has sharded the
model: call ``self.trainer.precision_plugin.convert_module(self)`` at the top of
``configure_model``, before ``fully_shard`` (Lightning's own later call then converts nothing
again).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import Precision

import dtq
from dtq.integrations._common import check_gather_settings, check_master_weights
from dtq.parallel.fsdp import gather_high_precision, precompute_amax, resolve_quantized_gather
from dtq.presets import as_recipe
from dtq.recipe import Recipe


class DtqPrecision(Precision):
    """Quantized GEMMs (and, with ``quantized_params=True``, quantized parameters) by ``recipe``: a
    dtq recipe or a ``dtq.presets`` name. Parameters keep their dtype ("32-true" to Lightning);
    ``module_filter_fn`` and ``strict`` are ``dtq.convert``'s. Quantized parameters need a
    ``dtq.optim.MasterWeightOptimizer`` from ``configure_optimizers`` (checked at setup).
    ``quantized_gather=False``: plain weights that FSDP2 gathers unquantized, each GEMM quantizing
    its gathered weight (``dtq.parallel.gather_high_precision``; convert before ``fully_shard``);
    "auto" (the default): that, unless the job's ranks run on several hosts
    (``dtq.parallel.resolve_quantized_gather``, decided when the module is converted)."""

    precision = "32-true"

    def __init__(
        self,
        recipe: Recipe | str,
        *,
        quantized_params: bool = False,
        quantized_gather: bool | Literal["auto"] = "auto",
        module_filter_fn: Callable[[torch.nn.Module, str], bool] | None = None,
        strict: bool = False,
    ):
        check_gather_settings("DtqPrecision", quantized_params, quantized_gather)
        self.recipe = as_recipe(recipe)
        self.quantized_params, self.module_filter_fn, self.strict = quantized_params, module_filter_fn, strict
        self.quantized_gather = quantized_gather
        self._converted: weakref.WeakSet = weakref.WeakSet()

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """``dtq.convert`` the module once (later calls find it converted and return it)."""
        if module in self._converted:
            return module
        module = dtq.convert(
            module,
            recipe=self.recipe,
            quantized_params=self.quantized_params,
            module_filter_fn=self.module_filter_fn,
            strict=self.strict,
        )
        if not resolve_quantized_gather(self.quantized_gather, quantized_params=self.quantized_params):
            gather_high_precision(module)
        self._converted.add(module)
        return module

    def forward_context(self) -> contextlib.AbstractContextManager:
        dist = torch.distributed
        group = (
            dist.group.WORLD if self.recipe.delayed and dist.is_initialized() and dist.get_world_size() > 1 else None
        )
        return dtq.autocast(self.recipe, amax_group=group)

    def connect(self, model: torch.nn.Module, optimizers: list, lr_schedulers: list) -> tuple:
        check_master_weights("DtqPrecision(quantized_params=True)", model, optimizers)
        return model, optimizers, lr_schedulers

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """The closure (forward and backward) first, then the step (a MasterWeightOptimizer reads the
        gradients before it steps), then the amaxes of the new weights."""
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("DtqPrecision does not support LBFGS (its step calls the closure many times)")
        closure_result = self._wrap_closure(model, optimizer, closure)
        if closure_result is None and getattr(model, "automatic_optimization", False):
            return None  # training_step returned None: Lightning skips the step
        out = optimizer.step(**kwargs)
        precompute_amax(model)
        return out


__all__ = ["DtqPrecision"]
