"""The progress line and the JSON-lines metrics log (written by rank 0 only).

Each line of ``metrics.jsonl`` is one record: ``{"kind": "train", "step", "loss", "lr",
"tokens_per_s", "gathered_bytes": {"<format>/<direction>": bytes}, ...}`` per log interval, or
``{"kind": "eval", "step", "val_loss"}``; the first line of a run is ``{"kind": "config", ...}``.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def moved_bytes(gathered: dict[str, int]) -> int:
    """What dtq's gathers moved: the ``*_derived`` counts are payloads computed after a gather instead."""
    return sum(v for k, v in gathered.items() if not k.endswith("_derived"))


def progress_line(rec: dict[str, Any], total_steps: int) -> str:
    """``step  20/40 | loss 3.1416 | lr 2.7e-03 | 12,345 tok/s | gathered 1.23 MB (mxfp8/rowwise 0.82 MB,
    ...) | reduce-scattered 2.46 MB | 95 ms/step | peak 3.2 GiB`` (the last three where recorded)."""
    gathered = rec.get("gathered_bytes") or {}
    collectives = rec.get("collective_bytes") or {}
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(gathered.items()))
    moved = moved_bytes(gathered)
    if not gathered and collectives.get("all_gathered"):  # plain weights (parallel.quantized_gather = false)
        moved, parts = collectives["all_gathered"], "unquantized weights"
    width = len(str(total_steps))
    line = (
        f"step {rec['step']:>{width}}/{total_steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.1e} | "
        f"{rec['tokens_per_s']:,.0f} tok/s | gathered {human_bytes(moved)}" + (f" ({parts})" if parts else "")
    )
    if "reduce_scattered" in collectives:
        line += f" | reduce-scattered {human_bytes(collectives['reduce_scattered'])}"
    if "step_s" in rec:
        line += f" | {rec['step_s'] * 1e3:,.0f} ms/step"
    if rec.get("peak_memory_bytes") is not None:
        line += f" | peak {rec['peak_memory_bytes'] / 2**30:.1f} GiB"
    return line


class CollectiveBytes:
    """Bytes this rank passes through torch.distributed's tensor all-gathers (output),
    reduce-scatters (input) and ``all_reduce``, counted while the context is open: FSDP2's parameter
    gathers and gradient reduce-scatters, HSDP's gradient all-reduce across replicas, and the
    trainer's own small reductions (loss, gradient norm, amaxes). Wraps the ``torch.distributed``
    functions, which FSDP2 looks up at each call, and restores them on exit. Both spellings are
    wrapped where present (torch 2.13's FSDP2 calls ``*_single``, 2.11's ``*_into_tensor`` /
    ``reduce_scatter_tensor``; the deprecated names forward to the new ones without passing
    through ``torch.distributed`` again, so nothing counts twice)."""

    _WRAPPED = {
        "all_gather_into_tensor": ("all_gathered", 0, "output_tensor"),
        "all_gather_single": ("all_gathered", 0, "output_tensor"),
        "reduce_scatter_tensor": ("reduce_scattered", 1, "input"),
        "reduce_scatter_single": ("reduce_scattered", 1, "input"),
        "all_reduce": ("all_reduced", 0, "tensor"),
    }

    def __init__(self):
        self.counts: dict[str, int] = {}
        self._originals: dict[str, Any] = {}

    def _wrap(self, fn, key: str, index: int, keyword: str):
        def counted(*args, **kwargs):
            t = args[index] if len(args) > index else kwargs[keyword]
            self.counts[key] = self.counts.get(key, 0) + t.numel() * t.element_size()
            return fn(*args, **kwargs)

        return counted

    def __enter__(self) -> CollectiveBytes:
        import torch.distributed as dist

        for name, (key, index, keyword) in self._WRAPPED.items():
            if not hasattr(dist, name):
                continue
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(self._originals[name], key, index, keyword))
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def take(self) -> dict[str, int]:
        """The counts since the last call, then zero."""
        out, self.counts = self.counts, {}
        return out


class MetricsLog:
    """Appends records to ``path``. ``resume_step``: records of later steps (written after the
    checkpoint the run resumes from) are dropped, so the log reads as one uninterrupted run."""

    def __init__(self, path: str | pathlib.Path, enabled: bool, resume_step: int | None = None):
        self.path, self.enabled = pathlib.Path(path), enabled
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= resume_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def read(path: str | pathlib.Path, kind: str = "train") -> list[dict[str, Any]]:
    """The records of one kind from a metrics log."""
    out = []
    for line in pathlib.Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec.get("kind") == kind:
                out.append(rec)
    return out
