"""State dicts of dtq GEMM weights: codes, not values (docs/design.md §5.6).

A high-precision weight (``HighPrecisionWeight``) is saved as its plain data. A quantized weight
is saved as its payload tensors, one entry per field, ``<name>._payload.<direction>.<tag>.<field>``
where ``tag`` names the direction's format and a digest of its settings (``mxfp8-1a2b3c``): a
checkpoint of another format then has other keys, so ``dcp.load`` stops at planning, before it
writes a byte into the model;
row-structured fields keep the parameter's sharding (a DTensor sharded on dim 0 under FSDP2),
so ``torch.distributed.checkpoint`` reshards them by rows when loaded on another world size.
FP8 codes are stored as their bytes (uint8): DCP's full state dicts gather every field, and gloo
has no FP8 collectives. The quantizer, dtype and shape go into the module's extra state, so
loading can check that the checkpoint holds the format the model expects. The state dict's
tensors are views of the live payloads: ``dcp.load`` writes codes straight into the parameters.
"""

from __future__ import annotations

import hashlib

import torch

from dtq._bits import as_bytes
from dtq._torch_private import local_tensor
from dtq.tensor import QuantizedTensor
from dtq.weights import HighPrecisionWeight, unwrap

SEP = "._payload."
# Layout 2 stores FP8 codes as uint8. A digest of the layout too gives its keys other tags than
# layout 1's (FP8 dtypes), so dcp.load of a layout-1 checkpoint stops at planning instead of
# converting FP8 values into bytes; load_state_dict still reads layout-1 state dicts.
_LAYOUT = 2


class KeyPath:
    """Stands for a GEMM weight when ``torch.distributed.checkpoint.state_dict``'s helpers resolve
    a state-dict key by walking its dotted parts as attributes: the parts after the weight's name
    (``_payload.<direction>.<tag>.<field>``) are no attributes of the parameter, so every one of
    them resolves to this object. ``QuantizedModule._fqn_modifiers`` routes the walk here."""

    def _fqn_modifiers(self) -> dict[str, str]:
        return {}

    def __getattr__(self, name: str) -> KeyPath:
        if name.startswith("__"):
            raise AttributeError(name)
        return self


KEY_PATH = KeyPath()


def format_tag(quantizer, layout: int = _LAYOUT) -> str:
    """``<format>-<6 hex digits of the settings>``: stable across processes and torch versions."""
    text = repr(quantizer) if layout == 1 else f"{quantizer!r}/layout{layout}"
    return f"{quantizer.format_name}-{hashlib.sha1(text.encode()).hexdigest()[:6]}"


def entry_key(name: str, quantizer, direction: str, field: str, layout: int = _LAYOUT) -> str:
    """The state-dict key of one payload field of the quantized weight ``name``."""
    return f"{name}{SEP}{direction}.{format_tag(quantizer.for_direction(direction), layout)}.{field}"


def _local(p):
    from torch.distributed.tensor import DTensor

    return (local_tensor(p), p) if isinstance(p, DTensor) else (p, None)


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
    stride = tuple(int(torch.Size(shape[i + 1 :]).numel()) for i in range(len(shape)))
    return DTensor.from_local(t, mesh, dparam.placements, run_check=False, shape=tuple(shape), stride=stride)


