"""The explicit state of a dtq module's GEMMs, and the context object each GEMM call runs with.

``GemmState`` (one per module, ``module.gemm_state``) is what a module's forward leaves for code
that runs later without seeing the call: the FSDP2 gathers of its weights (which recipe, whether
backward will recompute and so needs rowwise payloads), a recompute (the forward's recipe), and
the delayed-scaling amax reduction of its backward. ``GemmSlots`` (per module, GEMM and recipe)
holds the three quantized slots; ``GemmCall`` (per call) adds what grad mode, recompute and
parallelism decide for that one call. ``LinearFn`` takes a ``GemmCall``."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from dtq._torch_private import (
    GatherContext,
    OpaqueBase,
    assume_constant_result,
    checkpoint_region,
    in_backward,
    inside_checkpoint_forward,
    local_tensor,
    register_opaque_reference,
)
from dtq._warn import warn_once
from dtq.autocast import active_amax_sync, active_recipe, autocast_active
from dtq.distributed.gather import GatherPlan
from dtq.distributed.tp import TPSpec
from dtq.formats import COLUMNWISE, DIRECTIONS, ROWWISE, IdentityQuantizer, Quantizer
from dtq.nn.slot import Slot
from dtq.recipe import TENSOR_TYPES, QuantizerRole, recipe_by_key
from dtq.tensor import QuantizedTensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from dtq.distributed.amax import AmaxSync
    from dtq.recipe import Recipe


SIZE_RULE_GATHER = "a size rule keeps its module in high precision (dtq.apply_size_rule: too small to gain)"


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """How tensor parallelism splits a module's GEMMs: ``{gemm index: TPSpec}`` over ``mesh``."""

    specs: Mapping[int, TPSpec]
    mesh: DeviceMesh


