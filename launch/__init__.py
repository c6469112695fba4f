"""Entry points and the example trainer (see docs/training.md). Not installed with dtq: run the
scripts from a checkout (``python launch/train.py``, ``torchrun ... launch/train.py``)."""
