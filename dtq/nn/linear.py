"""``dtq.nn.Linear``: ``y = x @ W.T + b`` with the three GEMMs quantized by the active recipe."""

from __future__ import annotations

import torch

from dtq.nn.module import QuantizedModule, init_bias, init_weight


class Linear(QuantizedModule):
    """Drop-in for ``torch.nn.Linear``. Roles: ``("linear", t, name)`` for t in input, weight,
    grad_output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: torch.dtype | None = None, device=None, name: str = ""):
        super().__init__(name)
        dtype = params_dtype or torch.get_default_dtype()
        self.in_features, self.out_features = in_features, out_features
        self.weight = init_weight(out_features, in_features, dtype, device)
        self.bias = init_bias(out_features, in_features, dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, name={self.name!r}"