@dataclasses.dataclass
class GemmState:
    """What the last forward of a module (not a recompute) decided, for its FSDP2 gathers, its
    recompute and its backward."""

    recipe: Recipe | None = None
    amax_sync: AmaxSync | None = None
    # Backward will recompute the forward (torch.utils.checkpoint, or a no_grad forward of a
    # trainable weight): FSDP2's backward gather then brings rowwise payloads too.
    recompute: bool = False
    # A checkpointed forward ran and no recompute has run since: a compiled
    # module resolves its recipe from this (the recompute runs outside dtq.autocast).
    awaiting_recompute: bool = False
    # FSDP2 gathers the weights (set by the gather hooks). The backward gather replaces the
    # gathered weight's payloads (other directions than forward's): a compiled graph holds the
    # forward's payload tensors, so its backward reads the module's live parameter instead.
    fsdp_gathered: bool = False
    # The recipe bound by dtq.convert(model, recipe=...): forwards outside any dtq.autocast run
    # under it (an active autocast, also autocast(enabled=False), overrides it).
    default_recipe: Recipe | None = None
    # Tensor parallelism, set by dtq.parallel's styles (or torch's, at the first DTensor input).
    tp: TPLayout | None = None
    # The module whose GEMMs this is (a weak reference: the FSDP2 gathers ask for its weight slots).
    owner: weakref.ReferenceType | None = dataclasses.field(default=None, repr=False, compare=False)
    # Why the module's GEMMs stay in high precision under every recipe (dtq.apply_size_rule: too
    # small to gain); None: they follow the recipe.
    high_precision: str | None = None
    # The recipe FSDP2's last gather outside backward quantized the high-precision shards for, as
    # (recipe,); None: no such gather. A forward under another recipe while FSDP2 still holds those
    # weights gathered (reshard_after_forward=False after a forward without backward) is refused.
    gathered_for: tuple | None = None
    # gather_plan's answers without delayed scaling, by (weight, FSDP2 state, reshard, recompute,
    # directions held): (recipe, quantizer, high_precision, plan), reused while a gather's recipe,
    # quantizer and size-rule decision are those (FSDP2 asks for every weight on every gather)
    _gather_plans: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def set_tensor_parallel(self, specs: Mapping[int, TPSpec], mesh: DeviceMesh) -> None:
        """Split the module's GEMMs ``{gemm index: TPSpec}`` over the 1-D ``mesh``."""
        if mesh.ndim != 1:
            raise ValueError(
                f"dtq: tensor parallelism takes a 1-D device mesh, got {mesh.ndim} dims; pass the TP "
                "sub-mesh (mesh['tp'])"
            )
        self.tp = TPLayout(dict(specs), mesh)

    def gather_plan(self, ctx: GatherContext, quantizer: Quantizer | None, have: tuple[str, ...]) -> GatherPlan:
        """What an FSDP2 all-gather of one of the module's weights serves (dtq.distributed.gather
        asks). ``quantizer``: a quantized parameter's own; None for a high-precision shard, which
        is quantized with the weight slot of the recipe the gather serves."""
        self.fsdp_gathered = True
        recipe = self._gather_recipe(ctx)
        if quantizer is None and ctx.training_state != "PRE_BACKWARD":
            self.gathered_for = (recipe,)
        key = (ctx.leaf_name, ctx.training_state, ctx.reshard_after_forward, self.recompute, have)
        hit = self._gather_plans.get(key)
        if (
            hit is not None
            and (hit[0] is recipe or hit[0] == recipe)
            and hit[1] is quantizer
            and hit[2] is self.high_precision
        ):
            return hit[3]
        plan = self._gather_plan(ctx, recipe, quantizer, have)
        if plan.weight_amax is None:  # (delayed scaling's plan holds this gather's context)
            if len(self._gather_plans) > 64:
                self._gather_plans.clear()
            self._gather_plans[key] = (recipe, quantizer, self.high_precision, plan)
        return plan

    def _gather_plan(
        self, ctx: GatherContext, recipe: Recipe | None, quantizer: Quantizer | None, have: tuple[str, ...]
    ) -> GatherPlan:
        if quantizer is not None:
            return GatherPlan(quantizer, self._needed_directions(ctx, recipe, have))
        slot = self._weight_slot(ctx, recipe) if recipe is not None else None
        hp_backward = (
            recipe is not None and recipe.backward_override == "high_precision" and ctx.training_state == "PRE_BACKWARD"
        )
        if self.high_precision is not None:
            return GatherPlan(IdentityQuantizer(), DIRECTIONS, fallback=True, why=SIZE_RULE_GATHER)
        if slot is None or slot.quantizer is None or hp_backward:
            # both directions: one passthrough payload (moved once) serves fprop and dgrad alike
            return GatherPlan(IdentityQuantizer(), DIRECTIONS, fallback=True)
        delayed = functools.partial(_delayed_weight_amax, ctx, slot) if slot.history is not None else None
        return GatherPlan(slot.quantizer, self._needed_directions(ctx, recipe, have), delayed)

    def _weight_slot(self, ctx: GatherContext, recipe: Recipe) -> Slot:
        module = self.owner() if self.owner is not None else None
        if module is None:
            raise RuntimeError(
                f"dtq: FSDP2 gathers {ctx.param_name} of a dtq module that no longer exists; keep every module "
                "that holds a sharded parameter in the model (remove modules before fully_shard, not after)"
            )
        return module.weight_slot(ctx.leaf_name, recipe)

    def _gather_recipe(self, ctx: GatherContext) -> Recipe | None:
        """The recipe a gather serves: in forward the one the module's forward resolves (FSDP2
        gathers inside the module call, so inside the user's dtq.autocast, else under the recipe
        dtq.convert bound; None means high precision); in backward, which runs outside autocast
        and possibly on autograd's own thread, the one the module last ran."""
        if ctx.training_state == "FORWARD":
            return self.resolve(in_backward())  # as the module's forward resolves it
        if self.high_precision is not None:
            return None
        return active_recipe() or self.recipe

    def _needed_directions(self, ctx: GatherContext, recipe: Recipe | None, have: tuple[str, ...]) -> tuple[str, ...]:
        override = recipe.backward_override if recipe is not None else None
        columnwise_for_backward = override is None
        rowwise_for_backward = override is not None or self.recompute
        state = ctx.training_state
        if state == "FORWARD":  # (FSDP2 gathers under no_grad: grad mode says nothing here)
            want = {ROWWISE}
            if not ctx.reshard_after_forward:  # kept unsharded until backward: bring backward's payload too
                want |= {COLUMNWISE} if columnwise_for_backward else {ROWWISE}
        elif state == "PRE_BACKWARD":
            want = ({COLUMNWISE} if columnwise_for_backward else set()) | ({ROWWISE} if rowwise_for_backward else set())
        else:  # an explicit unshard(), state-dict gathering, ...: everything the recipe uses
            want = {ROWWISE} | ({COLUMNWISE} if columnwise_for_backward else set())
        dirs = tuple(d for d in (ROWWISE, COLUMNWISE) if d in want and d in have)
        if not dirs:
            raise RuntimeError(
                f"dtq: FSDP2 gathers {ctx.param_name} in state {state} and needs {sorted(want)}, but "
                f"the sharded parameter only holds {list(have)}; quantize it with both directions"
            )
        return dirs

    def resolve(
        self, replay: bool = False, *, weight: torch.Tensor | None = None, name: str | None = None
    ) -> Recipe | None:
        """The recipe a forward runs under now: the innermost ``dtq.autocast``'s, else the bound
        default. A recompute (``replay``) outside autocast takes the recipe its forward recorded.
        Given the GEMM's ``weight``, a forward that resolves no recipe without the user having
        chosen that (no autocast active) is said once: it silently computes in high precision
        (``name``: the module's, by default the owner's, built only then). A module kept in high
        precision (``high_precision``) resolves None under every recipe."""
        if self.high_precision is not None:
            return None
        if replay:
            return active_recipe() or self.recipe
        # The bound default is read only where no autocast is active: a compiled trace that met one
        # recipe object both there and on the autocast stack guarded only the first place under
        # torch 2.11, so switching autocast off (or to another recipe) did not recompile.
        active = autocast_active()
        recipe = active_recipe() if active else self.default_recipe
        if recipe is None and weight is not None and not active and not torch.compiler.is_compiling():
            _warn_without_recipe(self._owner_name() if name is None else name, weight)
        return recipe

    def _owner_name(self) -> str:
        module = self.owner() if self.owner is not None else None
        return "" if module is None else f"{type(module).__name__} {module.name!r}"

    def begin(self, recipe: Recipe | None, replay: bool, no_grad_trainable: bool) -> AmaxSync | None:
        """Record a forward call under ``recipe`` (a recompute records nothing: it replays the
        forward it recomputes) and return the amax reduction its delayed scaling joins.
        ``no_grad_trainable``: a forward without grad of a weight that requires grad, whose
        backward (if any) recomputes it (reentrant checkpoint)."""
        if replay:
            self.awaiting_recompute = False
            return self.amax_sync
        self.check_gathered_for(recipe)
        self.recipe = recipe
        self.amax_sync = active_amax_sync()
        if recipe is not None and recipe.delayed and self.amax_sync is None and _multi_rank():
            warn_once(
                "delayed-without-amax-group",
                f"dtq: {type(recipe).__name__} in a job of {torch.distributed.get_world_size()} ranks without "
                "dtq.autocast(..., amax_group=...): each rank keeps amax histories (and scales) of its own "
                "activations; pass the data-parallel group to share them, as TransformerEngine's fp8_group "
                "does",
            )
        # reentrant checkpointing runs its forward under no_grad, inside CheckpointFunction
        checkpointed = inside_checkpoint_forward() or (no_grad_trainable and checkpoint_region() is not None)
        self.recompute = checkpointed or no_grad_trainable
        self.awaiting_recompute = checkpointed
        return self.amax_sync

    def check_gathered_for(self, recipe: Recipe | None) -> None:
        """Refuse a forward under ``recipe`` on weights FSDP2 gathered quantized for another one
        and still holds gathered: it would run the other recipe's weight payloads (or high
        precision ones) without a word. A fresh gather is made for the forward's own recipe, so
        only weights kept from an earlier forward can differ."""
        if self.gathered_for is None:
            return
        had = self.gathered_for[0]
        if had is recipe or had == recipe:
            return
        name = self._owner_name() or "a dtq module"
        was = type(had).__name__ if had is not None else "high precision (no recipe)"
        now = type(recipe).__name__ if recipe is not None else "high precision (no recipe)"
        raise RuntimeError(
            f"dtq: {name} runs a forward under {now}, but FSDP2 still holds its weights gathered for "
            f"{was} by an earlier forward (fully_shard(..., reshard_after_forward=False) keeps them "
            "until a backward). Reshard between forward-only passes under different recipes "
            "(model.reshard() on the fully_shard-ed modules, e.g. after evaluation), or use "
            "reshard_after_forward=True"
        )

    def __getstate__(self) -> dict:
        # an AmaxSync holds a process group: neither pickled nor deep-copied (rebuilt next step);
        # the owner is set again by the module (QuantizedModule.__setstate__)
        # (and what FSDP2 holds gathered belongs to this process)
        return {**self.__dict__, "amax_sync": None, "owner": None, "_gather_plans": {}, "gathered_for": None}

    def __setstate__(self, state: dict) -> None:
        # (a state pickled before a field existed gets its default)
        self.__dict__.update({"_gather_plans": {}, "gathered_for": None, **state})

    def __deepcopy__(self, memo) -> GemmState:
        return GemmState(
            self.recipe,
            None,
            self.recompute,
            self.awaiting_recompute,
            self.fsdp_gathered,
            self.default_recipe,
            self.tp,
            high_precision=self.high_precision,
        )


