"""``dtq.optim.MasterWeightOptimizer``: FP32 master weights for quantized parameters."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from dtq.parallel.master import quantize_master_weights
from dtq.tensor import QuantizedTensor


def _is_quantized(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p._local_tensor if isinstance(p, DTensor) else p, QuantizedTensor)


def _fp32_master(p: torch.Tensor) -> torch.nn.Parameter:
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        local = p._local_tensor.dequantize(torch.float32)
        return torch.nn.Parameter(DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                                     shape=p.shape, stride=p.stride()))
    return torch.nn.Parameter(p.dequantize(torch.float32))


class MasterWeightOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer_cls``: it updates FP32 masters of the quantized parameters (and the other
    parameters directly); after each ``step()`` the masters are cast back into the quantized
    parameters' payloads with one batched amax all-reduce (``quantize_master_weights``).
    ``state_dict()`` holds the inner optimizer's state and the masters (DTensors under FSDP2), so
    ``torch.distributed.checkpoint`` can save and reshard it."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict], optimizer_cls: type[torch.optim.Optimizer],
                 **optimizer_kwargs: Any):
        groups = list(params)
        if groups and isinstance(groups[0], dict):  # parameter groups, as torch optimizers take them
            groups = [dict(g, params=list(g["params"])) for g in groups]
        else:
            groups = [{"params": groups}]
        self.params = [p for g in groups for p in g["params"]]
        if not self.params:
            raise ValueError("MasterWeightOptimizer got no parameters")
        self.quantized = [p for p in self.params if _is_quantized(p)]
        self.masters = [_fp32_master(p) for p in self.quantized]
        by_id = {id(p): m for p, m in zip(self.quantized, self.masters)}
        self.inner = optimizer_cls([dict(g, params=[by_id.get(id(p), p) for p in g["params"]]) for g in groups],
                                   **optimizer_kwargs)
        self.defaults = self.inner.defaults

    def register_step_pre_hook(self, hook):
        """Hooks run around the inner optimizer's step (on the FP32 masters), before the cast."""
        return self.inner.register_step_pre_hook(lambda opt, args, kwargs: hook(self, args, kwargs))

    def register_step_post_hook(self, hook):
        return self.inner.register_step_post_hook(lambda opt, args, kwargs: hook(self, args, kwargs))

    def __getstate__(self) -> dict:  # torch.optim.Optimizer's keeps only defaults, state and groups
        return self.__dict__.copy()

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    # The inner optimizer's groups and state, read live: load_state_dict replaces them there, and
    # LR schedulers must act on the groups the inner optimizer steps with.
    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def _pull_grads(self) -> None:
        for p, m in zip(self.quantized, self.masters):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        self._pull_grads()
        loss = self.inner.step(closure)
        if self.quantized:
            quantize_master_weights(self.quantized, [_local_of(m) for m in self.masters])
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def _init_state(self) -> None:
        """Materialize the inner optimizer's lazily created state (one step at lr 0 on zero
        gradients), so that a fresh optimizer's state_dict() has every entry dcp.load fills."""
        if self.inner.state:
            return
        touched = []
        for group in self.inner.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                    touched.append(p)
        lrs = [g["lr"] for g in self.inner.param_groups]
        for g in self.inner.param_groups:
            g["lr"] = 0.0
        self.inner.step()
        for g, lr in zip(self.inner.param_groups, lrs):
            g["lr"] = lr
        for st in self.inner.state.values():  # that step must not count (e.g. AdamW's bias correction)
            if "step" in st:
                st["step"] = torch.zeros_like(st["step"]) if isinstance(st["step"], torch.Tensor) else 0
        for p in touched:
            p.grad = None

    def state_dict(self) -> dict:
        self._init_state()
        return {"inner": self.inner.state_dict(), "masters": [m.detach() for m in self.masters]}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        masters = state_dict["masters"]
        if len(masters) != len(self.masters):
            raise ValueError(f"MasterWeightOptimizer.load_state_dict: {len(masters)} masters in the state dict, "
                             f"{len(self.masters)} quantized parameters here")
        for m, saved in zip(self.masters, masters):
            m.copy_(saved)
        self.inner.load_state_dict(state_dict["inner"])
        if self.quantized:
            quantize_master_weights(self.quantized, [_local_of(m) for m in self.masters])


def _local_of(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t
