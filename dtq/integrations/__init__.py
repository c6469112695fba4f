"""dtq inside the trainers its users already run. Each submodule imports its framework, so import
the one you use: ``dtq.integrations.torchtitan`` (a model converter and its post-optimizer hook),
``dtq.integrations.lightning`` (a ``Precision`` plugin), ``dtq.integrations.accelerate`` (a
``prepare`` for ``accelerate.Accelerator``). docs/integrations.md shows the lines each one needs."""
