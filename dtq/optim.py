"""``dtq.optim.MasterWeightOptimizer``: FP32 master weights for quantized parameters;
``dtq.optim.on_local_shards``: torch's fused Adam / AdamW kernels run on DTensors' local shards;
and a step pre-hook on every torch optimizer that warns once when one updates quantized
parameters itself."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dtq._torch_private import dtensor_layout, dtensor_op_handlers, local_tensor, without_dtensor_handler
from dtq._warn import warn_once
from dtq.nn.module import LIVE_MODULES
from dtq.parallel.master import quantize_master_weights
from dtq.tensor import QuantizedTensor

MASTER = "master"  # the state entry that holds a quantized parameter's FP32 master weight


def _is_quantized(p: torch.Tensor) -> bool:
    return isinstance(local_tensor(p), QuantizedTensor)


def _fp32_master(p: torch.Tensor) -> torch.nn.Parameter:
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        local = local_tensor(p).dequantize(torch.float32)
        return torch.nn.Parameter(
            DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        )
    return torch.nn.Parameter(p.dequantize(torch.float32))


class _Group(MutableMapping):
    """One parameter group as torch's optimizer API shows it: the model's parameters under
    ``"params"`` (what DCP's state-dict helpers map to fully qualified names), every setting read
    and written live in the inner optimizer's group (the one it steps with; LR schedulers set it;
    its ``load_state_dict`` replaces the group dicts, so they are looked up on each access)."""

    def __init__(self, owner: MasterWeightOptimizer, index: int):
        self._owner, self._index = owner, index

    def _inner(self) -> dict:
        return self._owner.inner.param_groups[self._index]

    def __getitem__(self, key: str) -> Any:
        return self._owner._group_params[self._index] if key == "params" else self._inner()[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            raise TypeError("MasterWeightOptimizer: a group's parameters are fixed; add others with add_param_group")
        self._inner()[key] = value

    def __delitem__(self, key: str) -> None:
        del self._inner()[key]

    def __iter__(self):
        return iter(self._inner())

    def __len__(self) -> int:
        return len(self._inner())

    def __repr__(self) -> str:
        return repr({k: (f"<{len(v)} parameters>" if k == "params" else v) for k, v in self.items()})


class _ParamState(MutableMapping):
    """A quantized parameter's optimizer state: the inner optimizer's state of its master, and the
    master itself under ``"master"``."""

    def __init__(self, inner: dict, master: torch.Tensor):
        self._inner, self._master = inner, master

    def __getitem__(self, key: str) -> Any:
        return self._master if key == MASTER else self._inner[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == MASTER:
            with torch.no_grad():
                self._master.copy_(value)
        else:
            self._inner[key] = value

    def __delitem__(self, key: str) -> None:
        if key == MASTER:
            raise KeyError("the master weight of a quantized parameter cannot be removed")
        del self._inner[key]

    def __iter__(self):
        return iter([*self._inner, MASTER])

    def __len__(self) -> int:
        return len(self._inner) + 1


class _State(Mapping):
    """``optimizer.state`` keyed by the model's parameters, as torch's optimizers key it. Every
    parameter has an entry (so DCP's helpers never run their own initializing step, which would
    requantize the masters); reading one materializes the inner optimizer's lazy state."""

    def __init__(self, owner: MasterWeightOptimizer):
        self._owner = owner

    def __getitem__(self, p: torch.Tensor) -> Any:
        owner = self._owner
        inner_p = owner._inner_param.get(id(p))
        if inner_p is None:
            raise KeyError("not a parameter of this MasterWeightOptimizer")
        owner._init_state()
        st = owner.inner.state[inner_p]
        return _ParamState(st, inner_p) if id(p) in owner._master_of else st

    def __iter__(self):
        return iter(self._owner.params)

    def __len__(self) -> int:
        return len(self._owner.params)


class MasterWeightOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer_cls``: it updates FP32 masters of the quantized parameters (and the other
    parameters directly); after each ``step()`` the masters are cast back into the quantized
    parameters' payloads with one batched amax all-reduce (``quantize_master_weights``).

    Towards the outside it is keyed by the model's parameters, as torch's optimizers are:
    ``param_groups`` list them (the settings are the inner optimizer's), and ``state_dict()`` has
    torch's layout, the inner optimizer's state per parameter plus each quantized parameter's
    master under ``"master"`` (DTensors under FSDP2). So ``torch.distributed.checkpoint`` saves
    and reshards it, and its state-dict helpers (``get_optimizer_state_dict``) name each entry by
    the parameter's fully qualified name."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        optimizer_cls: type[torch.optim.Optimizer],
        **optimizer_kwargs: Any,
    ):
        groups = _groups(params)
        if not any(g["params"] for g in groups):
            raise ValueError("MasterWeightOptimizer got no parameters")
        self.params: list[torch.Tensor] = []
        self.quantized: list[torch.Tensor] = []
        self.masters: list[torch.nn.Parameter] = []
        self._group_params: list[list[torch.Tensor]] = []
        self._master_of: dict[int, torch.nn.Parameter] = {}
        self._inner_param: dict[int, torch.Tensor] = {}
        self._state_ready = False
        inner_groups = [self._adopt(g) for g in groups]
        self.inner = optimizer_cls(inner_groups, **optimizer_kwargs)
        self.defaults = self.inner.defaults

    def _adopt(self, group: dict) -> dict:
        """Take a group's parameters on (an FP32 master for each quantized one); returns the group
        the inner optimizer steps: the same settings, masters instead of quantized parameters."""
        self._group_params.append(group["params"])
        for p in group["params"]:
            self.params.append(p)
            if _is_quantized(p):
                m = _fp32_master(p)
                self.quantized.append(p)
                self.masters.append(m)
                self._master_of[id(p)] = m
            self._inner_param[id(p)] = self._master_of.get(id(p), p)
        return dict(group, params=[self._inner_param[id(p)] for p in group["params"]])

    def add_param_group(self, param_group: dict) -> None:
        self.inner.add_param_group(self._adopt(_groups([param_group])[0]))

    def register_step_pre_hook(self, hook):
        """Hooks run around the inner optimizer's step (on the FP32 masters), before the cast."""
        return self.inner.register_step_pre_hook(lambda opt, args, kwargs: hook(self, args, kwargs))

    def register_step_post_hook(self, hook):
        return self.inner.register_step_post_hook(lambda opt, args, kwargs: hook(self, args, kwargs))

    def __getstate__(self) -> dict:  # torch.optim.Optimizer's keeps only defaults, state and groups
        return self.__dict__.copy()

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        # Ids change in a copy; the lists keep the order they were built in.
        self._master_of = {id(p): m for p, m in zip(self.quantized, self.masters)}
        self._inner_param = {id(p): self._master_of.get(id(p), p) for p in self.params}

    @property
    def param_groups(self) -> list:
        return [_Group(self, i) for i in range(len(self.inner.param_groups))]

    @property
    def state(self) -> Mapping:
        return _State(self)

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
        if self._state_ready or self.inner.state:
            self._state_ready = True
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
        self._state_ready = True

    def state_dict(self) -> dict:
        """torch's layout: ``{"state": {index: {...}}, "param_groups": [...]}``, indices in the
        order of ``param_groups``; a quantized parameter's state holds its master."""
        self._init_state()
        sd = self.inner.state_dict()
        for i, p in enumerate(self.params):
            if id(p) in self._master_of:  # a new dict: the inner one is the inner optimizer's live state
                sd["state"][i] = {**sd["state"].get(i, {}), MASTER: self._master_of[id(p)].detach()}
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load ``state_dict()``'s layout (state keyed by index, or by name as DCP's helpers pass
        it, matched by position in ``param_groups``), or the earlier ``{"inner", "masters"}`` one."""
        if "inner" in state_dict and "masters" in state_dict:
            masters, inner = list(state_dict["masters"]), state_dict["inner"]
        else:
            masters, inner = self._split_masters(state_dict)
        if len(masters) != len(self.masters):
            raise ValueError(
                f"MasterWeightOptimizer.load_state_dict: {len(masters)} masters in the state dict, "
                f"{len(self.masters)} quantized parameters here"
            )
        for m, saved in zip(self.masters, masters):
            m.copy_(saved)
        self.inner.load_state_dict(inner)
        if self.quantized:
            quantize_master_weights(self.quantized, [_local_of(m) for m in self.masters])

    def _split_masters(self, state_dict: dict) -> tuple[list, dict]:
        keys = [k for g in state_dict["param_groups"] for k in g["params"]]
        if len(keys) != len(self.params):
            raise ValueError(
                f"MasterWeightOptimizer.load_state_dict: the state dict has {len(keys)} parameters, "
                f"this optimizer {len(self.params)}"
            )
        state, masters = dict(state_dict["state"]), []
        for key, p in zip(keys, self.params):
            if id(p) not in self._master_of:
                continue
            st = dict(state.get(key, {}))
            if MASTER not in st:
                raise KeyError(
                    f"MasterWeightOptimizer.load_state_dict: parameter {key!r} (shape {list(p.shape)}) is "
                    f"quantized here but the state dict holds no master weight for it; was it saved from "
                    f"a model with high-precision parameters?"
                )
            masters.append(st.pop(MASTER))
            state[key] = st
        return masters, {"state": state, "param_groups": state_dict["param_groups"]}


def _groups(params) -> list[dict]:
    """Parameter groups as torch's optimizers take them: a list of tensors or of group dicts."""
    if isinstance(params, torch.Tensor):
        params = [params]
    groups = list(params)
    if groups and isinstance(groups[0], dict):
        return [
            dict(g, params=[g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"]))
            for g in groups
        ]
    return [{"params": groups}]


def _local_of(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t)


# -- fused steps on local shards -------------------------------------------------------------------

# torch's fused multi-tensor steps, in place: (params, grads, exp_avgs, exp_avg_sqs,
# max_exp_avg_sqs, state_steps, *, lr, ..., grad_scale, found_inf), elementwise per parameter
_aten = torch.ops.aten
_FUSED_STEPS = (
    _aten._fused_adam_.default,
    _aten._fused_adam_.tensor_lr,
    _aten._fused_adamw_.default,
    _aten._fused_adamw_.tensor_lr,
)
_PER_PARAM_LISTS = 5  # the lists whose i-th entries must share one sharding


def _locally(args: tuple, kwargs: dict) -> tuple | None:
    """The fused step's arguments with every DTensor as its local tensor, where that is the op
    DTensor would run: every parameter's entries (parameter, gradient, moments) DTensors on the
    call's one mesh, each parameter's with one set of placements and no pending reduction
    (``Partial``); step counts and scalars replicated or plain. None where anything else is
    found, a plain tensor among the DTensors included (DTensor's dispatch then redistributes, or
    raises as it does for a parameter left out of ``fully_shard``)."""
    call_mesh = None
    for entries in zip(*(lst for lst in args[:_PER_PARAM_LISTS] if lst)):
        layout = dtensor_layout(entries[0])
        if layout is None:
            return None
        mesh, placements = layout
        if call_mesh is None:
            call_mesh = mesh
        elif mesh is not call_mesh and mesh != call_mesh:
            return None
        if any(pl.is_partial() for pl in placements):
            return None
        for t in entries[1:]:
            other = dtensor_layout(t)
            if (
                other is None
                or (other[0] is not mesh and other[0] != mesh)
                or (other[1] is not placements and other[1] != placements)
            ):
                return None
    rest = [t for lst in args[_PER_PARAM_LISTS:] for t in lst] + list(kwargs.values())
    for t in rest:
        layout = dtensor_layout(t)
        if layout is not None and not all(pl.is_replicate() for pl in layout[1]):
            return None
    local = tuple([local_tensor(t) for t in lst] for lst in args)
    return local, {k: local_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def _fused_step_on_local_shards(op, args: tuple, kwargs: dict):
    local = _locally(args, kwargs)
    if local is not None:
        return op(*local[0], **local[1])
    with without_dtensor_handler(op):
        return op(*args, **kwargs)


@contextlib.contextmanager
def on_local_shards() -> Iterator[None]:
    """Within it, torch's fused Adam and AdamW steps (``fused=True``) over DTensor parameters run
    their kernel on each rank's local shards, as DTensor's dispatch would after checking every
    tensor: the same kernel on the same data, so the same bits, without that dispatch's
    per-parameter host work on every step (FSDP2's parameters are DTensors). A step DTensor
    would treat otherwise (a pending reduction, placements that differ, several meshes or plain
    tensors in one call) keeps DTensor's dispatch. The optimizer's state stays DTensors, so
    checkpoints are unchanged.

        with dtq.optim.on_local_shards():
            optimizer.step()
    """
    with dtensor_op_handlers(dict.fromkeys(_FUSED_STEPS, _fused_step_on_local_shards)):
        yield


# -- plain optimizers on quantized parameters ---------------------------------------------------

_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


def _warn_if_stepping_quantized(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Step pre-hook of every torch optimizer: one that updates a quantized parameter itself
    rounds each update to the format's grid, so updates smaller than half the gap between
    neighbouring codes vanish without an error. Warn once; each optimizer is looked at until its
    quantized parameters have gradients, or once if it has none."""
    if isinstance(optimizer, MasterWeightOptimizer) or _steps_masters(optimizer) or torch.compiler.is_compiling():
        return
    groups = optimizer.param_groups
    count = sum(len(g["params"]) for g in groups)
    if _checked.get(optimizer) == count:
        return
    quantized = [(i, j, p) for i, g in enumerate(groups) for j, p in enumerate(g["params"]) if _is_quantized(p)]
    stepped = [(i, j, p) for i, j, p in quantized if p.grad is not None]
    if stepped:
        i, j, p = stepped[0]
        q = _local_of(p).quantizer
        cls = type(optimizer)
        path = (
            f"torch.optim.{cls.__name__}"
            if cls.__module__.startswith("torch.optim")
            else f"{cls.__module__}.{cls.__qualname__}"
        )
        warn_once(
            "optimizer-steps-quantized",
            f"dtq: {type(optimizer).__name__} updates {len(stepped)} quantized parameter(s) in place, the first "
            f"{_param_name(p) or '(a parameter of no live dtq module)'} (param_groups[{i}]['params'][{j}], "
            f"shape {list(p.shape)}, {type(q).__name__}): each update is "
            f"rounded to the format's codes, so small updates are lost. Step quantized parameters with "
            f"dtq.optim.MasterWeightOptimizer(params, {path}, ...), which "
            f"updates FP32 master weights and casts them into the parameters.",
        )
    if stepped or not quantized:
        _checked[optimizer] = count


def _steps_masters(optimizer: torch.optim.Optimizer) -> bool:
    """A container of optimizers (torchtitan's ``OptimizersContainer``) whose every optimizer is a
    MasterWeightOptimizer: it lists the quantized parameters, but its step only runs theirs."""
    inner = getattr(optimizer, "optimizers", None)
    return isinstance(inner, list) and bool(inner) and all(isinstance(o, MasterWeightOptimizer) for o in inner)


def _param_name(p: torch.Tensor) -> str | None:
    """``<module name>.<weight>`` of the dtq module that holds ``p``; dtq.convert names each module
    by its fully qualified name."""
    for m in list(LIVE_MODULES):
        for w in m.weight_names():
            if m._parameters.get(w) is p:
                return f"{m.name or type(m).__name__}.{w}"
    return None


register_optimizer_step_pre_hook(_warn_if_stepping_quantized)
