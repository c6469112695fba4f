"""Training checkpoints with ``torch.distributed.checkpoint`` (DCP): model, optimizer, step,
data position and every rank's RNG state, in ``<out_dir>/checkpoints/step_<N>/``.

A checkpoint is committed atomically: every rank writes into a temporary sibling
``step_<N>.tmp-<id>/``, and only when all of them have finished does rank 0 rename it to
``step_<N>/``. So a ``step_<N>/`` directory is always complete, and :func:`latest` never sees
a save that crashed half-way (nor a mix of two saves of one step: DCP itself writes into the
directory it is given and leaves an older ``.metadata`` there until it finishes).
:func:`recover` and :func:`remove_stale` tidy up after a crash at the next start.

Beside DCP's files, ``run.json`` records the recipe settings the run trained with, so that a resume
under other settings is noticed before anything is loaded (:func:`read_run_info`).
``keep`` (``train.keep_checkpoints``) deletes all but the newest committed checkpoints after each
save.

What is per rank is saved per rank: torch's RNG states (stochastic rounding draws its seeds from
them) and the delayed-scaling amax histories of dtq modules (DCP would otherwise keep one rank's
copy of a plain tensor for everybody). The trainer reduces those histories over every rank
(``dtq.autocast(amax_group=...)``), so they agree; a model trained without that keeps its own
per rank, and this layout serves both.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import uuid
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dtq.distributed import collective

_STEP_DIR = re.compile(r"^step_(\d+)$")
# A save in progress (``tmp``) and a committed checkpoint moved aside to be replaced (``old``).
_STAGED_DIR = re.compile(r"^(step_\d+)\.(tmp|old)-[0-9a-f]+$")
_PER_RANK = "amax_history_"  # model buffers that differ between ranks
RUN_INFO = "run.json"


def checkpoint_dir(out_dir: str | pathlib.Path, step: int) -> pathlib.Path:
    return pathlib.Path(out_dir) / "checkpoints" / f"step_{step:08d}"


def step_of(path: str | pathlib.Path) -> int:
    """The step of a checkpoint directory ``step_<N>``."""
    return int(_STEP_DIR.match(pathlib.Path(path).name).group(1))


def latest(out_dir: str | pathlib.Path) -> pathlib.Path | None:
    """The newest complete checkpoint under ``out_dir``: a committed ``step_<N>`` directory
    holding DCP's ``.metadata``. Temporary directories of saves in progress (or crashed) are
    never returned."""
    return max(_committed(out_dir), key=step_of, default=None)


def _committed(out_dir: str | pathlib.Path) -> list[pathlib.Path]:
    root = pathlib.Path(out_dir) / "checkpoints"
    return [p for p in root.glob("step_*") if _STEP_DIR.match(p.name) and (p / ".metadata").exists()]


def prune(out_dir: str | pathlib.Path, keep: int) -> list[pathlib.Path]:
    """Delete every committed checkpoint but the ``keep`` newest (0: keep all); returns the deleted
    directories. Rank 0 calls it after a commit."""
    if keep <= 0:
        return []
    old = sorted(_committed(out_dir), key=step_of)[:-keep]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


def read_run_info(path: str | pathlib.Path) -> dict | None:
    """The ``run.json`` of the checkpoint directory ``path`` (None for checkpoints older than it)."""
    f = pathlib.Path(path) / RUN_INFO
    return json.loads(f.read_text()) if f.exists() else None


def _staged(out_dir: str | pathlib.Path) -> list[tuple[pathlib.Path, str, str]]:
    """(directory, final name, "tmp" or "old") of every staged directory under ``out_dir``."""
    root = pathlib.Path(out_dir) / "checkpoints"
    out = []
    for p in sorted(root.glob("step_*")):
        m = _STAGED_DIR.match(p.name)
        if m and p.is_dir():
            out.append((p, m.group(1), m.group(2)))
    return out


def recover(out_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """Put back every committed checkpoint that a crash left moved aside (between the two
    renames of a commit that replaces a step directory); returns the restored directories.
    Rank 0 calls it at the start, before looking for checkpoints."""
    restored = []
    for p, name, kind in _staged(out_dir):
        final = p.with_name(name)
        if kind == "old" and not final.exists() and (p / ".metadata").exists():
            p.rename(final)
            restored.append(final)
    return restored


def remove_stale(out_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """Delete the temporary directories of saves that never committed and the leftovers of
    replaced checkpoints; returns them. Rank 0 calls it at the start of a run (one run writes
    to an ``out_dir`` at a time)."""
    removed = []
    for p, _, _ in _staged(out_dir):
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


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
    return {
        "model": shared,
        "optim": optimizer.state_dict(),
        "train": dict(train_state),
        f"rank{rank}": {"rng": _rng_state(device), "buffers": own},
    }


def _commit(tmp: pathlib.Path, final: pathlib.Path, token: str) -> None:
    """Rename the finished ``tmp`` to ``final``. An existing ``final`` is first renamed aside and
    deleted only after the new one is in place, so a crash leaves one of the two complete
    (:func:`recover` puts an aside one back)."""
    if final.exists():
        aside = final.with_name(f"{final.name}.old-{token}")
        final.rename(aside)
        tmp.rename(final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        tmp.rename(final)


def save(
    out_dir: str | pathlib.Path,
    step: int,
    model,
    optimizer,
    train_state: dict,
    device: torch.device,
    run_info: dict | None = None,
    keep: int = 0,
) -> pathlib.Path:
    """Write a checkpoint of step ``step`` (a collective: every rank calls it) and return its
    directory. Everything, each rank's own entries included, goes into one temporary
    directory that rank 0 renames into place once every rank has written its part (with
    ``run_info`` as ``run.json``), then :func:`prune` keeps the ``keep`` newest (0: all)."""
    final = checkpoint_dir(out_dir, step)
    token = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)  # one temporary directory for all ranks
    tmp = final.with_name(f"{final.name}.tmp-{token[0]}")
    dcp.save(_state(model, optimizer, train_state, device, dist.get_rank()), checkpoint_id=str(tmp))
    collective.run(dist.barrier)  # every rank's files are written (and rank 0's .metadata)
    if dist.get_rank() == 0:
        if run_info is not None:
            (tmp / RUN_INFO).write_text(json.dumps(run_info, indent=1) + "\n")
        _commit(tmp, final, token[0])
        prune(out_dir, keep)
    collective.run(dist.barrier)  # nobody goes on before the checkpoint is in place
    return final


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
    buffers = {
        key[len(prefix) :]: torch.zeros(md.size, dtype=md.properties.dtype, device=device)
        for key, md in meta.items()
        if key.startswith(prefix)
    }
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
        warnings.warn(
            f"checkpoint {path} was written by {train_state['world_size']} ranks, this run has "
            f"{dist.get_world_size()}: model and optimizer are resharded, but the RNG streams (stochastic "
            "rounding seeds) restart, so the run is not bitwise the uninterrupted one",
            stacklevel=2,
        )
    return train_state