def _payload_entries(name: str, param: torch.Tensor, local: QuantizedTensor, dparam, layout: int = _LAYOUT):
    """(direction, field, key, entry) of each payload field of a quantized weight."""
    q = local.quantizer
    global_rows = torch.Size(param.shape[:-1]).numel() if param.dim() > 1 else 1  # rows of the [M, K] matrix
    for d in local.directions:
        fields = q.codec(d).fields()
        for k, v in local.payload(d).items():
            rows = None if fields[k] is None else -(-global_rows // fields[k])
            v = as_bytes(v) if layout >= 2 else v
            yield d, k, entry_key(name, q, d, k, layout), _like_param(v, dparam, rows)


def weight_entries(name: str, param: torch.Tensor) -> dict:
    """State-dict entries of one GEMM weight."""
    local, dparam = _local(param)
    if isinstance(local, HighPrecisionWeight):
        return {name: _like_param(unwrap(local), dparam, param.shape[0] if param.dim() else None)}
    if not isinstance(local, QuantizedTensor):
        return {name: param}
    return {key: entry for _, _, key, entry in _payload_entries(name, param, local, dparam)}


def weight_meta(param: torch.Tensor) -> dict | None:
    """What loading checks a quantized weight against, in the plain types (str, tuple) that
    DCP's state-dict helpers gather and broadcast: the quantizer as its ``repr``."""
    local, _ = _local(param)
    if not isinstance(local, QuantizedTensor):
        return None
    return {
        "quantizer": repr(local.quantizer),
        "dtype": str(local.dtype),
        "directions": tuple(local.directions),
        "shape": tuple(param.shape),
    }


def layout1_state_dict(model: torch.nn.Module) -> dict:
    """``model.state_dict()`` as dtq wrote it before FP8 codes were stored as bytes (FP8 dtypes,
    layout-1 tags): the template for ``dcp.load`` of a checkpoint of that time, which
    ``model.load_state_dict`` then takes. Its tensors are views of the live payloads too."""
    sd = {k: v for k, v in model.state_dict().items() if SEP not in k}
    for name, p in model.named_parameters(remove_duplicate=False):  # tied weights under each name
        local, dparam = _local(p)
        if isinstance(local, QuantizedTensor):  # only GEMM weights of dtq modules are quantized
            sd.update((key, e.detach()) for _, _, key, e in _payload_entries(name, p, local, dparam, 1))
    return sd


def _source(key: str, state_dict: dict, target: torch.Tensor, legacy: str):
    """This rank's part of the checkpoint's entry for ``target`` (a state-dict entry of the model):
    the local tensor of a DTensor entry, the matching slice of a full (unsharded) entry, such as
    ``get_model_state_dict(full_state_dict=True)`` gives, or a layout-1 entry (FP8 dtypes)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    src = state_dict.get(key)
    if src is None:
        src = state_dict.get(legacy)
    if src is None:
        return None
    if isinstance(src, DTensor):
        return as_bytes(local_tensor(src))
    src = as_bytes(src)
    if isinstance(target, DTensor) and tuple(src.shape) == tuple(target.shape):
        local = local_tensor(target)
        return distribute_tensor(
            src.to(local.device), target.device_mesh, target.placements, src_data_rank=None
        ).to_local()
    return src


_NOTHING_HERE = (
    "StateDictOptions(broadcast_from_rank0=True) brings parameters, buffers and extra state to the ranks other than 0, "
    "not the payload entries of quantized parameters: pass the full state dict on every rank "
    "(StateDictOptions(full_state_dict=True)), load a sharded checkpoint with dcp.load, or load high-precision "
    "values with dtq.checkpoint.load_high_precision"
)


def check_weight(name: str, param: torch.Tensor, state_dict: dict, meta: dict | None, errors: list) -> list:
    """Validate one quantized weight's entries; returns (destination, source) pairs to copy."""
    local, dparam = _local(param)
    if not isinstance(local, QuantizedTensor):
        return []
    saved = None if meta is None else meta["quantizer"]
    if saved is not None and not isinstance(saved, str):  # layout-1 checkpoints hold the quantizer itself
        saved = repr(saved)
    if saved is not None and saved != repr(local.quantizer):
        errors.append(
            f"{name}: the checkpoint holds it quantized as {saved}, the model as "
            f"{local.quantizer!r}; build the model with the checkpoint's recipe (quantized_params) or "
            f"load the checkpoint's values into high-precision weights"
        )
        return []
    pairs, missing = [], []
    for d, k, key, target in _payload_entries(name, param, local, dparam):
        dst = local_tensor(target)
        src = _source(key, state_dict, target, entry_key(name, local.quantizer, d, k, layout=1))
        if src is None:
            missing.append(key)
            continue
        if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
            errors.append(
                f"{key}: the checkpoint has {list(src.shape)} {src.dtype}, the model {list(dst.shape)} {dst.dtype}"
            )
            continue
        pairs.append((dst, src))
    have = sorted(x for x in state_dict if x.startswith(name + SEP))
    if missing and not have and dparam is not None:
        errors.append(f"{name}: none of its payload entries ({missing[0]}, ...) is in this rank's state dict")
        if _NOTHING_HERE not in errors:
            errors.append(_NOTHING_HERE)
    else:
        errors.extend(f"{key}: missing from the checkpoint (entries for {name}: {have})" for key in missing)
    return pairs
