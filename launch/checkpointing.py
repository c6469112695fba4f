"""Training checkpoints with ``torch.distributed.checkpoint`` (DCP): model, optimizer, step,
data position and every rank's RNG state, in ``<out_dir>/checkpoints/step_<N>/``.

What is per rank is saved per rank: torch's RNG states (stochastic rounding draws its seeds from
them) and the delayed-scaling amax histories of dtq modules (DCP would otherwise keep one rank's
copy of a plain tensor for everybody). The trainer reduces those histories over every rank
(``dtq.autocast(amax_group=...)``), so they agree; a model trained without that keeps its own
per rank, and this layout serves both.
"""

from __future__ import annotations

import pathlib
import re
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

_STEP_DIR = re.compile(r"^step_(\d+)$")
_PER_RANK = "amax_history_"  # model buffers that differ between ranks


def checkpoint_dir(out_dir: str | pathlib.Path, step: int) -> pathlib.Path:
    return pathlib.Path(out_dir) / "checkpoints" / f"step_{step:08d}"


def latest(out_dir: str | pathlib.Path) -> pathlib.Path | None:
    """The newest complete checkpoint (DCP writes ``.metadata`` last) under ``out_dir``."""
    root = pathlib.Path(out_dir) / "checkpoints"
    done = [p for p in root.glob("step_*") if _STEP_DIR.match(p.name) and (p / ".metadata").exists()]
    return max(done, key=lambda p: int(_STEP_DIR.match(p.name).group(1)), default=None)


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _split_model_state(model: torch.nn.Module) -> tuple[dict, dict]:
    """(shared entries, this rank's own entries) of the model's state dict."""
    shared, own = {}, {}
    for k, v in model.state_dict().items():
        (own if _PER_RANK in k.rsplit(".", 1)[-1] else shared)[k] = v
    return shared, own


def _state(model, optimizer, train_state: dict, device: torch.device, rank: int) -> dict:
    shared, own = _split_model_state(model)
    return {"model": shared, "optim": optimizer.state_dict(), "train": dict(train_state),
            f"rank{rank}": {"rng": _rng_state(device), "buffers": own}}


def save(out_dir: str | pathlib.Path, step: int, model, optimizer, train_state: dict, device: torch.device) -> pathlib.Path:
    """Write a checkpoint of step ``step`` (a collective: every rank calls it)."""
    path = checkpoint_dir(out_dir, step)
    dcp.save(_state(model, optimizer, train_state, device, dist.get_rank()), checkpoint_id=str(path))
    return path


def load(path: str | pathlib.Path, model, optimizer, device: torch.device) -> dict:
    """Restore model, optimizer and this rank's RNG state from ``path``; returns the saved train
    state (step, samples consumed, world size). Loaded on another world size, model and optimizer
    are resharded but RNG streams restart from this rank's current state (with a warning); a rank
    the checkpoint has no entries for takes rank 0's delayed-scaling histories (the trainer keeps
    them equal on every rank)."""
    rank = dist.get_rank()
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    have_rank = any(k.startswith(f"rank{rank}.") for k in meta)
    source = f"rank{rank}" if have_rank else "rank0"
    # Delayed-scaling histories appear at a module's first forward: create the ones the
    # checkpoint has so that DCP has somewhere to load them.
    prefix = f"{source}.buffers."
    buffers = {key[len(prefix):]: torch.zeros(md.size, dtype=md.properties.dtype, device=device)
               for key, md in meta.items() if key.startswith(prefix)}
    state = _state(model, optimizer, {"step": 0, "samples": 0, "world_size": 0}, device, rank)
    del state[f"rank{rank}"]
    if have_rank:
        state[source] = {"rng": _rng_state(device), "buffers": buffers}
    elif buffers:
        state[source] = {"buffers": buffers}
    dcp.load(state, checkpoint_id=str(path))  # fills the tensors of ``state`` (``buffers`` too) in place
    model.load_state_dict({**state["model"], **buffers})
    optimizer.load_state_dict(state["optim"])
    train_state = state["train"]
    if have_rank and train_state["world_size"] == dist.get_world_size():
        torch.set_rng_state(state[source]["rng"]["cpu"])
        if device.type == "cuda" and "cuda" in state[source]["rng"]:
            torch.cuda.set_rng_state(state[source]["rng"]["cuda"], device)
    elif rank == 0:
        warnings.warn(f"checkpoint {path} was written by {train_state['world_size']} ranks, this run has "
                      f"{dist.get_world_size()}: model and optimizer are resharded, but the RNG streams (stochastic "
                      "rounding seeds) restart, so the run is not bitwise the uninterrupted one", stacklevel=2)
    return train_state
