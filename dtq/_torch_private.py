"""Every read of torch's private state that dtq relies on, in one file.

FSDP2 tells an all-gather extension which module owns the parameter but not *why* it gathers;
direction-aware gathers need the parameter group's training state (FORWARD vs PRE_BACKWARD) and
``reshard_after_forward``, and, because FSDP2 sizes its all-gather buffers once, a way to let them
be re-sized when the gathered directions change. ``tests/parallel/test_torch_private.py`` fails loudly if
a torch release moves any of this.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import weakref
from typing import NamedTuple

import torch


class GatherContext(NamedTuple):  # (a tuple: made on every gather of every weight)
    training_state: str  # "FORWARD", "PRE_BACKWARD", "POST_BACKWARD" or "IDLE"
    reshard_after_forward: bool
    param_name: str  # fully qualified when FSDP2 knows it (after its lazy init), for messages
    leaf_name: str  # the attribute name on the owning module
    fsdp_param: object  # torch's FSDPParam (private)
    module_name: str = ""  # the fully_shard-ed module's fully qualified name ("" for the root)
    post_forward_mesh: bool = False  # reshard_after_forward=<int>: a smaller group after forward


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.12
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def _find(local_tensor: torch.Tensor):
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    for ref in list(_module_state_mapping.values()):
        state = ref()
        if not isinstance(state, FSDPState):
            continue
        for group in _param_groups(state):
            for fsdp_param in group.fsdp_params:
                if fsdp_param._sharded_local_tensor is local_tensor:
                    return group, fsdp_param
    return None, None


def fsdp_holds(local_tensor: torch.Tensor) -> bool:
    """Whether an FSDP2 parameter group holds ``local_tensor`` as a sharded parameter (a
    tensor-parallel weight outside ``fully_shard`` is a DTensor that none holds)."""
    cached = getattr(local_tensor, "_dtq_fsdp_refs", None)
    fsdp_param = cached[1]() if cached is not None else None
    if fsdp_param is not None and fsdp_param._sharded_local_tensor is local_tensor:
        return True  # gather_context found it before
    return _find(local_tensor)[1] is not None


def gather_context(local_tensor: torch.Tensor) -> GatherContext:
    """Why FSDP2 is gathering ``local_tensor`` right now. The lookup, and the names (which FSDP2
    sets at its lazy init, before any gather), are cached on the tensor."""
    cached = getattr(local_tensor, "_dtq_fsdp_refs", None)
    group = fsdp_param = None
    if cached is not None:
        group, fsdp_param = cached[0](), cached[1]()
    if group is None or fsdp_param is None or fsdp_param._sharded_local_tensor is not local_tensor:
        group, fsdp_param = _find(local_tensor)
        if fsdp_param is None:
            raise RuntimeError(
                "dtq: this tensor's fsdp_pre_all_gather was called, but no FSDP2 parameter group "
                "holds it as a sharded parameter (is torch's FSDP2 layout different in this release?)"
            )
        cached = None
    if cached is None or cached[2] is None:
        leaf = fsdp_param._module_info.param_name
        prefix = group._module_fqn or ""
        # FSDPParam._param_fqn: the name from the root (set at FSDP2's lazy init); the group's module
        # name + leaf misses the owning submodule's path (a root group's lm_head.weight: "weight").
        known = getattr(fsdp_param, "_param_fqn", None)
        fqn = known or _owner_fqn(fsdp_param, leaf) or f"{prefix}.{leaf}".lstrip(".")
        names = (fqn, leaf, prefix) if known else None  # (before the lazy init: looked up again)
        local_tensor._dtq_fsdp_refs = (weakref.ref(group), weakref.ref(fsdp_param), names)
        names = names or (fqn, leaf, prefix)
    else:
        names = cached[2]
    return GatherContext(
        group._training_state.name,
        bool(group._reshard_after_forward),
        names[0],
        names[1],
        fsdp_param,
        names[2],
        bool(group._use_post_forward_mesh),
    )


def _owner_fqn(fsdp_param, leaf: str) -> str:
    """Before FSDP2's lazy init: the owning dtq module's own name (dtq.convert sets it to the FQN)."""
    name = getattr(fsdp_param._module_info.module, "name", "")
    return f"{name}.{leaf}" if isinstance(name, str) and name else ""


def resize_gather_buffers(ctx: GatherContext, inputs: list[torch.Tensor], world_size: int) -> None:
    """FSDP2 allocates a parameter's all-gather outputs once, sized by its first gather. When
    the directions gathered change (forward: rowwise, backward: columnwise), drop them so FSDP2
    allocates buffers of the new sizes; the unsharded parameter object itself is kept."""
    outs = ctx.fsdp_param.all_gather_outputs
    if not outs:
        return
    want = [(t.numel() * world_size, t.dtype) for t in inputs]
    have = [(t.numel() if t.untyped_storage().size() else t.shape.numel(), t.dtype) for t in outs]
    if want != have:
        ctx.fsdp_param.all_gather_outputs = []


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor, as it is (no autograd edge: parameters, state-dict entries;
    activations use ``DTensor.to_local()``); any other tensor itself."""
    return t._local_tensor if hasattr(t, "device_mesh") else t


