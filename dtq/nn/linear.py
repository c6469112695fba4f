"""``dtq.nn.Linear``: ``y = x @ W.T + b`` with the three GEMMs quantized by the active recipe."""

from __future__ import annotations

import torch

from dtq.nn.module import QuantizedModule, as_weight
from dtq.nn.torch_tp import linear_forward


class Linear(torch.nn.Linear, QuantizedModule):
    """Drop-in for ``torch.nn.Linear``, and an instance of it (as torchao's ``Float8Linear`` is), so
    code that looks for ``nn.Linear`` (``isinstance`` checks in transformers, PEFT, torch's
    tensor-parallel styles) finds it; ``in_features``, ``out_features``, ``weight`` ``[out, in]``
    and ``bias`` mean what they mean there. Roles: ``("linear", t, name)`` for t in input,
    weight, grad_output. ``dtype`` is ``nn.Linear``'s name for ``params_dtype``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        params_dtype: torch.dtype | None = None,
        device=None,
        name: str = "",
        dtype: torch.dtype | None = None,
    ):
        if params_dtype is not None and dtype is not None and params_dtype != dtype:
            raise ValueError(f"dtq.nn.Linear: params_dtype={params_dtype} and dtype={dtype} disagree; pass one")
        # nn.Linear.__init__ makes and initializes the parameters (and runs QuantizedModule's
        # __init__ through the MRO); the weight is then wrapped without a copy.
        torch.nn.Linear.__init__(
            self,
            in_features,
            out_features,
            bias,
            device=device,
            dtype=params_dtype or dtype or torch.get_default_dtype(),
        )
        self.name = name
        self.weight = as_weight(self.weight.data)

    reset_parameters = QuantizedModule.reset_parameters  # nn.Linear's would write into quantized weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(x, "device_mesh"):  # a DTensor: torch's own ColwiseParallel / RowwiseParallel drive this module
            return linear_forward(self, x)
        return self._linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"name={self.name!r}"
        )