@dataclasses.dataclass(eq=False)
class GemmSlots:
    """The (input, weight, grad_output) slots of one GEMM of one module under one recipe, with
    the module's state (None in a template: see :func:`template_key`)."""

    name: str
    recipe: Recipe
    sx: Slot
    sw: Slot
    sg: Slot
    state: GemmState | None
    module: weakref.ReferenceType | None = None
    weight_name: str = "weight"
    gemm: int = 0
    # dtq.nn.linear_plan's plans of this GEMM's plain calls, per call shape
    plans: dict = dataclasses.field(default_factory=dict, repr=False)

    @functools.cached_property
    def plannable(self) -> bool:
        """Whether plain calls of these slots can run planned (``dtq.nn.linear_plan``): every
        operand quantized, current scaling, no backward override."""
        return self.recipe.backward_override is None and all(
            s.quantizer is not None and s.history is None for s in (self.sx, self.sw, self.sg)
        )

    @property
    def override(self) -> str | None:
        return self.recipe.backward_override

    @property
    def quantizers(self) -> tuple:
        return (self.sx.quantizer, self.sw.quantizer, self.sg.quantizer)

    def call(self, need_dgrad: bool, need_wgrad: bool) -> GemmCall:
        """The :class:`GemmCall` of a plain call (no recompute, amax reduction, amax link or tensor
        parallelism), made once per gradient combination: the common call allocates nothing."""
        calls = self.__dict__.get("_calls")
        if calls is None:
            calls = self._calls = tuple(GemmCall(self, d, w) for d in (False, True) for w in (False, True))
        return calls[2 * need_dgrad + need_wgrad]

    def live_weight(self) -> torch.Tensor | None:
        """The module's weight parameter as it is now: under FSDP2, the unsharded parameter whose
        payloads the backward all-gather refilled (a compiled graph holds the forward's)."""
        module = self.module() if self.module is not None else None
        return getattr(module, self.weight_name, None) if module is not None else None

    def __iter__(self):  # (sx, sw, sg) unpacking
        return iter((self.sx, self.sw, self.sg))


