"""Checkpointing: state dicts that hold payloads (codes and scales), for torch.distributed.checkpoint,
and the bridges to high precision (safetensors export, loading plain state dicts)."""

from dtq.checkpoint.high_precision import export_safetensors, high_precision_state_dict, load_high_precision
from dtq.checkpoint.state_dict import check_state_dict, make_loading_atomic
from dtq.nn.state_dict import SEP, check_weight, entry_key, layout1_state_dict, weight_entries, weight_meta

__all__ = [
    "SEP",
    "check_state_dict",
    "check_weight",
    "entry_key",
    "layout1_state_dict",
    "make_loading_atomic",
    "weight_entries",
    "weight_meta",
    "export_safetensors",
    "high_precision_state_dict",
    "load_high_precision",
]
