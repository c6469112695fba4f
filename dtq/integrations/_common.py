"""What every integration checks or wires the same way."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from dtq.nn.module import QuantizedModule
from dtq.optim import MasterWeightOptimizer, _is_quantized
from dtq.parallel.fsdp import precompute_amax

_FIX = "dtq.optim.MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=...)"


def check_master_weights(
    who: str, model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer], fix: str = _FIX
) -> None:
    """Quantized parameters stepped by a plain optimizer lose every update smaller than their
    quantization step: refuse, naming the first one, the optimizer that would do it, and ``fix``
    (how this integration builds master-weight optimizers)."""
    quantized = [n for n, p in model.named_parameters() if _is_quantized(p)]
    plain = [o for o in optimizers if not isinstance(o, MasterWeightOptimizer)]
    if quantized and plain:
        raise ValueError(
            f"{who}: {quantized[0]} (and {len(quantized) - 1} more) are quantized parameters, stepped by "
            f"{type(plain[0]).__name__}, which would round small updates away; step them with {fix}"
        )


def check_gather_settings(who: str, quantized_params: bool, quantized_gather: bool | str) -> None:
    """``quantized_gather`` is True, False or "auto"; False (``dtq.parallel.gather_high_precision``)
    is for high-precision weights: quantized parameters are stored, and gathered, in their format."""
    if quantized_gather not in (True, False, "auto"):
        raise ValueError(
            f"{who}: quantized_gather={quantized_gather!r}: expected True (FSDP2 gathers the weights "
            'quantized), False (unquantized, each GEMM quantizing) or "auto" (quantized only across hosts)'
        )
    if quantized_params and quantized_gather is False:
        raise ValueError(
            f"{who}: quantized_gather=False needs quantized_params=False (quantized parameters are "
            "gathered in their format); keep quantized_gather=True with quantized parameters, or train "
            "high-precision weights to gather them unquantized"
        )


def precompute_after_steps(optimizer: torch.optim.Optimizer, models: Iterable[torch.nn.Module]) -> Callable[[], None]:
    """End every step of ``optimizer`` with ``dtq.parallel.precompute_amax`` over ``models``: the
    next forward's FSDP2 gathers find the weight amaxes reduced, one all-reduce per process group
    instead of one per weight. Returns the hook (call it once more to cover the first step)."""
    models = list(models)

    def precompute(*_args: object, **_kwargs: object) -> None:
        for model in models:
            precompute_amax(model)

    optimizer.register_step_post_hook(precompute)
    return precompute


def has_dtq_modules(module: torch.nn.Module) -> bool:
    return any(isinstance(m, QuantizedModule) for m in module.modules())
