"""Summarise a recipe fidelity study (bench/fidelity_study.sh): one markdown row per trainer metrics
log, the BF16 run as the reference, and one PNG of every run's loss curves.

    python bench/fidelity_summary.py runs/a/*.jsonl runs/b/*.jsonl --bf16 runs/a/bf16.jsonl \
        --png docs/fidelity_1b.png --md out.md --json out.json

Logs may come from several device calls: each row is named by its file's stem (``bf16.jsonl`` ->
``bf16``; the parent folder is added where two stems are equal). Every run must have been trained
with the reference's model, data, schedule, seed and world size (the config record each log starts
with is compared); ``--allow-mismatch`` compares them anyway and says so under the table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout: this checkout's dtq
    sys.path.insert(0, str(ROOT))

from dtq.launch import metrics  # noqa: E402

# The config keys that must agree between runs for their losses to be comparable (the recipe and
# how its parameters are stored are what the study varies; logging and output paths do not matter).
COMPARED_TRAIN_KEYS = (
    "steps",
    "batch_size",
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "weight_decay",
    "beta1",
    "beta2",
    "grad_clip",
    "seed",
    "dtype",
    "eval_every",
    "eval_batches",
)


def _config(path: pathlib.Path) -> dict | None:
    records = metrics.read(path, "config")
    return records[0] if records else None


def _interval_steps(train: list[dict]) -> list[int]:
    """How many optimizer steps each train record averages (its step minus the previous one's)."""
    return [r["step"] - (train[i - 1]["step"] if i else 0) for i, r in enumerate(train)]


def final_train_loss(train: list[dict], last_steps: int) -> tuple[float, list[int]]:
    """``(mean loss, the records' steps)`` over the last ``last_steps`` training steps: the logged
    interval means weighted by the steps each covers, whole intervals from the end until at least
    ``last_steps`` are covered (with ``log_every = 10``: the last record)."""
    covered, total, used = 0, 0.0, []
    for rec, n in zip(reversed(train), reversed(_interval_steps(train))):
        covered += n
        total += rec["loss"] * n
        used.append(rec["step"])
        if covered >= last_steps:
            break
    return total / covered, used[::-1]


def mean_at(row: dict, steps: list[int]) -> float | None:
    """``row``'s train loss over the intervals ending at ``steps`` (None unless it logged exactly
    those): the reference's loss over another run's final steps."""
    points = row["train_points"]
    if not all(str(s) in points for s in steps):
        return None
    n = sum(points[str(s)][1] for s in steps)
    return sum(points[str(s)][0] * points[str(s)][1] for s in steps) / n


def summarise_run(path: pathlib.Path, label: str, last_steps: int) -> dict:
    """One row's numbers from one metrics log (None where the log has none)."""
    cfg = _config(path)
    train = sorted(metrics.read(path, "train"), key=lambda r: r["step"])
    evals = sorted(metrics.read(path, "eval"), key=lambda r: r["step"])
    tc = (cfg or {}).get("config", {}).get("train", {})
    row = {
        "label": label,
        "file": str(path),
        "recipe": tc.get("recipe", label),
        "quantized_params": tc.get("quantized_params"),
        "planned_steps": tc.get("steps"),
        "steps": train[-1]["step"] if train else 0,
        "final_train_loss": None,
        "final_train_records": None,
        "train_points": {},
        "val_loss": evals[-1]["val_loss"] if evals else None,
        "val_step": evals[-1]["step"] if evals else None,
        "val_losses": {str(r["step"]): r["val_loss"] for r in evals},
        "tokens_per_s": None,
        "gathered_bytes_per_step": None,
        "gathered_by_kind_per_step": None,
        "peak_memory_bytes": None,
        "device": (cfg or {}).get("device"),
        "world_size": (cfg or {}).get("world_size"),
    }
    if not train:
        return row
    row["final_train_loss"], row["final_train_records"] = final_train_loss(train, last_steps)
    row["train_points"] = {str(r["step"]): [r["loss"], n] for r, n in zip(train, _interval_steps(train))}
    timed = train[1:] or train  # the first interval holds the warm-up (allocator, kernel loads)
    row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in timed)
    n = _interval_steps(train)[-1]
    gathered = train[-1].get("gathered_bytes")
    if gathered is not None:  # dtq's count of all-gathered bytes per rank, by format / direction
        row["gathered_by_kind_per_step"] = {k: v / n for k, v in sorted(gathered.items())}
        row["gathered_bytes_per_step"] = metrics.moved_bytes(gathered) / n  # "*_derived" counts moved nothing
    peaks = [r["peak_memory_bytes"] for r in train if r.get("peak_memory_bytes") is not None]
    row["peak_memory_bytes"] = max(peaks) if peaks else None
    return row


