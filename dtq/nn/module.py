"""Shared machinery of dtq GEMM modules: roles, per-recipe quantizer lookup, delayed-scaling state."""

from __future__ import annotations

import weakref

import torch

from dtq._bits import stored_amax
from dtq._torch_private import in_backward
from dtq._warn import warn_once
from dtq.autocast import active_amax_sync, active_recipe
from dtq.distributed import tp
from dtq.nn import _fused_input, _ops, linear_native
from dtq.nn._linear_fn import DequantizeWeight, LinearFn, WeightData
from dtq.nn.gemm_state import GemmCall, GemmHandle, GemmSlots, GemmState, template_key
from dtq.nn.linear_plan import PlannedLinearFn, plan_for
from dtq.nn.slot import Slot
from dtq.nn.state_dict import KEY_PATH, SEP, check_weight, weight_entries, weight_meta
from dtq.recipe import QuantizerRole, Recipe
from dtq.tensor import QuantizedTensor
from dtq.weights import HighPrecisionWeight, local_tensor, unwrap

SLOT_TYPES = ("input", "weight", "output", "grad_output", "grad_input")
_QUANTIZED_SLOTS = ("input", "weight", "grad_output")
# Every live dtq module, so that a warning about a parameter can name it (dtq.optim).
LIVE_MODULES: weakref.WeakSet[QuantizedModule] = weakref.WeakSet()


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
        self.gemm_state = GemmState(owner=weakref.ref(self))
        self._gemm_handle = GemmHandle(self)
        LIVE_MODULES.add(self)

    def gemm_suffixes(self) -> list[str]:
        return [""]

    def weight_names(self) -> list[str]:
        """The GEMM weight parameter of each GEMM, in GEMM order."""
        return ["weight"]

    def init_recipe_state(self, recipe: Recipe) -> None:
        """Create what ``recipe`` keeps in this module (``DelayedScaling``'s amax history buffers)
        now instead of at the first forward: ``torch.distributed.checkpoint.load`` fills only the
        keys a fresh model's state dict already has."""
        for g in range(len(self.gemm_suffixes())):
            self._slots(recipe, g)

    def weight_quantizer(self, weight_name: str, recipe: Recipe):
        """The quantizer ``recipe`` gives the weight ``weight_name`` of this module."""
        return self.weight_slot(weight_name, recipe).quantizer

    def weight_slot(self, weight_name: str, recipe: Recipe) -> Slot:
        """The slot (quantizer and, under delayed scaling, amax history) of weight ``weight_name``."""
        return self._slots(recipe, self.weight_names().index(weight_name)).sw

    def quantizer_roles(self) -> list[QuantizerRole | None]:
        roles: list[QuantizerRole | None] = []
        for suffix in self.gemm_suffixes():
            for tt in SLOT_TYPES:
                roles.append(
                    QuantizerRole(self.module_type, tt, self.name + suffix) if tt in _QUANTIZED_SLOTS else None
                )
        return roles

    def _slots(self, recipe: Recipe, gemm: int) -> GemmSlots:
        """The (input, weight, grad_output) slots of one GEMM under ``recipe``; the factory is asked
        once per slot and recipe (the last few recipes are remembered)."""
        slots = self._slot_cache.get(recipe.key)  # an int: equal recipes share it, hashing it costs nothing
        if slots is None:
            slots = self._slot_cache[recipe.key] = self._build_slots(recipe)
            while len(self._slot_cache) > 8:
                self._slot_cache.pop(next(iter(self._slot_cache)))
        return slots[gemm]

    def _build_slots(self, recipe: Recipe) -> list[GemmSlots]:
        roles = self.quantizer_roles()
        out = []
        for g, suffix in enumerate(self.gemm_suffixes()):
            gemm_roles = roles[g * len(SLOT_TYPES) : (g + 1) * len(SLOT_TYPES)]
            slots = []
            for tt, role in zip(SLOT_TYPES, gemm_roles):
                if tt not in _QUANTIZED_SLOTS:
                    continue
                slot = Slot(role, recipe.quantizer(role))
                q = slot.quantizer
                if (
                    recipe.backward_override is not None
                    and q is not None
                    and q.for_direction("columnwise") != q.for_direction("rowwise")
                    and tt != "grad_output"
                ):
                    warn_once(
                        f"override-hybrid:{type(recipe).__name__}",
                        f"dtq: backward_override={recipe.backward_override!r} builds no columnwise payload: the "
                        f"columnwise part of {q!r} (for {role}) is not used",
                    )
                if recipe.delayed and slot.quantizer is not None:
                    slot.owner, slot.history = weakref.ref(self), self._history(f"{g}_{tt}", recipe.amax_history_len)
                    slot.margin, slot.most_recent = recipe.margin, recipe.amax_compute_algo == "most_recent"
                slots.append(slot)
            out.append(
                GemmSlots(
                    f"{type(self).__name__} {self.name!r}{suffix}",
                    recipe,
                    *slots,
                    self.gemm_state,
                    weakref.ref(self),
                    self.weight_names()[g],
                    g,
                )
            )
        return out

    def _history(self, key: str, length: int) -> str:
        name = f"amax_history_{key}"
        buf = getattr(self, name, None)
        if buf is None or buf.numel() != length:
            device = next((p.device for p in self.parameters()), torch.device("cpu"))
            self.register_buffer(name, torch.zeros(length, dtype=torch.float32, device=device))
        return name

    # -- state dicts: GEMM weights as codes (dtq.checkpoint) --------------------------------------
    _dtq_key_path = KEY_PATH

    def _fqn_modifiers(self) -> dict[str, str]:
        """For DCP's state-dict helpers (``get_model_state_dict``...), which resolve each key as
        an attribute path: the payload keys of a GEMM weight resolve through ``KEY_PATH``."""
        return {w: "_dtq_key_path" for w in self.weight_names()}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for w in self.weight_names():
            p = self._parameters.get(w)
            if p is None:
                continue
            destination.pop(prefix + w, None)
            for k, v in weight_entries(prefix + w, p).items():
                destination[k] = v if keep_vars else v.detach()

    def get_extra_state(self):
        return {w: weight_meta(self._parameters[w]) for w in self.weight_names() if self._parameters.get(w) is not None}

    def set_extra_state(self, state) -> None:
        pass  # read (for checks) in _load_from_state_dict

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # Delayed-scaling histories are created on first use: accept them from a checkpoint.
        for key, value in state_dict.items():
            name = key[len(prefix) :]
            if key.startswith(prefix) and name.startswith("amax_history_") and "." not in name:
                if getattr(self, name, None) is None or getattr(self, name).shape != value.shape:
                    self.register_buffer(name, torch.zeros_like(value))
        meta = state_dict.get(prefix + "_extra_state") or {}
        errors, pairs, quantized = [], [], []
        for w in self.weight_names():
            p = self._parameters.get(w)
            if p is None:
                continue
            found = check_weight(prefix + w, p, state_dict, meta.get(w), errors)
            if found or any(k.startswith(prefix + w + SEP) for k in state_dict):
                quantized.append(w)
            pairs += found
        if errors:  # nothing is copied unless every weight checks out
            error_msgs.extend(errors)
            return
        with torch.no_grad():
            for dst, src in pairs:
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
        before = len(missing_keys)
        super()._load_from_state_dict(
            {k: v for k, v in state_dict.items() if SEP not in k},
            prefix,
            local_metadata,
            strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
        )
        done = {prefix + w for w in quantized}
        missing_keys[before:] = [k for k in missing_keys[before:] if k not in done]

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        state = dict(state)
        state["_slot_cache"] = {}  # rebuilt on use; holds weak references and user factories
        state.pop("_gemm_handle", None)  # refers to this module: a copy makes its own
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._gemm_handle = GemmHandle(self)
        self.gemm_state.owner = weakref.ref(self)

    def _linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gemm: int = 0,
        *,
        x_amax: torch.Tensor | None = None,
        link=None,
        x_from_kernel: bool = False,
    ) -> torch.Tensor:
        """One GEMM of the module under the active recipe. ``x_amax``: max|x| if known (computed
        by the op that produced x); ``link``: a ``dtq.nn.functional.AmaxLink`` whose ``grad_amax``
        the next op's backward sets to max|dy|. Both only spare current scaling an amax pass.
        ``x_from_kernel``: x is the output of a dtq kernel, which inductor cannot fuse x's
        quantization into: a compiled call quantizes x with dtq's own kernel, as eager does.

        Under ``torch.compile`` this traces without a graph break: the GEMM is the custom op
        ``dtq::linear`` (``dtq.nn._ops``), which runs the eager code. Tensor-parallel GEMMs still
        run eagerly there, as a graph break."""
        in_features = local_tensor(weight).shape[-1]
        if x.shape[-1] != in_features:
            layout = self.gemm_state.tp  # set by dtq.parallel's TP styles
            spec = layout.specs.get(gemm) if layout is not None else None
            name = f"{type(self).__name__} {self.name!r}{self.gemm_suffixes()[gemm]}"
            raise ValueError(
                f"{name}: input of shape {list(x.shape)} has last dim {x.shape[-1]}, but the weight "
                f"{list(local_tensor(weight).shape)} expects {in_features} input features"
                + (" (this rank's tensor-parallel shard)" if spec is not None else "")
            )
        if not torch.compiler.is_compiling():
            return self._linear_eager(x, weight, bias, gemm, x_amax, link)
        layout = self.gemm_state.tp
        spec = layout.specs.get(gemm) if layout is not None else None
        state = self.gemm_state
        grad = torch.is_grad_enabled()
        no_grad_trainable = not grad and weight.requires_grad
        recipe, recompute_only = state.resolve(), False  # autocast's, else the one dtq.convert bound
        if active_recipe() is None and state.awaiting_recompute:
            # A recompute runs outside dtq.autocast (dynamo cannot see that backward runs it;
            # the op checks at run time that it is one).
            recipe, recompute_only = state.recipe, True
        if recipe is not None and spec is None:
            # The slots as a template (constant) and the module as an opaque input: modules
            # of one structure share the graph (unless the recipe's quantizers use names).
            key = template_key(
                recipe.key,
                self.module_type,
                self.name if recipe.name_dependent else "",
                self.gemm_suffixes()[gemm],
                gemm,
            )
            # A plain call runs its plan (as eager does); where its input scales from a tensor-wide
            # amax, that is computed here, in the graph, so that inductor fuses the reduction into
            # the kernel producing x (on x's stored values: exactly the amax eager computes).
            planned = _ops.plain_template(key) and active_amax_sync() is None
            need_dgrad, need_wgrad = grad and x.requires_grad, grad and weight.requires_grad
            if planned and x_amax is None and x.numel() and _ops.takes_tensor_amax(key, "input"):
                x_amax = stored_amax(x.detach())
            x_payloads = []
            if planned and x.dim() >= 2 and x.numel() and _ops.quantizes_input_apart(key):
                # an op of its own, which names no module: GEMMs reading this x merge it (one
                # quantization); inductor decomposes it where it can fuse it (_fused_input)
                _fused_input.register()
                flags = _ops.CallFlags(need_dgrad, need_wgrad, False, False, not x_from_kernel, x.dtype, weight.dtype)
                x_payloads = _ops.quantize_input(x.detach(), x_amax, key, flags.code(), weight.shape[0])
            outs = _ops.linear(
                x,
                weight,
                [],
                0,
                bias,
                x_amax,
                x_payloads,
                self._gemm_handle,
                key,
                need_dgrad,
                need_wgrad,
                no_grad_trainable,
                recompute_only,
                planned,
            )
            return outs[0]
        if recipe is None and spec is None:
            state.recipe = None
            if isinstance(weight, QuantizedTensor):  # e.g. FSDP2's gather without a recipe (identity)
                weight = _ops.dequantize_weight(weight, [], 0, x.dtype, self._gemm_handle, gemm)
            return self._high_precision_linear(x, weight, bias, None, None)
        return torch.compiler.disable(self._linear_eager)(x, weight, bias, gemm, x_amax, None)  # graph break

    def _linear_eager(self, x, weight, bias, gemm, x_amax, link) -> torch.Tensor:
        state = self.gemm_state
        layout = state.tp
        spec = layout.specs.get(gemm) if layout is not None else None
        replay = in_backward()  # a forward run by backward is a recompute (torch.utils.checkpoint)
        # autocast's recipe, else the one dtq.convert bound; a recompute runs under its forward's
        recipe = state.resolve(replay, weight=weight)
        grad = torch.is_grad_enabled()
        sync = state.begin(recipe, replay, not grad and weight.requires_grad)
        if spec is None:  # (the common case, kept lean: host time)
            if recipe is None:
                if type(weight) is HighPrecisionWeight:  # torch's ops on its data: no wrapper dispatch per op
                    weight = WeightData.apply(weight)
                return self._high_precision_linear(x, weight, bias, None, None)
            slots = self._slots(recipe, gemm)
            self._check_stored_quantizer(weight, slots)
            need_dgrad, need_wgrad = grad and x.requires_grad, grad and weight.requires_grad
            if replay or sync is not None or link is not None:
                call = GemmCall(slots, need_dgrad, need_wgrad, replay, sync, link)
            else:
                call = slots.call(need_dgrad, need_wgrad)
            # A recompute runs planned too: its saved tensors must match the forward's (a plan may keep
            # other fields than the general path, e.g. FP8 codes [K, M]); plannable slots compute
            # the same either way (no amax history to replay).
            if sync is None and slots.plannable and (plan := plan_for(call, x, weight)) is not None:
                if link is None and (y := linear_native.run(plan, x, weight, bias, x_amax)) is not None:
                    return y
                return PlannedLinearFn.apply(x, weight, bias, plan, x_amax, link)
            return LinearFn.apply(x, weight, bias, x_amax, call)
        group = layout.mesh.get_group()
        row_bias = None
        if spec.kind == "column" and not spec.sequence_parallel:
            x = tp.CopyToTP.apply(x, group)  # replicated input: dx sums over the group
        if spec.kind == "row":
            bias, row_bias = None, bias  # added once, after the partial outputs are summed
        if recipe is None:
            y = self._high_precision_linear(x, weight, bias, spec, group)
        else:
            slots = self._slots(recipe, gemm)
            self._check_stored_quantizer(weight, slots)
            call = GemmCall(
                slots,
                grad and x.requires_grad,
                grad and weight.requires_grad,
                replay=replay,
                amax_sync=sync,
                link=link,
                tp=spec,
                group=group,
            )
            y = LinearFn.apply(x, weight, bias, x_amax, call)
        if spec.kind == "row":
            if not spec.sequence_parallel:
                y = tp.ReduceFromTP.apply(y, group)
            if row_bias is not None:
                y = y + tp.local_param(row_bias, group if spec.sequence_parallel else None).to(y.dtype)
        return y

    def _check_stored_quantizer(self, weight: torch.Tensor, slots: GemmSlots) -> None:
        """A quantized weight parameter is used as stored: said once where the recipe would quantize it otherwise."""
        w_local = local_tensor(weight)
        if (
            isinstance(w_local, QuantizedTensor)
            and slots.sw.quantizer is not None
            and w_local.quantizer != slots.sw.quantizer
        ):
            warn_once(
                f"qparam-recipe:{id(self)}",
                f"dtq: {slots.name} holds a weight quantized as "
                f"{w_local.quantizer!r}; it is used as stored, not requantized to the recipe's "
                f"{slots.sw.quantizer!r}",
            )

    @staticmethod
    def _high_precision_linear(x, weight, bias, spec, group):
        """The GEMM without a recipe (outside ``dtq.autocast``): torch's linear, with the
        tensor-parallel communication in high precision."""
        if hasattr(weight, "device_mesh"):
            weight = weight.to_local()
        if isinstance(weight, QuantizedTensor):
            weight = DequantizeWeight.apply(weight, x.dtype)
        if spec is not None and spec.gathers_input:
            x = tp.GatherFromSP.apply(x, group)
        b = None if bias is None else tp.local_param(bias, None).to(x.dtype)
        y = torch.nn.functional.linear(x, weight.to(x.dtype), b)
        if spec is not None and spec.scatters_output:
            y = tp.ScatterToSP.apply(y, group)
        return y

    def reset_parameters(self) -> None:
        """nn.Linear's initialization for every GEMM weight and bias, and empty delayed-scaling
        histories (for meta-device init: ``to_empty`` leaves buffers uninitialized)."""
        with torch.no_grad():
            for name, buf in self.named_buffers(recurse=False):
                if name.startswith("amax_history_"):
                    buf.zero_()
        for wname in self.weight_names():
            w = getattr(self, wname)
            data = unwrap(w)  # a DTensor stays one: its init draws the shards of one whole tensor
            if isinstance(data, QuantizedTensor) or data.device.type == "meta":
                continue
            with torch.no_grad():
                torch.nn.init.kaiming_uniform_(data, a=5**0.5)
                b = getattr(self, wname.replace("weight", "bias"), None)
                if b is not None:
                    bound = 1 / data.shape[1] ** 0.5 if data.shape[1] > 0 else 0
                    torch.nn.init.uniform_(b, -bound, bound)


def as_weight(t: torch.Tensor, requires_grad: bool = True) -> torch.nn.Parameter:
    """A GEMM weight parameter: high precision, gathered quantized by FSDP2."""
    data = unwrap(t)
    return torch.nn.Parameter(HighPrecisionWeight.wrap(data), requires_grad=requires_grad)


def init_weight(out_features: int, in_features: int, dtype, device) -> torch.nn.Parameter:
    w = torch.empty(out_features, in_features, dtype=dtype, device=device)
    if w.device.type != "meta":
        torch.nn.init.kaiming_uniform_(w, a=5**0.5)  # nn.Linear's default
    return as_weight(w)


def init_bias(out_features: int, in_features: int, dtype, device) -> torch.nn.Parameter:
    b = torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
    if b.device.type != "meta":
        bound = 1 / in_features**0.5 if in_features > 0 else 0
        torch.nn.init.uniform_(b, -bound, bound)
    return b
