"""Plot the loss curves of several runs into one PNG.

    python -m dtq.launch.plot_loss runs/bf16/metrics.jsonl runs/hybrid/metrics.jsonl -o loss.png

(``python launch/plot_loss.py ...`` from a checkout is the same program.)

Each argument is a trainer metrics log (``metrics.jsonl``) or a run directory holding one; the
legend names each run by its directory unless ``--labels`` says otherwise. Training loss is drawn
solid, validation loss (when logged) as markers. Needs matplotlib: ``pip install 'dtq[plot]'``.
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


def plot(
    logs: list[str], out: str, labels: list[str] | None = None, title: str | None = None, log_y: bool = False
) -> pathlib.Path:
    """Draw every log's train (and eval) loss against the step into ``out`` (a PNG)."""
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
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for i, arg in enumerate(logs):
        path = _metrics_path(arg)
        label = labels[i] if labels else path.parent.name
        train = read(path, "train")
        if not train:
            raise ValueError(f"plot_loss: {path} has no training records")
        (line,) = ax.plot([r["step"] for r in train], [r["loss"] for r in train], label=f"{label} (train)")
        evals = read(path, "eval")
        if evals:
            ax.plot(
                [r["step"] for r in evals],
                [r["val_loss"] for r in evals],
                "o",
                color=line.get_color(),
                label=f"{label} (validation)",
            )
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
    args = p.parse_args(argv)
    out = plot(args.logs, args.out, args.labels, args.title, args.log_y)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
