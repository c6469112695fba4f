"""``GroupedLinear``: ``num_gemms`` independent linears applied to consecutive row groups
(MoE experts): ``forward(x, m_splits)`` splits x's rows by ``m_splits``."""

from __future__ import annotations

import torch

from dtq.nn.module import QuantizedModule, init_bias, init_weight


class GroupedLinear(QuantizedModule):
    """Roles: ``("grouped_linear", t, f"{name}.gemm{i}")`` for each GEMM i and t in input, weight,
    grad_output. Parameters ``weight{i}`` / ``bias{i}``."""

    module_type = "grouped_linear"

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        params_dtype: torch.dtype | None = None,
        device=None,
        name: str = "",
    ):
        super().__init__(name)
        if num_gemms < 1:
            raise ValueError(f"GroupedLinear: num_gemms={num_gemms} must be >= 1")
        dtype = params_dtype or torch.get_default_dtype()
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", init_weight(out_features, in_features, dtype, device))
            self.register_parameter(f"bias{i}", init_bias(out_features, in_features, dtype, device) if bias else None)

    def gemm_suffixes(self) -> list[str]:
        return [f".gemm{i}" for i in range(self.num_gemms)]

    def weight_names(self) -> list[str]:
        return [f"weight{i}" for i in range(self.num_gemms)]

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        m_splits = list(m_splits)
        rows = x.reshape(-1, x.shape[-1])
        if len(m_splits) != self.num_gemms or sum(m_splits) != rows.shape[0]:
            raise ValueError(
                f"GroupedLinear: m_splits={m_splits} must have {self.num_gemms} entries summing to the "
                f"{rows.shape[0]} rows of the input (shape {list(x.shape)})"
            )
        outs = [
            self._linear(chunk, getattr(self, f"weight{i}"), getattr(self, f"bias{i}"), gemm=i)
            for i, chunk in enumerate(rows.split(m_splits))
        ]
        return torch.cat(outs).reshape(*x.shape[:-1], self.out_features)