def dtensor_layout(t) -> tuple | None:
    """(mesh, placements) of a DTensor, from its spec (the public properties cost twice as much:
    the fused optimizer step looks at every state tensor of every parameter); None for anything else."""
    spec = getattr(t, "_spec", None)
    return None if spec is None else (spec.mesh, spec.placements)


_HANDLERS_LOCK = threading.RLock()  # DTensor's handler table is one per process
_INSTALLED: dict = {}  # aten op -> [contexts using it, the entry it replaced (or None)]


@contextlib.contextmanager
def dtensor_op_handlers(handlers: dict):
    """Within it, DTensor's dispatch hands each of ``handlers``' aten ops to its handler,
    ``handler(op, args, kwargs)``, before any sharding propagation: the table DTensor keeps for
    its own such ops (``_custom_op_handlers``, which torch's ``loss_parallel`` extends the same
    way). Contexts may nest and overlap across threads: the first one installs an op's handler,
    the last one to leave puts back what was there."""
    from torch.distributed.tensor import DTensor

    table = DTensor._op_dispatcher._custom_op_handlers
    with _HANDLERS_LOCK:
        for op, handler in handlers.items():
            if op in _INSTALLED:
                _INSTALLED[op][0] += 1
            else:
                _INSTALLED[op] = [1, table.get(op)]
                table[op] = handler
    try:
        yield
    finally:
        with _HANDLERS_LOCK:
            for op in handlers:
                entry = _INSTALLED[op]
                entry[0] -= 1
                if entry[0] == 0:
                    del _INSTALLED[op]
                    if entry[1] is None:
                        table.pop(op, None)
                    else:
                        table[op] = entry[1]


@contextlib.contextmanager
def without_dtensor_handler(op):
    """DTensor's own dispatch of ``op`` while a handler of :func:`dtensor_op_handlers` is
    installed for it (the handler's way back when it declines a call). Holds the table's lock
    throughout, so no other thread finds the entry missing or leaves it in place for good."""
    from torch.distributed.tensor import DTensor

    table = DTensor._op_dispatcher._custom_op_handlers
    with _HANDLERS_LOCK:
        handler = table.pop(op, None)
        try:
            yield
        finally:
            if handler is not None:
                table[op] = handler


def fsdp_gather_dtype(fsdp_param) -> torch.dtype | None:
    """The dtype FSDP2 casts a parameter's shard to for its all-gather (the ``mp_policy`` it hands
    ``fsdp_pre_all_gather``), None for the parameter's own. ``FSDPParam.mp_policy`` is set by
    ``fully_shard``; ``FSDPParam.param_dtype`` only at the first forward."""
    return fsdp_param.mp_policy.param_dtype


def fsdp_shard_group(fsdp_param):
    """The process group a parameter is sharded over (FSDP2's shard mesh from the root; HSDP:
    the shard dimension only)."""
    return fsdp_param.shard_mesh_from_root.get_group()


def inside_checkpoint_forward() -> bool:
    """True while ``torch.utils.checkpoint`` runs a forward whose activations it will recompute:
    non-reentrant (its saved-tensor hook is on top) or reentrant (forward under no_grad)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", ""):
        return True
    return False


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (a module forward then
    is a recompute)."""
    return graph_task_id() != -1


