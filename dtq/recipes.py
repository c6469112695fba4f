"""Named quantizer factories for :class:`dtq.CustomRecipe`: the hybrid and NVFP4 variants worth
comparing, each a plain module-level function (so the recipe pickles and compares by value).

Use one as ``dtq.CustomRecipe(dtq.recipes.mxfp8_fwd_nvfp4_bwd)``; the trainer knows each by its
name (``recipe = "mxfp8_fwd_nvfp4_bwd"``). docs/recipes.md tabulates the formats per role.

In every factory the forward GEMM (fprop) reads the rowwise payloads of input and weight, dgrad
the gradient's rowwise and the weight's columnwise payload, wgrad the columnwise payloads of
gradient and input.
"""

from __future__ import annotations

from collections.abc import Callable

from dtq.formats import HybridQuantizer, IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer
from dtq.recipe import QuantizerRole


def _grad(role: QuantizerRole) -> bool:
    return role.tensor_type == "grad_output"


def mxfp8_fwd_nvfp4_bwd(role: QuantizerRole) -> Quantizer:
    """MXFP8 forward, NVFP4 backward: inputs and weights MXFP8 rowwise; columnwise NVFP4 1x16
    (the weight's plain, quantized from its dequantized MXFP8 rowwise payload so that dgrad sees
    the weight fprop saw; the input's from the input, with the random Hadamard, for wgrad);
    gradients NVFP4 with stochastic rounding and the random Hadamard on their wgrad (columnwise)
    payload."""
    if _grad(role):
        return NVFP4Quantizer(stochastic_rounding=True, random_hadamard=True)
    if role.tensor_type == "weight":
        return HybridQuantizer(
            rowwise=MXFP8Quantizer(), columnwise=NVFP4Quantizer(), columnwise_source="rowwise_dequantized"
        )
    return HybridQuantizer(rowwise=MXFP8Quantizer(), columnwise=NVFP4Quantizer(random_hadamard=True))


def nvfp4_1d_weight(role: QuantizerRole) -> Quantizer:
    """NVFP4 everywhere with 1x16 weight blocks (NVFP4BlockScaling's weights are 16x16): the
    weight's rowwise and columnwise payloads are then separate 1-D quantizations. Inputs take the
    random Hadamard on their wgrad payload; gradients also stochastic rounding."""
    if role.tensor_type == "weight":
        return NVFP4Quantizer()
    return NVFP4Quantizer(stochastic_rounding=_grad(role), random_hadamard=True)


def mxfp8_fwd_high_precision_bwd(role: QuantizerRole) -> Quantizer | None:
    """MXFP8 forward only: inputs and weights MXFP8 rowwise, their columnwise payloads the
    high-precision values; gradients unquantized. Unlike ``backward_override="high_precision"`` it
    works per slot, so it can be mixed with other factories."""
    if _grad(role):
        return None
    return HybridQuantizer(rowwise=MXFP8Quantizer(), columnwise=IdentityQuantizer())


def high_precision_fwd_mxfp8_bwd(role: QuantizerRole) -> Quantizer:
    """MXFP8 backward only: the forward GEMM in high precision (rowwise payloads keep the values),
    dgrad and wgrad on MXFP8 columnwise payloads and MXFP8 gradients."""
    if _grad(role):
        return MXFP8Quantizer()
    return HybridQuantizer(rowwise=IdentityQuantizer(), columnwise=MXFP8Quantizer())


def nvfp4_row_scaled_fwd_mxfp8_bwd(role: QuantizerRole) -> Quantizer:
    """Row-scaled NVFP4 forward (one global scale per row of input and weight: docs/formats.md,
    "NVFP4 options"), MXFP8 backward (columnwise payloads and gradients). Row-scaled weights cannot
    be quantized parameters sharded along their last dim (tensor-parallel row layers)."""
    if _grad(role):
        return MXFP8Quantizer()
    return HybridQuantizer(rowwise=NVFP4Quantizer(row_scaled=True), columnwise=MXFP8Quantizer())


FACTORIES: dict[str, Callable[[QuantizerRole], Quantizer | None]] = {
    f.__name__: f
    for f in (
        mxfp8_fwd_nvfp4_bwd,
        nvfp4_1d_weight,
        mxfp8_fwd_high_precision_bwd,
        high_precision_fwd_mxfp8_bwd,
        nvfp4_row_scaled_fwd_mxfp8_bwd,
    )
}
