"""``python launch/plot_loss.py runs/a runs/b -o loss.png`` from a checkout: runs
``dtq.launch.plot_loss`` (the same as ``python -m dtq.launch.plot_loss``), importing dtq from this
repository."""

import pathlib
import sys

sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])  # this checkout's dtq, not launch/

from dtq.launch.plot_loss import main  # noqa: E402

if __name__ == "__main__":
    main()