def graph_task_id() -> int:
    """The running backward pass (autograd graph task), -1 outside backward."""
    return torch._C._current_graph_task_id()


def at_end_of_backward(fn) -> None:
    """Run ``fn`` once the running backward pass (graph task) has finished its work (call it
    inside backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def checkpoint_region():
    """The ``torch.utils.checkpoint`` region whose forward (or recompute) runs right now, as an
    object that is the same in both, or None outside any. A recompute replays its region's
    forward in order, so what a module recorded per region in forward it finds again, in order,
    when that region is recomputed (regions themselves are recomputed in backward's order).

    Non-reentrant: the region's ``_CheckpointFrame``, read from the closure of the saved-tensor
    hook on top (``_checkpoint_hook`` in forward, ``_recomputation_hook`` in recompute).
    Reentrant: the ``CheckpointFunction`` node, whose forward (under no_grad) and backward (the
    recompute) are on the Python stack."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None:
        pack = inspect.unwrap(hooks[0])  # the recompute's hook is wrapped in torch._dynamo.disable
        cells = dict(zip(pack.__code__.co_freevars, pack.__closure__ or ()))
        if "_checkpoint_hook" in pack.__qualname__ and "frame" in cells:
            return cells["frame"].cell_contents
        if "_recomputation_hook" in pack.__qualname__ and "target_frame_ref" in cells:
            return cells["target_frame_ref"].cell_contents()
    if torch.is_grad_enabled() and not in_backward():
        return None  # a reentrant checkpoint runs its forward under no_grad, its recompute in backward
    from torch.utils.checkpoint import CheckpointFunction

    codes = (CheckpointFunction.forward.__code__, CheckpointFunction.backward.__code__)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            return frame.f_locals.get("ctx")
        frame = frame.f_back
    return None


try:  # torch 2.15 renamed the base of opaque types (the old module logs a deprecation on import)
    from torch._custom_class_base import CustomClassBase as OpaqueBase  # noqa: F401 - for dtq.nn.gemm_state
except ImportError:
    from torch._opaque_base import OpaqueBase  # noqa: F401 - for dtq.nn.gemm_state


def register_opaque_reference(cls: type) -> None:
    """Register ``cls`` (an ``OpaqueBase`` subclass) as an opaque type that torch.compile passes to
    custom ops as a graph input, not as a constant baked into the graph. torch 2.15 renamed the
    call and the kind (``register_custom_class``, ``"symbolic"``); its old names still work there
    but log two deprecation warnings at every ``import dtq``."""
    from torch._library import opaque_object

    if hasattr(opaque_object, "register_custom_class"):
        opaque_object.register_custom_class(cls, typ="symbolic")
    else:
        opaque_object.register_opaque_type(cls, typ="reference")


def assume_constant_result(fn):
    """``torch._dynamo.assume_constant_result``: dynamo calls ``fn`` while tracing and bakes its
    result into the graph. The decorator only marks the function (``_dynamo_marked_constant``);
    marking it here spares ``import dtq`` the import of ``torch._dynamo`` (about 0.6 s of every
    process on the CPU machine, every spawned test rank included), which a process that never
    compiles does not need."""
    fn._dynamo_marked_constant = True
    return fn


def register_foreach_type(cls: type) -> None:
    """Let torch's optimizers pick their multi-tensor (foreach) kernels for parameters of tensor
    subclass ``cls``, as DTensor registers itself. Without it, AdamW's default on a GPU runs its
    per-tensor loop for a single process's dtq weights but the multi-tensor kernels for FSDP2's
    DTensors of the same weights, and the two round differently (the update differs in the last
    bits), besides the loop being slower."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for module in (optimizer, _foreach_utils):
        types = getattr(module, "_foreach_supported_types", None)  # moved: test_torch_private.py says so
        if types is not None and cls not in types:
            types.append(cls)


def one_rank_reduce_scatter():
    """A reduce-scatter comm (FSDP2's ``set_custom_reduce_scatter``) for a shard group of one rank
    that spares FSDP2's copy of the packed gradients. Over one rank FSDP2 (2.10-2.13) does not
    reduce-scatter: it allocates a second buffer of the same size and copies the packed gradients
    into it (at the 1.07 B shapes about 8.6 GB of reads and writes a step, competing with the
    next block's backward); 2.9 calls the comm, which then has nothing to do. FSDP2 allocates the
    packed input on the current stream, then the output on its reduce-scatter stream; handing the
    input back as the output makes the copy a self-copy, which ``Tensor.copy_`` skips. Bits are
    unchanged: a one-rank sum or average is the identity.

    FSDP2 keeps the input only until the next unit's reduction, having waited for the reduction
    but not for what it runs after it on that stream (accumulating into existing gradients,
    casting to another dtype, copying to the CPU), which now reads this buffer: the buffer is
    therefore marked as used on that stream (``record_stream``), so the allocator does not hand
    it out again before that work is done. Where a pairing cannot be sure (the pending input
    gone, or on CUDA an output asked for on the input's own stream) the comm allocates afresh.
    Making one also installs :func:`one_rank_copy_in` (the packing into that buffer)."""
    import weakref

    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class OneRankReduceScatter(ReduceScatter):
        def __init__(self) -> None:
            self._pending = None  # (weakref to the packed input of the reduction in progress, its stream)

        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            pending, self._pending = self._pending, None
            cuda = torch.device(device).type == "cuda"
            stream = torch.cuda.current_stream(device) if cuda else None
            if pending is not None:
                packed = pending[0]()
                if (
                    packed is not None
                    and packed.shape == tuple(size)
                    and packed.dtype == dtype
                    and packed.device == torch.device(device)
                    and (not cuda or stream != pending[1])  # the output: on the reduce-scatter stream
                ):
                    if cuda:
                        packed.record_stream(stream)
                    return packed  # the output: the input itself
            packed = torch.empty(*size, dtype=dtype, device=device)
            self._pending = (weakref.ref(packed), stream)
            return packed

        def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
            # torch 2.9 calls the comm over one rank too: with the output the input itself, a sum
            # or an average over one rank leaves it as it is
            identity = op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
            if group.size() == 1 and output_tensor is input_tensor and identity:
                return None
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    one_rank_copy_in()
    return OneRankReduceScatter()


def one_rank_copy_in() -> None:
    """Make FSDP2's gradient copy-in over one rank a plain concatenation (:func:`install_copy_in`,
    keeping a packing installed before). FSDP2 (2.10-2.13, ``_fsdp_collectives.foreach_reduce``)
    packs each unit's gradients into the reduce-scatter input with ``torch._chunk_cat``, whose CUDA
    kernel describes its grid on the host: one entry per 2 KiB of output, built and copied to the
    device on every call (about 0.5 ms of host time for a 1.07 B decoder block's 270 MB, 16 a
    step: host time of a host-bound FP8 step). Over one rank the chunks are the whole flattened
    gradients, unpadded, so ``torch.cat`` into the same buffer writes the same bits (a cast to
    the reduce dtype, which is exact or rounds alike). Called by :func:`one_rank_reduce_scatter`."""
    install_copy_in()


def install_copy_in(pack=None) -> None:
    """Replace FSDP2's gradient copy-in (the module function ``foreach_reduce_scatter_copy_in``
    that ``foreach_reduce`` calls, torch 2.10-2.13), process-wide: ``pack(grads, out, world_size)``
    first (a faster packing of the same bits, e.g. dtq's kernel; it returns False, writing nothing,
    where it does not take the call), then over one rank ``torch.cat`` (:func:`one_rank_copy_in`),
    else FSDP2's own. ``pack`` None keeps the one installed before. Traced FSDP2 keeps its own
    function. Installing again replaces the previous wrapper (never wraps it)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    current = getattr(collectives, "foreach_reduce_scatter_copy_in", None)
    if current is None:
        return  # (a torch without it keeps its own packing: tests/parallel/test_torch_private.py says so)
    own = getattr(current, "_dtq_fsdp2s", current)
    if pack is None:
        pack = getattr(current, "_dtq_pack", None)
    if current is not own and getattr(current, "_dtq_pack", None) is pack:
        return

    def foreach_reduce_scatter_copy_in(unsharded_grads, reduce_scatter_input, world_size):
        if torch.compiler.is_compiling():
            return own(unsharded_grads, reduce_scatter_input, world_size)
        with torch.no_grad():
            if pack is not None and pack(unsharded_grads, reduce_scatter_input, world_size):
                return None
            if world_size == 1:
                torch.cat([g.reshape(-1) for g in unsharded_grads], out=reduce_scatter_input.view(-1))
                return None
        return own(unsharded_grads, reduce_scatter_input, world_size)

    foreach_reduce_scatter_copy_in._dtq_one_rank = True
    foreach_reduce_scatter_copy_in._dtq_fsdp2s = own
    foreach_reduce_scatter_copy_in._dtq_pack = pack
    collectives.foreach_reduce_scatter_copy_in = foreach_reduce_scatter_copy_in


def one_rank_gathers(module: torch.nn.Module, cast) -> int:
    """Let FSDP2 gather the plain parameters of ``module``'s groups that shard over one rank with
    ``cast(shard, out)``: one pass from each shard into its unsharded parameter. Over one rank
    FSDP2 (2.10-2.13, ``FSDPParamGroup.wait_for_unshard``) casts each shard into a new tensor
    (``FSDPParam.all_gather_inputs``) and copies that into the parameter's gather output; here
    ``all_gather_inputs`` writes the gather output itself and hands it back, so the copy is a
    self-copy, which ``Tensor.copy_`` skips. ``cast`` writes ``out`` (FSDP2's gather output, of
    the parameter dtype) from ``shard`` (the flat local shard: the whole parameter) as
    ``out.copy_(shard)`` would. The parameters' class becomes a subclass of FSDP2's ``FSDPParam``
    that overrides that property. Parameters with an all-gather extension, offloaded to the CPU,
    or in a group that reshards to a smaller mesh after forward keep FSDP2's path. Returns how
    many parameters take the one-pass cast."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    state = module._get_fsdp_state()
    count = 0
    for group in _param_groups(state):
        if group._use_post_forward_mesh:
            continue
        if isinstance(group.mesh_info, FSDPMeshInfo) and group.mesh_info.shard_process_group.size() != 1:
            continue
        for fsdp_param in group.fsdp_params:
            if fsdp_param.offload_to_cpu or hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"):
                continue
            fsdp_param.__class__ = _one_rank_param_class(type(fsdp_param), cast)
            count += 1
    return count


_ONE_RANK_CLASSES: dict = {}  # (FSDPParam class, cast) -> its one-rank subclass


def _one_rank_param_class(base: type, cast) -> type:
    if getattr(base, "_dtq_one_rank_cast", None) is cast:
        return base
    base = getattr(base, "_dtq_one_rank_base", base)
    cls = _ONE_RANK_CLASSES.get((base, cast))
    if cls is not None:
        return cls
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState, alloc_storage

    own = base.all_gather_inputs.fget

    def all_gather_inputs(self) -> list[torch.Tensor]:
        if self.sharded_state != ShardedState.SHARDED or torch.compiler.is_compiling():
            return own(self)  # (a graph that traces FSDP2's hooks: its own ops)
        shard = self._sharded_param_data
        self.init_all_gather_outputs([shard.numel()], [self.param_dtype or shard.dtype], 1, self.device)
        out = self.all_gather_outputs[0]
        alloc_storage(out)
        with torch.no_grad():
            cast(shard, out)
        return [out]

    doc = "FSDP2's FSDPParam whose one-rank gather casts the shard into the gather output (dtq)."
    attrs = {"all_gather_inputs": property(all_gather_inputs), "_dtq_one_rank_cast": cast}
    cls = type(f"OneRank{base.__name__}", (base,), {**attrs, "_dtq_one_rank_base": base, "__doc__": doc})
    _ONE_RANK_CLASSES[(base, cast)] = cls
    return cls


def unversioned_write(t: torch.Tensor):
    """A context in which writes into ``t`` leave its version counter as it was: a gather's
    refill of memory autograd has seen (FSDP2 writes its gather outputs so)."""
    return torch.autograd._unsafe_preserve_version_counter(t)
