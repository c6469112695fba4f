"""dtq modules: drop-in GEMM layers whose GEMMs run on quantized payloads under ``dtq.autocast``."""

from dtq.nn import functional
from dtq.nn.grouped_linear import GroupedLinear
from dtq.nn.layernorm import LayerNormLinear, LayerNormMLP
from dtq.nn.linear import Linear
from dtq.nn.module import QuantizedModule

__all__ = ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "QuantizedModule", "functional"]