def config_mismatch(path: pathlib.Path, reference: pathlib.Path) -> list[str]:
    """The settings (``table.key: this run's value != the reference's``) that make ``path``'s losses
    incomparable with ``reference``'s; empty when none does or a log has no config record."""
    a, b = _config(path), _config(reference)
    if a is None or b is None:
        return []
    out = []
    for table in ("model", "data"):
        for key in sorted(set(a["config"][table]) | set(b["config"][table])):
            va, vb = a["config"][table].get(key), b["config"][table].get(key)
            if va != vb:
                out.append(f"{table}.{key}: {va!r} != {vb!r}")
    for key in COMPARED_TRAIN_KEYS:
        va, vb = a["config"]["train"].get(key), b["config"]["train"].get(key)
        if va != vb:
            out.append(f"train.{key}: {va!r} != {vb!r}")
    if a.get("world_size") != b.get("world_size"):
        out.append(f"world_size: {a.get('world_size')!r} != {b.get('world_size')!r}")
    return out


def labels_for(paths: list[pathlib.Path]) -> list[str]:
    """File stems, with the parent folder where two stems are equal (runs of several calls)."""
    stems = [p.stem for p in paths]
    return [f"{p.parent.name}/{p.stem}" if stems.count(p.stem) > 1 else p.stem for p in paths]


def find_reference(paths: list[pathlib.Path], bf16: str | None) -> pathlib.Path | None:
    """The ``--bf16`` log, else the one run whose config says ``recipe = "bf16"`` (None: no
    reference, the "vs BF16" columns stay empty)."""
    if bf16 is not None:
        ref = pathlib.Path(bf16)
        if not ref.exists():
            raise FileNotFoundError(f"fidelity_summary: --bf16 {ref}: no such metrics log")
        return ref
    found = [p for p in paths if ((_config(p) or {}).get("config", {}).get("train", {}).get("recipe")) == "bf16"]
    if len(found) > 1:
        raise ValueError(
            f"fidelity_summary: {len(found)} logs ran recipe bf16 ({', '.join(map(str, found))}); "
            "name the reference with --bf16 FILE"
        )
    return found[0] if found else None


def _pct(value: float | None, ref: float | None) -> str:
    if value is None or ref is None:
        return "—"
    return f"{100 * (value / ref - 1):+.2f}%".replace("-", "−")


def _bytes(n: float | None) -> str:
    return "—" if n is None else metrics.human_bytes(n)


