"""dtq with Hugging Face Accelerate: ``convert`` before the optimizer, ``prepare`` after it.

Accelerate's own FP8 (``mixed_precision="fp8"``: TransformerEngine, torchao, MS-AMP recipes) swaps
or wraps the same Linear layers dtq converts; the two do not stack, so :func:`convert` refuses
it. dtq needs no autocast hook in Accelerate: ``dtq.convert`` binds the recipe to the model.

    accelerator = Accelerator()
    model = dtq.integrations.accelerate.convert(accelerator, model, "mxfp8")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)   # after converting
    model, optimizer, loader = dtq.integrations.accelerate.prepare(accelerator, model, optimizer, loader)
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

import dtq
from dtq._warn import warn_once
from dtq.integrations._common import (
    check_gather_settings,
    check_master_weights,
    has_dtq_modules,
    precompute_after_steps,
)
from dtq.presets import as_recipe
from dtq.recipe import Recipe


def _fsdp_world(accelerator: Accelerator) -> int:
    """The ranks Accelerate's FSDP shards each weight over (1 without FSDP: DDP keeps whole weights)."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return 1
    config = getattr(accelerator, "parallelism_config", None)  # FSDP over its dp_shard dim (HSDP, TP beside it)
    return config.dp_shard_size if config is not None and config.dp_shard_size > 1 else accelerator.num_processes


def convert(
    accelerator: Accelerator,
    model: torch.nn.Module,
    recipe: Recipe | str,
    *,
    quantized_gather: bool | Literal["auto"] = "auto",
    **convert_kwargs: Any,
) -> torch.nn.Module:
    """``dtq.convert(model, recipe=recipe, ...)`` with the shape check sized to the FSDP sharding
    ``accelerator.prepare`` will apply; build the optimizer on the returned model's parameters.
    ``quantized_gather=False``: plain weights that FSDP2 gathers unquantized, each GEMM quantizing
    its gathered weight (``dtq.parallel.gather_high_precision``); "auto" (the default): that, unless
    the job's ranks run on several hosts (``dtq.parallel.resolve_quantized_gather``)."""
    if accelerator.mixed_precision == "fp8":
        raise ValueError(
            "dtq.integrations.accelerate.convert: Accelerator(mixed_precision='fp8') converts the same "
            "Linear layers with TransformerEngine / torchao / MS-AMP; dtq quantizes them itself, so "
            "use mixed_precision='no' or 'bf16' with dtq"
        )
    check_gather_settings(
        "dtq.integrations.accelerate.convert", bool(convert_kwargs.get("quantized_params")), quantized_gather
    )
    convert_kwargs.setdefault("fsdp_world", _fsdp_world(accelerator))
    model = dtq.convert(model, recipe=as_recipe(recipe), **convert_kwargs)
    if not dtq.parallel.resolve_quantized_gather(
        quantized_gather, quantized_params=bool(convert_kwargs.get("quantized_params"))
    ):
        dtq.parallel.gather_high_precision(model)
    return model


def prepare(accelerator: Accelerator, *objects: Any, **prepare_kwargs: Any) -> Any:
    """``accelerator.prepare(*objects)``, then: each prepared optimizer ends its steps with
    ``dtq.parallel.precompute_amax`` over the prepared dtq models (their FSDP2 gathers find the
    weight amaxes reduced in one all-reduce). Quantized parameters must be stepped by a
    ``dtq.optim.MasterWeightOptimizer``."""
    models = [o for o in objects if isinstance(o, torch.nn.Module) and has_dtq_modules(o)]
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    for model in models:
        check_master_weights("dtq.integrations.accelerate.prepare", model, optimizers)
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if models and plugin is not None and getattr(plugin, "cpu_ram_efficient_loading", False):
        # Accelerate's FSDP2 loading moves the model to the meta device and broadcasts every
        # state-dict entry as a DTensor; a dtq module's `_extra_state` (its weights' formats) is not one.
        warn_once(
            "accelerate-cpu-ram-efficient-loading",
            "dtq.integrations.accelerate.prepare: Accelerate's FSDP2 cpu_ram_efficient_loading is turned off "
            "for this run: it broadcasts every state-dict entry as a DTensor, and dtq modules also keep "
            "their weights' formats in `_extra_state`. Every rank builds the model itself instead; pass "
            "--fsdp_cpu_ram_efficient_loading false (or fsdp_cpu_ram_efficient_loading: false) to silence this",
        )
        plugin.cpu_ram_efficient_loading = False
    prepared = accelerator.prepare(*objects, **prepare_kwargs)
    out = prepared if isinstance(prepared, tuple) else (prepared,)
    models = [p for p in out if isinstance(p, torch.nn.Module) and has_dtq_modules(p)]
    for opt in out:
        if isinstance(opt, torch.optim.Optimizer) and models:
            precompute_after_steps(getattr(opt, "optimizer", opt), models)  # an AcceleratedOptimizer's inner one
    return prepared


__all__ = ["convert", "prepare"]
