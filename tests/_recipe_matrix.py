"""The recipes every matrix test runs: each built-in recipe, the MXFP8/NVFP4 hybrid, a
``CustomRecipe`` no preset makes (its weights' columnwise payloads quantized from their rowwise
ones, in two amax rounds), and a backward override."""

from __future__ import annotations

import dtq


def _custom_factory(role):
    # A recipe no preset makes: hybrid weights (per-tensor FP8 forward; NVFP4 backward quantized from
    # the dequantized FP8 rowwise payload: both take a tensor-wide amax, so shards reduce the
    # columnwise one in a second round), MXFP8 inputs, NVFP4 gradients with stochastic rounding.
    if role.tensor_type == "weight":
        return dtq.HybridQuantizer(
            rowwise=dtq.Float8Quantizer(),
            columnwise=dtq.NVFP4Quantizer((1, 16)),
            columnwise_source="rowwise_dequantized",
        )
    if role.tensor_type == "input":
        return dtq.MXFP8Quantizer()
    return dtq.NVFP4Quantizer((1, 16), stochastic_rounding=True)


RECIPES = {
    "fp8": lambda: dtq.Float8CurrentScaling(),
    "fp8_delayed": lambda: dtq.DelayedScaling(amax_history_len=4),
    "fp8_block": lambda: dtq.Float8BlockScaling(),
    "fp8_row": lambda: dtq.Float8RowwiseScaling(),
    "mxfp8": lambda: dtq.MXFP8BlockScaling(),
    "nvfp4": lambda: dtq.NVFP4BlockScaling(),
    "hybrid_mxfp8_nvfp4": lambda: dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling()),
    "custom": lambda: dtq.CustomRecipe(_custom_factory),
    "fp8_dequantized_bwd": lambda: dtq.Float8CurrentScaling(backward_override="dequantized"),
}
