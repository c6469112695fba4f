"""Bridges to high precision: export a plain BF16/FP32 safetensors file for inference tools, and
load a plain high-precision state dict into a (possibly sharded, possibly quantized) dtq model."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtq.nn.state_dict import entry_key
from dtq.tensor import QuantizedTensor
from dtq.weights import local_tensor, unwrap


def _row_offset(p: torch.Tensor) -> int:
    """First global row of this rank's dim-0 shard (FSDP2 / HSDP: torch.chunk over the Shard(0) mesh dim)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return 0
    dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard) and pl.dim == 0]
    if len(dims) > 1:
        raise NotImplementedError("load_high_precision: parameters sharded on dim 0 over several mesh dims")
    if not dims:
        return 0
    return p.device_mesh.get_local_rank(dims[0]) * -(-p.shape[0] // p.device_mesh.size(dims[0]))


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _full_quantized(name: str, param: torch.Tensor, entries: dict) -> QuantizedTensor:
    """The whole quantized tensor behind a (sharded) quantized parameter, from its state-dict entries."""

    local = local_tensor(param)
    payloads: dict = {}
    for d in local.directions:
        for k, v in local.payload(d).items():  # entries hold FP8 codes as bytes
            payloads.setdefault(d, {})[k] = _full(entries[entry_key(name, local.quantizer, d, k)]).view(v.dtype)
    return QuantizedTensor(param.shape, local.dtype, local.quantizer, payloads)


@torch.no_grad()
def high_precision_state_dict(
    model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16, optimizer=None
) -> dict[str, torch.Tensor]:
    """Full (unsharded) high-precision tensors of every parameter and buffer, on CPU: quantized
    weights from the FP32 masters of ``optimizer`` (a MasterWeightOptimizer) when given, else
    dequantized. Collective under FSDP2: call it on every rank."""

    masters = {}
    if optimizer is not None:
        masters = {id(p): m for p, m in zip(getattr(optimizer, "quantized", []), getattr(optimizer, "masters", []))}
    sd = model.state_dict()
    out = {}
    for name, param in model.named_parameters():
        local = local_tensor(param)
        if id(param) in masters:
            value = _full(masters[id(param)].detach())
        elif isinstance(local, QuantizedTensor):
            value = _full_quantized(name, param, sd).dequantize(torch.float32)
        else:
            value = _full(param.detach())
            value = unwrap(value)
        out[name] = value.to(dtype).cpu()
    for name, buf in model.named_buffers():
        out[name] = _full(buf).cpu()
    return out


def export_safetensors(model: torch.nn.Module, path: str, dtype: torch.dtype = torch.bfloat16, optimizer=None) -> None:
    """Write ``high_precision_state_dict`` to a safetensors file (rank 0 writes under
    torch.distributed; every rank must call it)."""
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ImportError(
            "dtq.checkpoint.export_safetensors needs the safetensors package: pip install safetensors"
        ) from e
    sd = high_precision_state_dict(model, dtype, optimizer)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in sd.items()}, path)


@torch.no_grad()
def load_high_precision(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load full high-precision tensors (e.g. a BF16 safetensors file) into a dtq model: quantized
    weights are quantized from them (each shard as the slice of quantizing the whole tensor, so
    scales agree across ranks), everything else is copied. Build a MasterWeightOptimizer after
    this, so its masters start from the loaded values."""
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    missing = [n for n in params if n not in state_dict]
    unexpected = [n for n in state_dict if n not in params and n not in dict(model.named_buffers())]
    if strict and (missing or unexpected):
        raise KeyError(f"load_high_precision: missing {missing}, unexpected {unexpected}")
    for name, p in params.items():
        if name not in state_dict:
            continue
        full = state_dict[name]
        if tuple(full.shape) != tuple(p.shape):
            raise ValueError(
                f"load_high_precision: {name} has shape {list(full.shape)} in the state dict and "
                f"{list(p.shape)} in the model"
            )
        local = local_tensor(p)
        start = _row_offset(p)
        if isinstance(local, QuantizedTensor):
            whole = local.quantizer.quantize(
                full.to(local.device), rowwise=local.has("rowwise"), columnwise=local.has("columnwise")
            )
            local.copy_(whole[start : start + local.shape[0]])
        else:
            target = unwrap(local)
            target.copy_(full[start : start + local.shape[0]] if isinstance(p, DTensor) else full)
    for name, buf in model.named_buffers():
        if name in state_dict:
            buf.copy_(state_dict[name])
