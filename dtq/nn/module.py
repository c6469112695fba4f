"""Shared machinery of dtq GEMM modules: roles, per-recipe quantizer lookup, delayed-scaling state."""

from __future__ import annotations

import torch

from dtq.autocast import active_recipe
from dtq.nn._linear_fn import LinearFn, Slot
from dtq.recipe import QuantizerRole, Recipe
from dtq.tensor import QuantizedTensor

SLOT_TYPES = ("input", "weight", "output", "grad_output", "grad_input")
_QUANTIZED_SLOTS = ("input", "weight", "grad_output")


class QuantizedModule(torch.nn.Module):
    """Base of dtq modules. Each GEMM ``g`` of a module has five slots in this order:
    ``input, weight, output, grad_output, grad_input``. The quantized ones get the role
    ``QuantizerRole(module_type, tensor_type, name + suffix(g))``; the boundary slots ``output``
    and ``grad_input`` have no consumer inside the module and get None."""

    module_type = "linear"

    def __init__(self, name: str = ""):
        super().__init__()
        self.name = name
        self._slot_cache: dict = {}

    def gemm_suffixes(self) -> list[str]:
        return [""]

    def quantizer_roles(self) -> list[QuantizerRole | None]:
        roles: list[QuantizerRole | None] = []
        for suffix in self.gemm_suffixes():
            for tt in SLOT_TYPES:
                roles.append(QuantizerRole(self.module_type, tt, self.name + suffix) if tt in _QUANTIZED_SLOTS else None)
        return roles

    def _slots(self, recipe: Recipe, gemm: int) -> tuple[Slot, Slot, Slot]:
        """The (input, weight, grad_output) slots of one GEMM under ``recipe``; the factory is asked
        once per slot and recipe."""
        key = recipe
        if key not in self._slot_cache:
            self._slot_cache = {key: self._build_slots(recipe)}  # one recipe at a time
        return self._slot_cache[key][gemm]

    def _build_slots(self, recipe: Recipe) -> list[tuple[Slot, Slot, Slot]]:
        roles = self.quantizer_roles()
        out = []
        for g, suffix in enumerate(self.gemm_suffixes()):
            gemm_roles = roles[g * len(SLOT_TYPES):(g + 1) * len(SLOT_TYPES)]
            slots = []
            for tt, role in zip(SLOT_TYPES, gemm_roles):
                if tt not in _QUANTIZED_SLOTS:
                    continue
                slot = Slot(recipe.quantizer(role))
                if recipe.delayed and slot.quantizer is not None:
                    slot.history = self._history(f"{g}_{tt}", recipe.amax_history_len)
                    slot.margin, slot.most_recent = recipe.margin, recipe.amax_compute_algo == "most_recent"
                slots.append(slot)
            out.append(tuple(slots))
        return out

    def _history(self, key: str, length: int) -> torch.Tensor:
        name = f"amax_history_{key}"
        buf = getattr(self, name, None)
        if buf is None or buf.numel() != length:
            device = next((p.device for p in self.parameters()), torch.device("cpu"))
            self.register_buffer(name, torch.zeros(length, dtype=torch.float32, device=device))
            buf = getattr(self, name)
        return buf

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemm: int = 0) -> torch.Tensor:
        if x.shape[-1] != weight.shape[-1]:
            raise ValueError(f"{type(self).__name__} {self.name!r}{self.gemm_suffixes()[gemm]}: input of shape "
                             f"{list(x.shape)} has last dim {x.shape[-1]}, but the weight {list(weight.shape)} expects "
                             f"{weight.shape[-1]} input features")
        recipe = active_recipe()
        if recipe is None:
            w = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
            return torch.nn.functional.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
        sx, sw, sg = self._slots(recipe, gemm)
        return LinearFn.apply(x, weight, bias, sx, sw, sg, recipe.backward_override)


def init_weight(out_features: int, in_features: int, dtype, device) -> torch.nn.Parameter:
    w = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
    if w.device.type != "meta":
        torch.nn.init.kaiming_uniform_(w, a=5 ** 0.5)  # nn.Linear's default
    return w


def init_bias(out_features: int, in_features: int, dtype, device) -> torch.nn.Parameter:
    b = torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
    if b.device.type != "meta":
        bound = 1 / in_features ** 0.5 if in_features > 0 else 0
        torch.nn.init.uniform_(b, -bound, bound)
    return b
