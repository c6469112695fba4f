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


def progress_line(rec: dict[str, Any], total_steps: int) -> str:
    """``step  20/40 | loss 3.1416 | lr 2.7e-03 | 12,345 tok/s | gathered 1.23 MB (mxfp8/rowwise 0.82 MB, ...)``"""
    gathered = rec.get("gathered_bytes") or {}
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(gathered.items()))
    width = len(str(total_steps))
    return (f"step {rec['step']:>{width}}/{total_steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.1e} | "
            f"{rec['tokens_per_s']:,.0f} tok/s | gathered {human_bytes(sum(gathered.values()))}"
            + (f" ({parts})" if parts else ""))


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
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
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
