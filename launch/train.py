"""The example trainer from a checkout: ``launch/train.py`` runs ``dtq.launch.train`` (the same
program as the installed ``dtq-train`` command), importing dtq from this repository. See
docs/training.md."""

import pathlib
import sys

# Run as a script, sys.path[0] is launch/: put the repository root there instead, so that this
# checkout's dtq is the one imported.
sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

from dtq.launch.train import cli  # noqa: E402

if __name__ == "__main__":
    cli()
