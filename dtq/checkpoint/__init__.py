"""Checkpointing: state dicts that hold payloads (codes and scales), for torch.distributed.checkpoint."""

from dtq.checkpoint.state_dict import SEP, check_weight, weight_entries, weight_meta

__all__ = ["SEP", "check_weight", "weight_entries", "weight_meta"]