class GemmHandle(OpaqueBase):
    """A dtq module as the compiled path's custom ops see it: an opaque graph *input* (not a
    constant), so that blocks of one structure share one compiled graph while each call reaches
    its own module's slots, amax histories and state when it runs."""

    def __init__(self, module: torch.nn.Module):
        self._module = weakref.ref(module)

    def __reduce__(self):
        # What inductor's FX graph cache pickles for its key: a handle is a graph input, so the
        # compiled code is the same whichever module it reaches; reduced to a handle to no module
        # (calling one raises), the key is stable and compiled graphs are cached across runs; with
        # dtq's code fingerprint in it, a graph is not reused by another version of dtq.
        return (_detached_handle, (code_fingerprint(),))

    def slots(self, recipe: Recipe, gemm: int) -> GemmSlots:
        module = self._module()
        if module is None:
            raise RuntimeError("dtq: a compiled graph called a dtq module that no longer exists")
        return module._slots(recipe, gemm)

    def check_gathered_for(self, recipe: Recipe | None) -> None:
        """:meth:`GemmState.check_gathered_for` of the module (a compiled call runs it)."""
        module = self._module()
        if module is not None:
            module.gemm_state.check_gathered_for(recipe)

    def weight(self, gemm: int) -> torch.Tensor | None:
        """The module's weight parameter of GEMM ``gemm`` as it is now (None once the module is gone)."""
        module = self._module()
        return None if module is None else getattr(module, module.weight_names()[gemm], None)


register_opaque_reference(GemmHandle)


