"""The example trainer (see docs/training.md): ``dtq-train`` / ``python -m dtq.launch.train``, or
``launch/train.py`` from a checkout. Not imported by ``import dtq``: it needs nothing beyond dtq's
own dependencies, and its optional pieces (mpirun, plots, the transformers model, the progress
bar) take the extras ``mpi``, ``plot``, ``hf`` and ``train``."""
