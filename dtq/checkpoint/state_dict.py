"""Whole-model state-dict checks: ``load_state_dict`` of a dtq model checks every quantized weight
before any module loads (the per-weight entries and checks are :mod:`dtq.nn.state_dict`)."""

from __future__ import annotations

import weakref

import torch

from dtq.nn.module import QuantizedModule
from dtq.nn.state_dict import check_weight

_ATOMIC: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models whose loading checks first


def check_state_dict(model: torch.nn.Module, state_dict: dict, prefix: str = "") -> None:
    """Check every quantized weight of ``model`` against ``state_dict`` (format, presence, shape,
    dtype) and raise one error listing all problems, before anything is loaded. ``dtq.convert``
    installs it as a load-state-dict pre-hook of the model it returns, so that a mismatch in any
    module leaves the whole model untouched."""
    errors: list[str] = []
    for mname, m in model.named_modules():
        if not isinstance(m, QuantizedModule):
            continue
        base = f"{prefix}{mname}." if mname else prefix
        meta = state_dict.get(base + "_extra_state") or {}
        for w in m.weight_names():
            p = m._parameters.get(w)
            if p is not None:
                check_weight(base + w, p, state_dict, meta.get(w) if isinstance(meta, dict) else None, errors)
    if errors:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(model).__name__} (nothing was loaded):\n\t" + "\n\t".join(errors)
        )


def _check_before_load(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    check_state_dict(module, state_dict, prefix)


def make_loading_atomic(model: torch.nn.Module) -> None:
    """Have ``model.load_state_dict`` check every dtq weight before any module loads (idempotent)."""
    if model not in _ATOMIC:
        model._register_load_state_dict_pre_hook(_check_before_load, with_module=True)
        _ATOMIC.add(model)
