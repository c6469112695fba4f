"""The example trainer (see docs/training.md): ``dtq-train`` / ``python -m dtq.launch.train``, or
``launch/train.py`` from a checkout. Not imported by ``import dtq``: it needs the ``train`` extra
(pydantic validates its config, tqdm draws its progress bar), and its optional pieces (mpirun,
plots, the transformers model) take the extras ``mpi``, ``plot`` and ``hf``."""
