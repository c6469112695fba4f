"""dtq reads a few private torch attributes (dtq/_torch_private.py). If a torch release
moves any of them, these tests fail with a message saying which one."""

import itertools
import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

import dtq
from dtq import _torch_private as priv
from dtq.testing import spawn


def _check_fsdp_state(rank, world):
    model = torch.nn.Sequential(dtq.nn.Linear(64, 64, name="a"))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    local = model[0].weight._local_tensor
    ctx = priv.gather_context(local)
    assert ctx.training_state == "IDLE", "FSDPParamGroup._training_state moved or was renamed"
    assert ctx.reshard_after_forward is True, "FSDPParamGroup._reshard_after_forward moved"
    assert ctx.leaf_name == "weight", f"FSDPParam._module_info.param_name moved ({ctx.leaf_name!r})"
    assert hasattr(ctx.fsdp_param, "all_gather_outputs"), "FSDPParam.all_gather_outputs moved"
    assert priv.local_tensor(model[0].weight) is local, "DTensor._local_tensor moved"
    assert priv.fsdp_gather_dtype(ctx.fsdp_param) is None, "FSDPParam.mp_policy.param_dtype moved"
    group = priv.fsdp_shard_group(ctx.fsdp_param)
    assert torch.distributed.get_world_size(group) == world, "FSDPParam.shard_mesh_from_root moved"
    bf16 = torch.nn.Sequential(dtq.nn.Linear(64, 64, name="b"))
    fully_shard(bf16, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    bf16_ctx = priv.gather_context(priv.local_tensor(bf16[0].weight))
    assert priv.fsdp_gather_dtype(bf16_ctx.fsdp_param) == torch.bfloat16, "FSDPParam.mp_policy moved"
    seen = []
    real = priv.gather_context

    def spy(t):
        c = real(t)
        seen.append(c.training_state)
        return c

    priv.gather_context = spy
    import dtq.distributed.gather as ext

    ext.gather_context = spy
    try:
        with dtq.autocast(dtq.MXFP8BlockScaling()):
            model(torch.randn(32, 64)).sum().backward()
    finally:
        priv.gather_context = real
        ext.gather_context = real
    assert seen == ["FORWARD", "PRE_BACKWARD"], f"FSDP2 training states seen by the all-gather: {seen}"
    assert priv.gather_context(local).param_name == "0.weight", "FSDPParamGroup._module_fqn moved"


def test_fsdp2_private_state_is_where_dtq_reads_it():
    spawn(_check_fsdp_state, 1, backend="gloo")


def test_checkpoint_and_backward_detection():
    from torch.utils.checkpoint import checkpoint

    seen = {}

    def f(x):
        seen.setdefault("inside", []).append((priv.inside_checkpoint_forward(), priv.in_backward()))
        return x * x  # saves x, so backward recomputes

    x = torch.randn(4, requires_grad=True)
    checkpoint(f, x, use_reentrant=False).sum().backward()
    assert seen["inside"][0] == (True, False), "torch.utils.checkpoint's _checkpoint_hook is no longer detectable"
    assert seen["inside"][1][1] is True, "torch._C._current_graph_task_id() no longer marks a recompute in backward"
    assert priv.in_backward() is False and priv.inside_checkpoint_forward() is False
    # a callback queued inside backward runs once that backward pass is over
    order = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            order.append(("backward", priv.graph_task_id() != -1))
            priv.at_end_of_backward(lambda: order.append(("callback", None)))
            return g

    y = Probe.apply(x) * 2
    y.sum().backward()
    assert order == [("backward", True), ("callback", None)], "the autograd engine's queue_callback moved"


def test_checkpoint_region_is_the_same_in_forward_and_recompute():
    from torch.utils.checkpoint import checkpoint

    for reentrant in (False, True):
        seen = []

        def f(x):
            seen.append(priv.checkpoint_region())
            return x * x

        x = torch.randn(4, requires_grad=True)
        checkpoint(f, x, use_reentrant=reentrant).sum().backward()
        kind = "reentrant" if reentrant else "non-reentrant"
        assert len(seen) == 2 and seen[0] is not None, f"{kind} checkpoint region not found ({seen})"
        assert seen[0] is seen[1], f"{kind}: forward and recompute see different regions ({seen})"
        checkpoint(f, x, use_reentrant=reentrant)
        assert seen[-1] is not seen[0], f"{kind}: two checkpoint calls share a region"
    assert priv.checkpoint_region() is None
    seen.clear()
    f(torch.randn(2))  # outside any checkpoint
    assert seen == [None]


def test_dtq_weights_are_among_torchs_foreach_types():
    """dtq registers its weight wrapper where torch's optimizers look up the tensor types their
    multi-tensor kernels take (``priv.register_foreach_type``), as DTensor registers itself."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for module in (optimizer, _foreach_utils):
        types = getattr(module, "_foreach_supported_types", None)
        assert types is not None, f"{module.__name__}._foreach_supported_types moved"
        assert dtq.parallel.HighPrecisionWeight in types, module.__name__


def _recording(comm, seen: list):
    """``comm`` with every buffer its ``allocate`` returns appended to ``seen``."""
    real = comm.allocate

    def allocate(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    comm.allocate = allocate
    return comm


def _counting(fn, calls: list):
    """``fn`` appending each call's world size to ``calls``."""

    def counted(grads, out, world_size):
        calls.append(world_size)
        return fn(grads, out, world_size)

    return counted


def _check_one_rank_reduce_scatter(rank, world):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # one rank: FSDP2 alone; two: HSDP whose shard groups have one rank (the all-reduce across
    # replicas then runs in place on the packed buffer)
    shape, names = ((1,), None) if world == 1 else ((world, 1), ("replicate", "shard"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))
        fully_shard(model[0], mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    default, spared = build(), build()
    allocations = {}
    for name, unit in (("block", spared[0]), ("root", spared)):
        unit.set_custom_reduce_scatter(_recording(priv.one_rank_reduce_scatter(), allocations.setdefault(name, [])))
    # the comm installs dtq's one-rank copy-in; the default model runs FSDP2's own
    ours = collectives.foreach_reduce_scatter_copy_in
    assert ours._dtq_one_rank, "one_rank_reduce_scatter did not install dtq's copy-in"
    copy_ins = {default: ours._dtq_fsdp2s, spared: _counting(ours, calls := [])}

    def backward(model, loss):
        collectives.foreach_reduce_scatter_copy_in = copy_ins[model]
        try:
            loss.backward()
        finally:
            collectives.foreach_reduce_scatter_copy_in = ours

    x = torch.randn(8, 32) + rank  # replicas see different data: the all-reduce must add them
    for model in (default, spared):
        backward(model, model(x).square().sum())
    assert calls == [1, 1], f"FSDP2 no longer packs the gradients through foreach_reduce_scatter_copy_in: {calls}"
    for name, seen in allocations.items():
        assert len(seen) == 2 and seen[1] is seen[0], (
            f"FSDP2's one-rank reduction of the {name} no longer allocates its packed input and then its "
            f"output ({len(seen)} allocations): one_rank_reduce_scatter's pairing no longer holds"
        )
    packed = allocations["block"][0].untyped_storage().data_ptr()
    for p in spared[0].parameters():
        assert p.grad.to_local().untyped_storage().data_ptr() == packed, "gradients do not view the packed buffer"
    for model in (default, spared):  # accumulation: the second backward adds into the first's gradients
        backward(model, model(x * 2).square().sum())
    for a, b in zip(default.parameters(), spared.parameters(), strict=True):
        assert torch.equal(a.grad.to_local(), b.grad.to_local())


def test_one_rank_reduce_scatter_spares_fsdp2s_copy_and_keeps_the_bits():
    """Over one rank FSDP2 copies the packed gradients into a second buffer; the comm hands the
    packed buffer back as that buffer, so the copy is a self-copy. The pairing relies on FSDP2's
    allocation order (input, then output), which this checks, as it checks the gradients' bits
    against FSDP2's own comm, with accumulation."""
    spawn(_check_one_rank_reduce_scatter, 1, backend="gloo")
    spawn(_check_one_rank_reduce_scatter, 2, backend="gloo")


def _check_one_rank_comm_call(rank, world):
    """torch 2.9 calls the comm over one rank too: given the output as the input, a sum leaves it
    alone; other calls are real reduce-scatters."""
    import torch.distributed as dist

    comm, group = priv.one_rank_reduce_scatter(), dist.group.WORLD
    x = torch.arange(4.0 * world) + rank
    if world == 1:  # no collective at all: a sum over one rank in place is the identity
        real = dist.reduce_scatter_tensor
        dist.reduce_scatter_tensor = None  # (calling it would raise)
        try:
            assert comm(x, x, group, dist.ReduceOp.SUM) is None and torch.equal(x, torch.arange(4.0))
        finally:
            dist.reduce_scatter_tensor = real
    out = torch.empty(4)
    comm(out, x, group, dist.ReduceOp.SUM)
    expected = sum(torch.arange(4.0 * world) + r for r in range(world)).chunk(world)[rank]
    assert torch.equal(out, expected), (out, expected)


@pytest.mark.parametrize(
    "grad_dtype,reduce_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_one_rank_copy_in_packs_the_bits_fsdp2s_does(grad_dtype, reduce_dtype, device):
    """dtq's copy-in over one rank writes FSDP2's packed buffer bit for bit (gradients of odd
    shapes, a non-contiguous one; casts that round); over two ranks it is FSDP2's. On CUDA,
    FSDP2's is ``_chunk_cat``'s kernel (its fast path for BF16 into FP32 among them)."""
    priv.one_rank_copy_in()
    ours = collectives.foreach_reduce_scatter_copy_in
    fsdp2s = ours._dtq_fsdp2s
    g = torch.Generator().manual_seed(0)
    dense = [
        torch.randn(shape, generator=g).mul(3.0**k).to(device, grad_dtype)
        for k, shape in enumerate([(7, 5), (4,), (6, 2, 3), (1, 9)])
    ]
    strided = torch.randn(3, 8, generator=g).to(device, grad_dtype).t()  # (FSDP2's then takes its general path)
    for grads, world in itertools.product((dense, [*dense, strided]), (1, 2)):
        n = sum(t.numel() for t in grads)
        padded = sum(-(-t.shape[0] // world) * world * math.prod(t.shape[1:]) for t in grads)
        size = (padded if world > 1 else n,)
        want, got = (torch.full(size, float("nan"), dtype=reduce_dtype, device=device) for _ in range(2))
        fsdp2s([t.clone() for t in grads], want, world)
        ours([t.clone() for t in grads], got, world)
        assert torch.equal(
            got.view(torch.int16 if reduce_dtype == torch.bfloat16 else torch.int32),
            want.view(torch.int16 if reduce_dtype == torch.bfloat16 else torch.int32),
        ), (world, len(grads))


def test_install_copy_in_offers_each_packing_to_the_given_function_first():
    """``install_copy_in(pack)``: FSDP2's copy-in asks ``pack`` first, for every world size, and
    where it declines runs what it ran before (torch.cat over one rank, FSDP2's own otherwise);
    installing again without a function keeps it (``one_rank_reduce_scatter`` does so)."""
    asked = []

    def pack(grads, out, world):  # takes two ranks' packing with FSDP2's own function, declines one rank's
        asked.append(world)
        if world == 1:
            return False
        fsdp2s(grads, out, world)
        return True

    before = collectives.foreach_reduce_scatter_copy_in
    fsdp2s = getattr(before, "_dtq_fsdp2s", before)
    try:
        priv.install_copy_in(pack)
        priv.one_rank_copy_in()
        ours = collectives.foreach_reduce_scatter_copy_in
        assert ours._dtq_pack is pack and ours._dtq_fsdp2s is fsdp2s
        grads = [torch.randn(5, 3), torch.randn(4)]
        for world in (1, 2):
            size = sum(-(-t.shape[0] // world) * world * math.prod(t.shape[1:]) for t in grads)
            want, got = torch.full((size,), float("nan")), torch.full((size,), float("nan"))
            fsdp2s(grads, want, world)
            ours(grads, got, world)
            assert torch.equal(got, want), world
        assert asked == [1, 2]
    finally:
        collectives.foreach_reduce_scatter_copy_in = before


def test_one_rank_reduce_scatter_called_by_fsdp2_reduces():
    spawn(_check_one_rank_comm_call, 1, backend="gloo")
    spawn(_check_one_rank_comm_call, 2, backend="gloo")


def test_one_rank_reduce_scatter_pairs_only_a_live_input():
    """A reduction that ended after its input's allocation (an error in FSDP2's copy-in) leaves
    no pairing behind: the next allocation is a fresh input, not the old buffer."""
    import gc

    comm, cpu = priv.one_rank_reduce_scatter(), torch.device("cpu")
    first = comm.allocate((8,), dtype=torch.float32, device=cpu)
    del first  # the failed reduction's input, gone
    gc.collect()
    packed = comm.allocate((8,), dtype=torch.float32, device=cpu)  # a fresh input
    assert comm.allocate((8,), dtype=torch.float32, device=cpu) is packed  # its output
    assert comm.allocate((8,), dtype=torch.float32, device=cpu) is not packed  # the next input


def _race_after_the_reduction(rank, world):
    """FSDP2's work after the reduction (here: accumulating into existing gradients, and the
    cast of BF16-reduced gradients to FP32), slowed down on its stream so that the next unit's
    gradients would reuse the buffer under it if nothing held it."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives

    real = collectives._to_dtype_if_needed

    def slow(tensor, dtype):
        torch.cuda._sleep(200_000_000)  # (on the reduce-scatter stream)
        return real(tensor, dtype)

    collectives._to_dtype_if_needed = slow
    try:
        for policy, backwards in ((None, 2), (MixedPrecisionPolicy(reduce_dtype=torch.bfloat16), 1)):
            grads, paired = [], []
            for spare in (False, True):
                torch.manual_seed(0)
                model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(4))).cuda()
                for layer in [*model, model]:
                    fully_shard(layer, **({"mp_policy": policy} if policy else {}))
                    if spare:
                        paired.append([])
                        layer.set_custom_reduce_scatter(_recording(priv.one_rank_reduce_scatter(), paired[-1]))
                x = torch.randn(256, 1024, device="cuda")
                for k in range(backwards):
                    model(x * (k + 1)).square().sum().backward()
                torch.cuda.synchronize()
                grads.append([p.grad.to_local().clone() for p in model.parameters()])
            for a, b in zip(*grads, strict=True):
                assert torch.equal(a, b), f"policy {policy}, {backwards} backward(s): a gradient differs"
            for seen in paired[:4]:  # the blocks (the root holds no weights that take gradients here)
                pairs = [seen[i + 1] is seen[i] for i in range(0, len(seen), 2)]
                assert len(seen) == 2 * backwards and all(pairs), "the comm did not hand the input back on CUDA"
    finally:
        collectives._to_dtype_if_needed = real


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams: needs a CUDA GPU")
def test_one_rank_reduce_scatter_keeps_the_buffer_for_work_after_the_reduction():
    spawn(_race_after_the_reduction, 1, backend="nccl")


def _check_one_rank_gathers(rank, world):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    shape, names = ((1,), None) if world == 1 else ((world, 1), ("replicate", "shard"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))
    fully_shard(model[0], mesh=mesh, mp_policy=policy, reshard_after_forward=False)  # (one gather each)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    casts, copies = [], []

    def cast(shard, out):
        out.copy_(shard)
        casts.append((out.data_ptr(), out.clone()))  # (FSDP2 frees the output when it reshards)

    assert priv.one_rank_gathers(model[0], cast) + priv.one_rank_gathers(model, cast) == 4
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):  # FSDP2's copy of each gather input into its output
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default:  # (pointers now: FSDP2 frees outputs when it reshards)
                copies.append((args[0].data_ptr(), args[1].dtype, args[0] is args[1]))
            return func(*args, **(kwargs or {}))

    with Copies():  # (forward only: the gathers; after backward frees the outputs their memory is reused)
        y = model(torch.randn(8, 32))
    y.sum().backward()
    # FSDPParamGroup.wait_for_unshard over one rank: each parameter's gather input is read from
    # FSDPParam.all_gather_inputs, then copied into its gather output, which the unsharded
    # parameter views; the one-rank class writes the output itself, so the copy is a self-copy
    assert len(casts) == 4, f"FSDP2's one-rank gather no longer reads FSDPParam.all_gather_inputs ({len(casts)})"
    ptrs = {ptr for ptr, _ in casts}
    into = [(dtype, same) for ptr, dtype, same in copies if ptr in ptrs]
    assert into.count((torch.float32, False)) == 4, into  # cast's own (the mode sees the copies)
    assert into == [(torch.float32, False), (torch.bfloat16, True)] * 4, f"FSDP2's copies into the outputs: {into}"
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))
    outs = sorted((out for _, out in casts), key=lambda t: t.numel())
    for out, p in zip(outs, sorted(ref.parameters(), key=lambda t: t.numel()), strict=True):
        assert torch.equal(out.view(torch.int16), p.detach().reshape(-1).to(torch.bfloat16).view(torch.int16))


def test_one_rank_gathers_write_fsdp2s_gather_output_once():
    """``priv.one_rank_gathers``: FSDP2 (one rank, or HSDP with shard groups of one) takes every
    parameter's gather input from the one-rank class's property, which has written the gather
    output itself; FSDP2's copy into the output is then a self-copy (which ``copy_`` skips)."""
    spawn(_check_one_rank_gathers, 1, backend="gloo")
    spawn(_check_one_rank_gathers, 2, backend="gloo")


def _check_dtensor_layout_and_handlers(rank, world):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    t = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    assert priv.dtensor_layout(t) == (t.device_mesh, t.placements), "DTensor._spec.mesh / .placements moved"
    assert priv.dtensor_layout(torch.zeros(2)) is None
    table = DTensor._op_dispatcher._custom_op_handlers
    assert isinstance(table, dict), "DTensor._op_dispatcher._custom_op_handlers moved"
    op, seen = torch.ops.aten.mul.Tensor, []

    def handler(op_call, args, kwargs):
        seen.append(op_call)
        with priv.without_dtensor_handler(op_call):
            return op_call(*args, **kwargs)

    with priv.dtensor_op_handlers({op: handler}):
        doubled = t * 2
    assert seen == [op], "DTensor's dispatch no longer consults its custom op handlers"
    assert op not in table and torch.equal(doubled.full_tensor(), t.full_tensor() * 2)


def test_dtensor_layout_and_op_handlers_are_where_dtq_reads_them():
    spawn(_check_dtensor_layout_and_handlers, 1, backend="gloo")


def test_dtqs_constant_mark_is_the_one_dynamo_sets():
    """``priv.assume_constant_result`` marks a function as ``torch._dynamo.assume_constant_result``
    does (without importing dynamo), and dynamo then runs it while tracing, not in the graph."""

    def theirs():
        return 3

    def ours():
        return 3

    torch._dynamo.assume_constant_result(theirs)
    priv.assume_constant_result(ours)
    assert theirs.__dict__ == ours.__dict__ == {"_dynamo_marked_constant": True}, (theirs.__dict__, ours.__dict__)
    calls = []

    @priv.assume_constant_result
    def scale():
        calls.append(1)
        return 2.0

    torch._dynamo.reset()
    f = torch.compile(lambda x: x * scale(), backend="eager", fullgraph=True)
    x = torch.ones(3)
    assert torch.equal(f(x), x * 2) and torch.equal(f(x), x * 2)
    assert len(calls) == 1, calls  # (called once, at tracing: its result is a constant of the graph)
    torch._dynamo.reset()
