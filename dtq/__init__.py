"""dtq: per-direction ("hybrid") quantized parameters as first-class citizens of sharded training."""

import torch

from dtq import (
    checkpoint,
    nn,
    optim,
    parallel,
    presets,
    recipes,
    shapes,
    tensor_ops,  # noqa: F401  (installs QuantizedTensor's op table)
    testing,
)
from dtq.autocast import autocast
from dtq.codec import registered_quantizers
from dtq.convert import ConvertReport, convert
from dtq.formats import (
    COLUMNWISE,
    DIRECTIONS,
    ROWWISE,
    Float8BlockQuantizer,
    Float8Quantizer,
    Float8RowwiseQuantizer,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)
from dtq.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    HybridRecipe,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QuantizerRole,
    Recipe,
    hybrid_recipe,
)
from dtq.size_rule import SizeRule, apply_size_rule
from dtq.tensor import SAFE_GLOBALS, QuantizedTensor
from dtq.weights import HighPrecisionWeight

__version__ = "0.1.0"


def quantized_safe_globals() -> list:
    """Classes that ``torch.load(weights_only=True)`` must accept to rebuild dtq tensors and weights."""
    return [*SAFE_GLOBALS, HighPrecisionWeight, HybridQuantizer, *registered_quantizers()]


# torch.load(weights_only=True) rebuilds QuantizedTensors (payloads bit-exact) without extra setup.
torch.serialization.add_safe_globals(quantized_safe_globals())

__all__ = [
    "SizeRule",
    "apply_size_rule",
    "Quantizer",
    "Float8Quantizer",
    "Float8BlockQuantizer",
    "Float8RowwiseQuantizer",
    "MXFP8Quantizer",
    "NVFP4Quantizer",
    "IdentityQuantizer",
    "HybridQuantizer",
    "QuantizedTensor",
    "ROWWISE",
    "COLUMNWISE",
    "DIRECTIONS",
    "QuantizerRole",
    "Recipe",
    "CustomRecipe",
    "Float8CurrentScaling",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8RowwiseScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "HybridRecipe",
    "hybrid_recipe",
    "autocast",
    "nn",
    "convert",
    "ConvertReport",
    "parallel",
    "recipes",
    "presets",
    "shapes",
    "testing",
    "optim",
    "checkpoint",
]
