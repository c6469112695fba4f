"""Plot the loss curves of several runs into one PNG.

    python -m dtq.launch.plot_loss runs/bf16/metrics.jsonl runs/hybrid/metrics.jsonl -o loss.png

(``python launch/plot_loss.py ...`` from a checkout is the same program.)

Each argument is a trainer metrics log (``metrics.jsonl``) or a run directory holding one; the
legend names each run by its directory unless ``--labels`` says otherwise. Training loss is drawn
solid, validation loss (when logged) as markers. ``--baseline LOG`` adds a panel below with every
other run's losses relative to that run's at the same steps, in % (differences of a percent are
invisible on the full curves). Needs matplotlib: ``pip install 'dtq[plot]'``.
"""

from __future__ import annotations

import argparse
import pathlib

from dtq.launch.metrics import read


def _metrics_path(arg: str) -> pathlib.Path:
    p = pathlib.Path(arg)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.exists():
        raise FileNotFoundError(f"plot_loss: no metrics log at {p}")
    return p


def _curves(path: pathlib.Path) -> tuple[dict[int, float], dict[int, float]]:
    """``({step: train loss}, {step: validation loss})`` of one log."""
    train = {r["step"]: r["loss"] for r in read(path, "train")}
    if not train:
        raise ValueError(f"plot_loss: {path} has no training records")
    return train, {r["step"]: r["val_loss"] for r in read(path, "eval")}


def plot(
    logs: list[str],
    out: str,
    labels: list[str] | None = None,
    title: str | None = None,
    log_y: bool = False,
    baseline: str | None = None,
) -> pathlib.Path:
    """Draw every log's train (and eval) loss against the step into ``out`` (a PNG); with
    ``baseline`` (a log or run directory), a second panel of each run's loss relative to it."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "plot_loss needs matplotlib: pip install matplotlib (or dtq's extra: "
            "pip install 'dtq[plot]', in a checkout pip install -e '.[plot]')"
        ) from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    if labels is not None and len(labels) != len(logs):
        raise ValueError(f"plot_loss: {len(labels)} labels for {len(logs)} logs")
    base = None if baseline is None else _metrics_path(baseline)
    if base is None:
        fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    else:
        fig, (ax, rel) = plt.subplots(2, 1, figsize=(8, 8), dpi=120, sharex=True, height_ratios=(3, 2))
        base_train, base_val = _curves(base)
        late: list[float] = []  # the relative losses after the first fifth of training set the panel's range
    for i, arg in enumerate(logs):
        path = _metrics_path(arg)
        label = labels[i] if labels else path.parent.name
        train, evals = _curves(path)
        (line,) = ax.plot(list(train), list(train.values()), label=f"{label} (train)")
        if evals:
            ax.plot(list(evals), list(evals.values()), "o", color=line.get_color(), label=f"{label} (validation)")
        if base is None or path.resolve() == base.resolve():
            continue
        for curve, ref, style in ((train, base_train, "-"), (evals, base_val, "o")):
            steps = [s for s in curve if s in ref]
            pct = [100 * (curve[s] / ref[s] - 1) for s in steps]
            rel.plot(steps, pct, style, color=line.get_color(), label=label if style == "-" else None)
            late += [v for s, v in zip(steps, pct) if s >= max(base_train) / 5]
    if base is not None:
        rel.axhline(0.0, color="black", linewidth=0.8)
        if late:  # early steps differ by far more, and would hide the differences that matter
            pad = max(0.5, 0.1 * (max(late) - min(late)))
            rel.set_ylim(min(min(late), 0.0) - pad, max(max(late), 0.0) + pad)
        rel.set_xlabel("step")
        rel.set_ylabel(f"loss vs {base.stem if base.name != 'metrics.jsonl' else base.parent.name} (%)")
        rel.grid(alpha=0.3)
        if late:
            rel.legend()
    else:
        ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title or "training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_path = pathlib.Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png")
    plt.close(fig)
    return out_path


def main(argv: list[str] | None = None) -> pathlib.Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", help="metrics.jsonl files or run directories")
    p.add_argument("-o", "--out", default="loss.png", help="PNG to write (default: loss.png)")
    p.add_argument("--labels", nargs="+", help="one legend label per log")
    p.add_argument("--title")
    p.add_argument("--log-y", action="store_true", help="logarithmic loss axis")
    p.add_argument("--baseline", help="a log or run directory: add a panel of each run's loss relative to it (%%)")
    args = p.parse_args(argv)
    out = plot(args.logs, args.out, args.labels, args.title, args.log_y, args.baseline)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