def markdown(rows: list[dict], ref: dict | None, last_steps: int, notes: list[str]) -> str:
    """The table and what each column means."""
    lines = [
        "| run | recipe | parameters | steps | final train loss | vs BF16 | validation loss (step) | vs BF16 "
        "| tokens/s | gathered per step | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        steps = str(r["steps"])
        if r["planned_steps"] is not None and r["steps"] < r["planned_steps"]:
            steps = f"{r['steps']} of {r['planned_steps']} (incomplete)"
        params = {True: "quantized", False: "high precision", None: "—"}[r["quantized_params"]]
        if r["final_train_loss"] is None:
            lines.append(f"| {r['label']} | {r['recipe']} | {params} | {steps} | no training records |" + " — |" * 6)
            continue
        other = ref is not None and r is not ref  # the reference's own row compares with nothing
        ref_val = ref["val_losses"].get(str(r["val_step"])) if other else None
        ref_train = mean_at(ref, r["final_train_records"]) if other else None
        val = "—" if r["val_loss"] is None else f"{r['val_loss']:.4f} ({r['val_step']})"
        gathered = _bytes(r["gathered_bytes_per_step"])
        if r["gathered_by_kind_per_step"]:
            gathered += " (" + ", ".join(f"{k} {_bytes(v)}" for k, v in r["gathered_by_kind_per_step"].items()) + ")"
        peak = "—" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.1f}"
        lines.append(
            f"| {r['label']} | {r['recipe']} | {params} | {steps} | {r['final_train_loss']:.4f} "
            f"| {_pct(r['final_train_loss'], ref_train)} | {val} | {_pct(r['val_loss'], ref_val)} "
            f"| {r['tokens_per_s']:,.0f} | {gathered} | {peak} |"
        )
    lines += [
        "",
        f"- Final train loss: mean over the last {last_steps} training steps (the means the trainer logs per "
        "interval of train.log_every steps, weighted by the steps each covers, whole intervals from the end); "
        'validation loss: the last evaluation, at the step in brackets. "vs BF16": against the reference run '
        + (f"`{ref['label']}`" if ref is not None else "(none given: --bf16)")
        + " at the same steps.",
        "- tokens/s: median over the log intervals after the first (warm-up); gathered per step: dtq's "
        "all-gathered bytes per rank and step by format / direction (last log interval); peak: the most "
        "memory allocated on rank 0 (CUDA only).",
    ]
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", help="trainer metrics logs (metrics.jsonl, or $OUT/<recipe>.jsonl)")
    p.add_argument("--bf16", help="the reference run's log (default: the one log whose recipe is bf16)")
    p.add_argument("--md", help="write the markdown table here (it is printed either way)")
    p.add_argument("--json", help="write every row's numbers here")
    p.add_argument("--png", help="draw every run's train and validation loss into this PNG (needs matplotlib)")
    p.add_argument("--title", default="loss by recipe", help="the PNG's title")
    p.add_argument("--last-steps", type=int, default=10, help="steps the final train loss averages (default 10)")
    p.add_argument("--allow-mismatch", action="store_true", help="compare runs whose configs differ (noted)")
    args = p.parse_intermixed_args(argv)  # logs may follow options too

    paths = [pathlib.Path(a) for a in args.logs]
    for path in paths:
        if not path.is_file():
            raise SystemExit(f"fidelity_summary: no metrics log at {path}")
    try:
        ref_path = find_reference(paths, args.bf16)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(str(e)) from None
    if ref_path is not None and all(ref_path.resolve() != q.resolve() for q in paths):
        paths.insert(0, ref_path)
    labels = labels_for(paths)
    notes = []
    if ref_path is not None:
        for path in paths:
            diff = config_mismatch(path, ref_path)
            if diff and not args.allow_mismatch:
                raise SystemExit(
                    f"fidelity_summary: {path} was not trained like the reference {ref_path}: {'; '.join(diff)}. "
                    "Its losses are not comparable; rerun it with the reference's config, or pass --allow-mismatch"
                )
            if diff:
                notes.append(f"`{labels[paths.index(path)]}` differs from the reference: {'; '.join(diff)}.")
    rows = [summarise_run(path, label, args.last_steps) for path, label in zip(paths, labels)]
    ref = rows[[q.resolve() for q in paths].index(ref_path.resolve())] if ref_path is not None else None
    devices = sorted({f"{r['device']} x {r['world_size']}" for r in rows if r["device"] is not None})
    if len(devices) > 1:
        notes.append(
            f"The runs ran on different devices / world sizes ({', '.join(devices)}): compare tokens/s with care."
        )
    table = markdown(rows, ref, args.last_steps, notes)
    print(table, end="")
    if args.md:
        pathlib.Path(args.md).write_text(table)
    result = {"reference": ref["label"] if ref else None, "last_steps": args.last_steps, "notes": notes, "runs": rows}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.png:
        from dtq.launch import plot_loss

        drawn = [(str(r["file"]), r["label"]) for r in rows if r["final_train_loss"] is not None]
        files, names = zip(*drawn)
        out = plot_loss.plot(
            list(files),
            args.png,
            labels=list(names),
            title=args.title,
            baseline=str(ref_path) if ref is not None and ref["final_train_loss"] is not None else None,
        )
        print(f"wrote {out}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
