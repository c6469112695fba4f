"""The explicit interface between dtq's FSDP2 gathers (dtq.distributed.gather), the module state
that decides what a gather serves (``module.gemm_state``), and the TP layout the styles set: its
refusals name what is wrong and what would work."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dtq
from dtq.testing import spawn


def _dtq_weight_in_a_plain_module(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    plain = torch.nn.Linear(32, 32, bias=False)
    plain.weight = dtq.nn.Linear(32, 32, bias=False).weight  # a HighPrecisionWeight in a module without gemm_state
    model = torch.nn.Sequential(plain)
    fully_shard(model, mesh=mesh)
    with pytest.raises(
        TypeError,
        match=r"FSDP2 gathers 0\.weight, a dtq weight held by Linear, which is not a dtq "
        r"module .* keep dtq weights in dtq modules",
    ):
        model(torch.randn(4, 32))


def test_gather_of_a_dtq_weight_outside_a_dtq_module_names_the_parameter():
    spawn(_dtq_weight_in_a_plain_module, 1, backend="gloo")


def _two_dim_mesh(rank, world):
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    lin = dtq.nn.Linear(32, 32)
    with pytest.raises(ValueError, match=r"1-D device mesh, got 2 dims; pass the TP sub-mesh \(mesh\['tp'\]\)"):
        lin.gemm_state.set_tensor_parallel({}, mesh)
    lin.gemm_state.set_tensor_parallel({}, mesh["tp"])  # the sub-mesh is what works
    assert lin.gemm_state.tp.mesh == mesh["tp"]


def test_tensor_parallel_layout_takes_a_one_dim_mesh():
    spawn(_two_dim_mesh, 1, backend="gloo")


def test_gather_layout_is_made_once_per_structure():
    """A gather's layout (fields, packing, comm_stats names) is made once per quantizer,
    directions, shape and world size, and a structure differing in any of them gets its own: one
    rank packs MXFP8's two row fields into one input (FSDP2's one-rank shortcut copies only the
    first), two even shards send them apart, three uneven ones pack into the padded shard."""
    from dtq.distributed.gather import _gather_layout

    q = dtq.MXFP8Quantizer()
    shape = torch.Size([64, 64])
    one = _gather_layout(q, (dtq.ROWWISE,), shape, 1, ())
    assert _gather_layout(dtq.MXFP8Quantizer(), (dtq.ROWWISE,), shape, 1, ()) is one  # equal quantizers share it
    assert one.packed and one.layout == (("rowwise", "data"), ("rowwise", "scale"))
    two = _gather_layout(q, (dtq.ROWWISE,), shape, 2, ())
    assert not two.packed and two.shard_shape is None
    three = _gather_layout(q, (dtq.ROWWISE,), shape, 3, ())
    assert three.packed and three.shard_shape == (22, 64) and three.pad_rows == 22
    both = _gather_layout(q, (dtq.ROWWISE, dtq.COLUMNWISE), shape, 2, ())
    assert [d for d, _ in both.format_names] == ["rowwise", "columnwise"] and len(both.layout) == 4
    fp8 = _gather_layout(dtq.Float8Quantizer(), (dtq.ROWWISE, dtq.COLUMNWISE), shape, 2, ())
    assert fp8.aliases == {"columnwise": "rowwise"} and fp8.layout == (("rowwise", "data"),)


def test_a_misaligned_gather_is_refused_every_time():
    """The alignment check remembers only structures that passed: a shard whose rows split a
    128-row block raises on every gather, not only the first."""
    from dtq._torch_private import GatherContext
    from dtq.distributed.gather import _check_alignment

    ctx = GatherContext("FORWARD", True, "layers.0.fc1.weight", "weight", None)
    q = dtq.Float8BlockQuantizer()
    shape = torch.Size([384, 128])  # 192 rows per shard over 2 ranks: not a multiple of 128
    for _ in range(2):
        with pytest.raises(ValueError, match=r"cannot all-gather layers\.0\.fc1\.weight .* 192 rows"):
            _check_alignment(ctx, q, (dtq.COLUMNWISE,), shape, 2)
    _check_alignment(ctx, q, (dtq.COLUMNWISE,), shape, 3)  # 128 rows per shard: fine, and again
    _check_alignment(ctx, q, (dtq.COLUMNWISE,), shape, 3)


def _recipe_switches(rank, world):
    mesh = init_device_mesh("cpu", (world,))

    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(dtq.nn.Linear(64, 64, bias=False), dtq.nn.Linear(64, 64, bias=False))
        for layer in m:
            fully_shard(layer, mesh=mesh)  # (resharded after each forward and backward: gathered every step)
        fully_shard(m, mesh=mesh)
        return m

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    fp8, mx = dtq.Float8CurrentScaling(), dtq.MXFP8BlockScaling()

    def run(m, recipe):
        dtq.parallel.comm_stats(reset=True)
        with dtq.autocast(recipe, enabled=recipe is not None):
            y = m(x)
        y.sum().backward()
        grads = [p.grad.full_tensor() for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        return (y, *grads), {k.split("/")[0] for k in dtq.parallel.comm_stats()}

    fresh = {name: run(model(), r)[0] for name, r in (("fp8", fp8), ("mx", mx))}
    m = model()
    # each gather quantizes with the recipe active now: the per-weight decisions kept between
    # gathers (gather plan, layout, byte counts) follow a switch and come back after it
    for name, recipe, fmt in (("fp8", fp8, "fp8"), ("mx", mx, "mxfp8"), ("fp8", dtq.Float8CurrentScaling(), "fp8")):
        y, formats = run(m, recipe)
        assert formats == {fmt}, (name, formats)
        assert all(torch.equal(a, b) for a, b in zip(y, fresh[name])), name
    _, formats = run(m, None)  # quantization off: gathered in high precision
    assert formats == {"float32"}, formats
    assert run(m, mx)[0][0].equal(fresh["mx"][0])  # and quantized again after


def test_gathers_follow_a_recipe_switched_between_steps():
    spawn(_recipe_switches, 2, backend="gloo")


def _kept_gathers(rank, world, compiled):
    mesh = init_device_mesh("cpu", (world,))

    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(dtq.nn.Linear(64, 64, bias=False), dtq.nn.Linear(64, 64, bias=False))
        for i, layer in enumerate(m):
            if compiled:
                m[i] = layer = torch.compile(layer, backend="aot_eager")
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        fully_shard(m, mesh=mesh)
        return m

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    fp8 = dtq.Float8CurrentScaling()
    with dtq.autocast(fp8):
        fresh = model()(x)
    for first, then in ((None, fp8), (fp8, None)):
        for reshard in (False, True):
            m = model()
            with torch.no_grad(), dtq.autocast(first, enabled=first is not None):
                m(x)  # (an evaluation pass: FSDP2 keeps the weights gathered until a backward)
            if reshard:  # what the message says works
                for layer in m:
                    layer.reshard()
                with dtq.autocast(then, enabled=then is not None):
                    y = m(x)
                if then is fp8:
                    assert torch.equal(y, fresh)
                continue
            # the next forward under another recipe would run the kept weights' format: refused
            with pytest.raises(RuntimeError, match=r"still holds its weights gathered for .*model\.reshard\(\)"):
                with dtq.autocast(then, enabled=then is not None):
                    m(x)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_forward_under_another_recipe_than_kept_gathered_weights_is_refused(compiled):
    """Before this check, FSDP2's reshard_after_forward=False let a forward under FP8 run on the
    high-precision weights an evaluation pass without a recipe had gathered (and the reverse)."""
    spawn(_kept_gathers, 2, compiled, backend="gloo")


def test_a_module_state_pickled_before_the_gather_memo_loads():
    """A pickled module from before GemmState kept gather plans (and the recipe of its kept
    gathers) unpickles with both at their defaults, not missing (the first gather raised
    AttributeError), and a pickle never carries this process's gathers."""
    import pickle

    lin = dtq.nn.Linear(32, 32)
    lin.gemm_state.gathered_for = (dtq.Float8CurrentScaling(),)
    old = {k: v for k, v in lin.gemm_state.__getstate__().items() if k not in ("_gather_plans", "gathered_for")}
    state = type(lin.gemm_state).__new__(type(lin.gemm_state))
    state.__setstate__(old)
    assert state._gather_plans == {} and state.gathered_for is None
    again = pickle.loads(pickle.dumps(lin)).gemm_state
    assert again.gathered_for is None and again._gather_plans == {}
