"""State dicts of dtq GEMM weights: codes, not values (docs/design.md §5.6).

A high-precision weight (``HighPrecisionWeight``) is saved as its plain data. A quantized weight
is saved as its payload tensors, one entry per field, ``<name>._payload.<direction>.<tag>.<field>``
where ``tag`` names the direction's format and a digest of its settings (``mxfp8-1a2b3c``): a
checkpoint of another format then has other keys, so ``dcp.load`` stops at planning, before it
writes a byte into the model;
row-structured fields keep the parameter's sharding (a DTensor sharded on dim 0 under FSDP2),
so ``torch.distributed.checkpoint`` reshards them by rows when loaded on another world size.
The quantizer, dtype and shape go into the module's extra state, so loading can check that the
checkpoint holds the format the model expects. The state dict's tensors are views of the live
payloads: ``dcp.load`` writes codes straight into the parameters.
"""

from __future__ import annotations

import hashlib

import torch

from dtq.formats import codec_for
from dtq.tensor import QuantizedTensor

SEP = "._payload."


def format_tag(quantizer) -> str:
    """``<format>-<6 hex digits of the settings>``: stable across processes and torch versions."""
    return f"{quantizer.format_name}-{hashlib.sha1(repr(quantizer).encode()).hexdigest()[:6]}"


def entry_key(name: str, quantizer, direction: str, field: str) -> str:
    """The state-dict key of one payload field of the quantized weight ``name``."""
    return f"{name}{SEP}{direction}.{format_tag(quantizer.for_direction(direction))}.{field}"


def _local(p):
    from torch.distributed.tensor import DTensor

    return (p._local_tensor, p) if isinstance(p, DTensor) else (p, None)


def _like_param(t: torch.Tensor, dparam, rows_global: int | None):
    """A payload field shaped like its parameter: a DTensor with the parameter's placements when
    the parameter is one (row fields sharded like dim 0, column fields like dim 1 under tensor
    parallelism, per-tensor fields replicated)."""
    if dparam is None:
        return t
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = dparam.device_mesh
    if rows_global is None:
        return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
    shape = [rows_global, *t.shape[1:]]
    for i, placement in enumerate(dparam.placements):
        if isinstance(placement, Shard) and placement.dim > 0:  # dim 0 is known exactly (uneven shards)
            shape[placement.dim] *= mesh.size(i)
    stride = tuple(int(torch.Size(shape[i + 1:]).numel()) for i in range(len(shape)))
    return DTensor.from_local(t, mesh, dparam.placements, run_check=False, shape=tuple(shape), stride=stride)


def weight_entries(name: str, param: torch.Tensor) -> dict:
    """State-dict entries of one GEMM weight."""
    local, dparam = _local(param)
    if hasattr(local, "__dtq_unwrap__"):
        return {name: _like_param(local.__dtq_unwrap__(), dparam, param.shape[0] if param.dim() else None)}
    if not isinstance(local, QuantizedTensor):
        return {name: param}
    out = {}
    q = local.quantizer
    global_rows = torch.Size(param.shape[:-1]).numel() if param.dim() > 1 else 1  # rows of the [M, K] matrix
    for d in local.directions:
        sub = q.for_direction(d)
        fields = codec_for(sub).fields(sub, d)
        for k, v in local.payload(d).items():
            rows = None if fields[k] is None else -(-global_rows // fields[k])
            out[entry_key(name, q, d, k)] = _like_param(v, dparam, rows)
    return out


def weight_meta(param: torch.Tensor) -> dict | None:
    local, _ = _local(param)
    if not isinstance(local, QuantizedTensor):
        return None
    return {"quantizer": local.quantizer, "dtype": local.dtype, "directions": local.directions,
            "shape": tuple(param.shape)}


def check_weight(name: str, param: torch.Tensor, state_dict: dict, meta: dict | None, errors: list) -> list:
    """Validate one quantized weight's entries; returns (destination, source) pairs to copy."""
    local, _ = _local(param)
    if not isinstance(local, QuantizedTensor):
        return []
    if meta is not None and meta["quantizer"] != local.quantizer:
        errors.append(f"{name}: the checkpoint holds it quantized as {meta['quantizer']!r}, the model as "
                      f"{local.quantizer!r}; build the model with the checkpoint's recipe (quantized_params) or "
                      f"load the checkpoint's values into high-precision weights")
        return []
    pairs = []
    for d in local.directions:
        for k, v in local.payload(d).items():
            key = entry_key(name, local.quantizer, d, k)
            if key not in state_dict:
                have = sorted(x for x in state_dict if x.startswith(name))
                errors.append(f"{key}: missing from the checkpoint (entries for {name}: {have})")
                continue
            src = state_dict[key]
            src_local = src._local_tensor if hasattr(src, "_local_tensor") else src
            if tuple(src_local.shape) != tuple(v.shape) or src_local.dtype != v.dtype:
                errors.append(f"{key}: the checkpoint has {list(src_local.shape)} {src_local.dtype}, the model "
                              f"{list(v.shape)} {v.dtype}")
                continue
            pairs.append((v, src_local))
    return pairs


def check_state_dict(model: torch.nn.Module, state_dict: dict, prefix: str = "") -> None:
    """Check every quantized weight of ``model`` against ``state_dict`` (format, presence, shape,
    dtype) and raise one error listing all problems, before anything is loaded. ``dtq.convert``
    installs it as a load-state-dict pre-hook of the model it returns, so that a mismatch in any
    module leaves the whole model untouched."""
    from dtq.nn.module import QuantizedModule

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
        raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__} (nothing was loaded):\n\t"
                           + "\n\t".join(errors))


def _check_before_load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                       error_msgs) -> None:
    check_state_dict(module, state_dict, prefix)


def make_loading_atomic(model: torch.nn.Module) -> None:
    """Have ``model.load_state_dict`` check every dtq weight before any module loads (idempotent)."""
    if not getattr(model, "_dtq_atomic_load", False):
        model._register_load_state_dict_pre_hook(_check_before_load, with_module=True)
        model._dtq_atomic_load = True