@functools.cache
def code_fingerprint() -> str:
    """A hash of dtq's Python sources. A compiled graph holds what dtq's code decided when it was
    traced (the ops' schemas and autograd formulas, inductor decompositions, graph constants); the
    caches that hand graphs to later processes key them by the graph dynamo saw, which calls only
    ``dtq::linear``, so a graph traced by another dtq would be reused (calling ops whose schema
    has changed since). The handle, an input of every such graph, carries this into the key."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        digest.update(f.relative_to(root).as_posix().encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


def _detached_handle(fingerprint: str = "") -> GemmHandle:
    handle = GemmHandle.__new__(GemmHandle)
    handle._module = lambda: None
    return handle


_template_keys: dict = {}
_TEMPLATES: dict[int, GemmSlots] = {}


@assume_constant_result
def template_key(recipe_key: int, module_type: str, name: str, suffix: str, gemm: int) -> int:
    """The number of the slots template of one GEMM under a recipe: its quantizers (and roles,
    for messages) without any module's state; what a compiled graph is traced with (a constant:
    every argument is). ``name`` is the module's name only for recipes whose quantizers depend
    on it, so that blocks of one structure share a graph."""
    k = (recipe_key, module_type, name, suffix, gemm)
    key = _template_keys.get(k)
    if key is None:
        recipe = recipe_by_key(recipe_key)
        slots = [Slot(r, recipe.quantizer(r)) for r in gemm_roles(module_type, name + suffix)]
        key = _template_keys[k] = content_key((recipe, module_type, name, suffix, gemm, [s.quantizer for s in slots]))
        other = _TEMPLATES.get(key)
        if other is not None and (other.recipe, other.quantizers) != (recipe, tuple(s.quantizer for s in slots)):
            raise RuntimeError(f"dtq: two GEMM slot templates share the key {key}: {other.name} and {module_type}")
        _TEMPLATES[key] = GemmSlots(f"{module_type} {name + suffix!r}", recipe, *slots, None, gemm=gemm)
    return key


def content_key(content) -> int:
    """A template's key from what it is and the code that traces it: compiled graphs hold it as a
    constant, the caches that hand graphs to later processes key them by those constants, and a
    graph must reach the same template there (a number handed out in tracing order could name
    another recipe's) and not outlive dtq's code (:func:`code_fingerprint`). Nonzero, below 2**56
    (an int64 in the ops' schemas). Also the key of a quantized weight's layout (``dtq.nn._ops``)."""
    digest = hashlib.sha256(repr((content, code_fingerprint())).encode()).digest()
    return int.from_bytes(digest[:7], "big") or 1


def template(key: int) -> GemmSlots:
    return _TEMPLATES[key]


def gemm_roles(module_type: str, name: str) -> list:
    """The roles of one GEMM's quantized slots (input, weight, grad_output)."""
    return [QuantizerRole(module_type, tt, name) for tt in TENSOR_TYPES]


class GemmCall(NamedTuple):
    """One call of one GEMM: its slots, which gradients backward computes (grad mode and
    requires_grad included, so no payload is built in vain), whether this forward is a recompute,
    the amax reduction of delayed scaling, the fused-kernel amax link (``dtq.nn.functional``), and
    the tensor-parallel split (``tp`` over ``group``). A tuple: made on every GEMM call."""

    slots: GemmSlots
    need_dgrad: bool
    need_wgrad: bool
    replay: bool = False
    amax_sync: Any = None
    link: Any = None
    tp: Any = None
    group: Any = None

    @property
    def name(self) -> str:
        return self.slots.name

    @property
    def override(self) -> str | None:
        return self.slots.recipe.backward_override


def _delayed_weight_amax(ctx: GatherContext, slot: Slot, amax: dict) -> torch.Tensor:
    """Delayed scaling: the weight's scale comes from its amax history, exactly as the module's
    own quantization of an unsharded weight would take it. A forward gather is that quantization
    (one per forward call: the history takes the global current amax); a backward or recompute
    gather reuses the scale of the forward it serves."""
    if ctx.training_state == "FORWARD" and not in_backward():
        cur = next(iter(amax.values()))  # per-tensor: the same global max|W| for every direction
        return slot.delayed_amax(cur, active_amax_sync())
    used = slot.replayed_amax()
    return used if used is not None else next(iter(amax.values()))  # no forward yet (explicit unshard)


def _warn_without_recipe(name: str, weight: torch.Tensor) -> None:
    local = local_tensor(weight)  # a tensor-parallel DTensor's shard
    fix = (
        "wrap the forward in `with dtq.autocast(recipe):` or bind a recipe with dtq.convert(model, "
        "recipe=recipe); inside dtq.autocast(enabled=False) high precision is chosen and not reported"
    )
    if isinstance(local, QuantizedTensor) and not isinstance(local.quantizer, IdentityQuantizer):
        warn_once(
            "quantized-params-without-recipe",
            f"dtq: {name} holds quantized parameters ({local.quantizer.format_name}) but runs outside any "
            f"recipe: it dequantizes them and computes in high precision; {fix}",
        )
    elif torch.is_grad_enabled() and weight.requires_grad:
        warn_once(
            "training-without-recipe",
            f"dtq: {name} runs a training forward outside dtq.autocast and has no recipe bound by "
            f"dtq.convert: dtq modules then train in high precision, nothing is quantized; {fix}",
        )


def _multi_rank() -> bool:
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )
