"""``LayerNormLinear`` and ``LayerNormMLP``: a high-precision norm feeding quantized GEMMs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtq.distributed import tp
from dtq.nn.functional import AmaxLink, swiglu
from dtq.nn.module import QuantizedModule, init_bias, init_weight

NORMS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "swiglu")


class _Norm(torch.nn.Module):
    # Under tensor parallelism (dtq.parallel styles, through set_tensor_parallel) the parameters
    # are replicated DTensors on this mesh; with sequence parallelism each rank normalizes its own
    # rows, so their gradients are summed over the group.
    tp_mesh = None
    tp_reduce_grads = False

    def __init__(self, kind: str, hidden: int, eps: float, dtype, device):
        super().__init__()
        if kind not in NORMS:
            raise ValueError(f"normalization={kind!r}; use one of {NORMS}")
        self.kind, self.eps = kind, eps
        self.weight = torch.nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(hidden, dtype=dtype, device=device)) if kind == "LayerNorm" else None

    def set_tensor_parallel(self, mesh, sequence_parallel: bool) -> None:
        """Parameters replicated on ``mesh``; with ``sequence_parallel`` their gradients are summed
        over it (each rank saw only its own rows)."""
        self.tp_mesh, self.tp_reduce_grads = mesh, sequence_parallel

    def forward(self, x):
        w, b = self.weight, self.bias
        if self.tp_mesh is not None:
            group = self.tp_mesh.get_group() if self.tp_reduce_grads else None
            w = tp.local_param(w, group)
            b = None if b is None else tp.local_param(b, group)
        if self.kind == "LayerNorm":
            return F.layer_norm(x, x.shape[-1:], w, b, self.eps)
        return F.rms_norm(x, x.shape[-1:], w, self.eps)


class LayerNormLinear(QuantizedModule):
    """``Linear(norm(x))`` with LayerNorm or RMSNorm. Roles as ``Linear``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        normalization: str = "LayerNorm",
        eps: float = 1e-5,
        params_dtype: torch.dtype | None = None,
        device=None,
        name: str = "",
    ):
        super().__init__(name)
        dtype = params_dtype or torch.get_default_dtype()
        self.norm = _Norm(normalization, in_features, eps, dtype, device)
        self.weight = init_weight(out_features, in_features, dtype, device)
        self.bias = init_bias(out_features, in_features, dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(self.norm(x), self.weight, self.bias)


class LayerNormMLP(QuantizedModule):
    """``fc2(act(fc1(norm(x))))`` with ``activation`` "gelu" or "swiglu" (fc1 then has
    ``2 * ffn_hidden`` outputs: ``silu(a) * b``). Its two GEMMs get the role names ``name + ".fc1"``
    and ``name + ".fc2"``.

    SwiGLU's fc1 rows are the gate half ``a`` then the up half ``b``, unless ``swiglu_interleave=B``:
    then gate and up alternate in blocks of B rows (``a_0, b_0, a_1, b_1, ...``), so that any
    contiguous row shard of ``2B``-multiples holds matching gate/up pairs — what tensor
    parallelism (``dtq.parallel.LayerNormMLPParallel``) needs, at every TP size."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        *,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        eps: float = 1e-5,
        params_dtype: torch.dtype | None = None,
        device=None,
        name: str = "",
        swiglu_interleave: int | None = None,
    ):
        super().__init__(name)
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNormMLP: activation={activation!r}; use one of {ACTIVATIONS}")
        if swiglu_interleave is not None and (
            activation != "swiglu" or swiglu_interleave < 1 or ffn_hidden_size % swiglu_interleave
        ):
            raise ValueError(
                f"LayerNormMLP: swiglu_interleave={swiglu_interleave} needs activation='swiglu' and "
                f"must divide ffn_hidden_size={ffn_hidden_size}"
            )
        self.swiglu_interleave = swiglu_interleave
        dtype = params_dtype or torch.get_default_dtype()
        self.activation = activation
        fc1_out = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        self.norm = _Norm(normalization, hidden_size, eps, dtype, device)
        self.fc1_weight = init_weight(fc1_out, hidden_size, dtype, device)
        self.fc1_bias = init_bias(fc1_out, hidden_size, dtype, device) if bias else None
        self.fc2_weight = init_weight(hidden_size, ffn_hidden_size, dtype, device)
        self.fc2_bias = init_bias(hidden_size, ffn_hidden_size, dtype, device) if bias else None

    def gemm_suffixes(self) -> list[str]:
        return [".fc1", ".fc2"]

    def weight_names(self) -> list[str]:
        return ["fc1_weight", "fc2_weight"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            # the fused kernels hand max|h| to fc2 and max|d(fc1 out)| to fc1's backward (asked for
            # under a current-scaling recipe only: other scalings never read them); h comes out of
            # the SwiGLU kernel, which a compiled fc2 cannot fuse its quantization into
            recipe = self.gemm_state.resolve()
            link = AmaxLink() if recipe is not None and not recipe.delayed else None
            h = self._linear(self.norm(x), self.fc1_weight, self.fc1_bias, gemm=0, link=link)
            h = swiglu(h, self.swiglu_interleave, link=link)
            return self._linear(
                h, self.fc2_weight, self.fc2_bias, gemm=1, x_amax=link and link.h_amax, x_from_kernel=True
            )
        h = self._linear(self.norm(x), self.fc1_weight, self.fc1_bias, gemm=0)
        return self._linear(F.gelu(h, approximate="tanh"), self.fc2_weight, self.fc2_bias, gemm=1)
