"""torchtitan's Llama 3 debug model trained with dtq (MXFP8 GEMMs; FSDP2 gathers the weights in
MXFP8 across hosts and unquantized within one, ``quantized_gather="auto"``).

A torchtitan ``config_registry`` module: torchtitan's trainer imports it by module path.

    torchrun --nproc-per-node 2 -m torchtitan.train --module examples.torchtitan_dtq \
        --config llama3_debugmodel_dtq

It needs what torchtitan's trainer needs (CUDA GPUs, triton, the tokenizer assets its debug
config names: run it from a directory that has ./tests/assets/tokenizer, or set
``hf_assets_path``). tests/integrations/test_torchtitan.py runs the same converter and hook on CPU.
"""

from __future__ import annotations

from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from dtq.integrations.torchtitan import DtqConverter, master_weight_optimizers, post_optimizer_build_fn


def llama3_debugmodel_dtq(recipe: str = "mxfp8") -> Trainer.Config:
    """torchtitan's debug config with every Linear but the output projection converted to dtq."""
    config = llama3_debugmodel()
    config.model_spec = model_registry(
        "debugmodel", converters=[DtqConverter.Config(recipe=recipe, filter_fqns=["lm_head"])]
    )
    config.model_spec.post_optimizer_build_fn = post_optimizer_build_fn
    config.parallelism.spmd_backend = "partial_dtensor"  # FSDP2 shards the dtq weights, not torchtitan
    return config


def llama3_debugmodel_dtq_quantized() -> Trainer.Config:
    """The same with the converted weights stored as MXFP8 quantized parameters, stepped by FP32
    master weights."""
    config = llama3_debugmodel_dtq()
    config.model_spec = model_registry(
        "debugmodel",
        converters=[DtqConverter.Config(recipe="mxfp8", filter_fqns=["lm_head"], quantized_params=True)],
    )
    config.model_spec.post_optimizer_build_fn = post_optimizer_build_fn
    config.optimizer = master_weight_optimizers(config.optimizer)
    return config


def llama3_debugmodel_dtq_hybrid() -> Trainer.Config:
    """The same with MXFP8 forward GEMMs and NVFP4 backward GEMMs."""
    return llama3_debugmodel_dtq("hybrid")
