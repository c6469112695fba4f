"""Tensor and sequence parallelism of dtq modules through parallelize_module, alone and with FSDP2
on a 2-D mesh, and DCP of such models (gloo on CPU; NCCL when every rank has a GPU).

Tolerances. With a deterministic recipe (MXFP8 everywhere) a TP run computes the same quantized
operands as one process; only fp32 summation order differs (the partial GEMM sums of the row
GEMMs), so outputs and gradients agree to 1e-5. The MXFP8/NVFP4 hybrid rounds gradients
stochastically: a TP run draws other random bits than one process (each rank rounds its own
sequence shard), so its gradients are compared by their error against the unquantized gradients,
which must be as small as the single process's (within 1.5x, plus 1% for small tensors).
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

import dtq
from dtq.testing import spawn

H, HEADS, FFN, S, B = 128, 4, 256, 64, 2  # sequence-first activations [S, B, H]


class Block(torch.nn.Module):
    """A pre-norm transformer block from dtq modules: fused RMSNorm+QKV, causal attention, output
    projection, fused RMSNorm+SwiGLU MLP. QKV rows are head-major, so a row shard holds whole heads."""

    def __init__(self):
        super().__init__()
        self.qkv = dtq.nn.LayerNormLinear(H, 3 * H, bias=False, normalization="RMSNorm", name="qkv")
        self.proj = dtq.nn.Linear(H, H, name="proj")
        self.mlp = dtq.nn.LayerNormMLP(
            H, FFN, normalization="RMSNorm", activation="swiglu", swiglu_interleave=32, name="mlp"
        )

    def forward(self, x):
        qkv = self.qkv(x)
        s, b, n = qkv.shape
        d = H // HEADS
        q, k, v = qkv.view(s, b, n // (3 * d), 3, d).permute(3, 1, 2, 0, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, -1)
        x = x + self.proj(o)
        return x + self.mlp(x)


def _plan(sp: bool) -> dict:
    return {
        "qkv": dtq.parallel.ColwiseParallel(sequence_parallel=sp),
        "proj": dtq.parallel.RowwiseParallel(sequence_parallel=sp),
        "mlp": dtq.parallel.LayerNormMLPParallel(sequence_parallel=sp),
    }


def _hybrid():
    return dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling())


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (1-byte payloads travel as uint8: gloo has no float8)."""
    if not isinstance(t, DTensor):
        return t.detach()
    local = t._local_tensor
    local = local.__dtq_unwrap__() if hasattr(local, "__dtq_unwrap__") else local
    if local.element_size() == 1:
        local = local.view(torch.uint8)
    return DTensor.from_local(
        local.detach(), t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    ).full_tensor()


def _gather_seq(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


def _run(model, x, recipe, sp: bool, world: int):
    """Forward + backward of the mean-square loss of the whole output; returns (y, dx) whole."""
    x = x.clone().requires_grad_()
    with dtq.autocast(recipe, enabled=recipe is not None):
        y = model(x)
    scale = world if sp else 1  # each rank holds 1/world of the output rows
    (y.float().square().mean() / scale).backward()
    return (_gather_seq(y), _gather_seq(x.grad)) if sp else (y, x.grad)


def _tp_vs_single(rank, world, sp):
    dev = _device()
    torch.manual_seed(0)
    ref = Block().to(dev)
    tp_model = copy.deepcopy(ref)
    parallelize_module(tp_model, init_device_mesh(dev.type, (world,)), _plan(sp))
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1)).to(dev)
    x_local = x.chunk(world)[rank] if sp else x
    hp_grads = None
    for name, recipe in (("bf16", None), ("mxfp8", dtq.MXFP8BlockScaling()), ("hybrid", _hybrid())):
        y_ref, dx_ref = _run(ref, x, recipe, False, 1)
        dtq.parallel.comm_stats(reset=True)
        y, dx = _run(tp_model, x_local, recipe, sp, world)
        stats = dtq.parallel.comm_stats(reset=True)
        grads = {
            n: (_full(p.grad), pr.grad) for (n, p), (_, pr) in zip(tp_model.named_parameters(), ref.named_parameters())
        }
        assert _rel(y, y_ref) < 1e-5, (name, _rel(y, y_ref))
        if recipe is None:
            hp_grads = {n: g_ref.clone() for n, (_, g_ref) in grads.items()}
            hp_grads["x"] = dx_ref.clone()
        if name == "hybrid":
            grads["x"] = (dx, dx_ref)
            for n, (g, g_ref) in grads.items():
                err_tp, err_single = _rel(g, hp_grads[n]), _rel(g_ref, hp_grads[n])
                assert err_tp <= 1.5 * err_single + 1e-2, (n, err_tp, err_single)
        else:
            assert _rel(dx, dx_ref) < 1e-5, (name, _rel(dx, dx_ref))
            for n, (g, g_ref) in grads.items():
                assert _rel(g, g_ref) < 1e-5, (name, n, _rel(g, g_ref))
        if sp and name == "hybrid":
            # Quantized gathers only: the inputs of qkv and fc1 (MXFP8 rowwise for fprop, NVFP4
            # 1x16-along-M columnwise for wgrad) and the gradients of proj and fc2 (NVFP4 both ways).
            # MXFP8: 1 code byte + 1/32 scale byte per element; NVFP4: 1/2 + 1/16.
            n = S * B * H
            assert stats == {
                "mxfp8/rowwise": 2 * n * 33 // 32,
                "nvfp4/columnwise": 4 * n * 9 // 16,
                "nvfp4/rowwise": 2 * n * 9 // 16,
            }, stats
        if sp and name == "bf16":
            assert set(stats) == {"float32/fallback"}  # no recipe: high-precision gathers, counted and warned
        for p in list(ref.parameters()) + list(tp_model.parameters()):
            p.grad = None
    if sp:  # recompute replays the gathers, their scales and the stochastic rounding exactly
        recipe = _hybrid()
        torch.manual_seed(5)
        y1, dx1 = _run(tp_model, x_local, recipe, sp, world)
        g1 = [p.grad.to_local().clone() for p in tp_model.parameters()]
        tp_model.zero_grad()
        torch.manual_seed(5)
        x_ck = x_local.clone().requires_grad_()
        with dtq.autocast(recipe):
            y2 = torch.utils.checkpoint.checkpoint(tp_model, x_ck, use_reentrant=False)
        (y2.float().square().mean() / world).backward()
        assert torch.equal(_gather_seq(y2), y1) and torch.equal(_gather_seq(x_ck.grad), dx1)
        for a, p in zip(g1, tp_model.parameters()):
            assert torch.equal(a, p.grad.to_local())


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_block_matches_single_process(sp):
    spawn(_tp_vs_single, 2, sp)


def _batch_first(rank, world):
    """``sequence_dim=1``: batch-first activations [B, S, H] split along S run the GEMMs of the
    sequence-first layout (the sequence moved to the front around each module), so a colwise ->
    rowwise pair passing DTensors gives the same bits as on [S, B, H], with quantized gathers only."""
    dev = _device()
    mesh = init_device_mesh(dev.type, (world,))
    out = dict(sequence_parallel=True, use_local_output=False)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1)).to(dev).chunk(world)[rank]
    results = {}
    for dim in (0, 1):
        torch.manual_seed(0)
        pair = torch.nn.Sequential(dtq.nn.Linear(H, FFN, name="up"), dtq.nn.Linear(FFN, H, name="down")).to(dev)
        styles = {"0": dtq.parallel.ColwiseParallel, "1": dtq.parallel.RowwiseParallel}
        parallelize_module(pair, mesh, {n: style(sequence_dim=dim, **out) for n, style in styles.items()})
        xd = x.movedim(0, dim).detach().requires_grad_()  # this rank's sequence rows, in either layout
        dtq.parallel.comm_stats(reset=True)
        with dtq.autocast(dtq.MXFP8BlockScaling()):
            y = pair(DTensor.from_local(xd, mesh, [Shard(dim)], run_check=False))
        assert y.placements == (Shard(dim),) and y.to_local().shape == xd.shape
        y.to_local().square().sum().backward()
        stats = dtq.parallel.comm_stats(reset=True)
        assert set(stats) == {"mxfp8/rowwise", "mxfp8/columnwise"}, stats  # the input and the gradient
        results[dim] = (
            y.to_local().movedim(dim, 0),
            xd.grad.movedim(dim, 0),
            [q.grad.to_local() for q in pair.parameters()],
        )
    (y0, dx0, g0), (y1, dx1, g1) = results[0], results[1]
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    with pytest.raises(
        ValueError,
        match=r"RowwiseParallel\(sequence_dim=1\): the input of Linear 'down' has shape \[8, 128\], whose dim 1 is its "
        "feature dim",
    ):
        pair[1](torch.randn(8, FFN // world, device=dev))


def test_sequence_parallel_batch_first():
    spawn(_batch_first, 2)


def _build_2d(mesh, quantized_params: bool, recipe, seed: int = 0):
    torch.manual_seed(seed)
    model = Block().to(_device())
    parallelize_module(model, mesh["tp"], _plan(True))
    if quantized_params:
        dtq.convert(model, recipe=recipe, quantized_params=True)
    for sub in (model.qkv, model.mlp):  # resharded after forward: backward gathers refill the TP locals
        fully_shard(sub, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _fsdp_tp_train_and_save(rank, world, path):
    dev = _device()
    recipe = _hybrid()
    mesh = init_device_mesh(dev.type, (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    torch.manual_seed(0)
    ref = Block().to(dev)
    model = _build_2d(mesh, False, recipe)
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.2), torch.optim.SGD(ref.parameters(), lr=0.2)
    for step in range(3):
        x = torch.randn(S, 2 * B, H, generator=torch.Generator().manual_seed(10 + step)).to(dev)
        with dtq.autocast(recipe):
            ref(x).float().square().mean().backward()
        opt_ref.step()
        opt_ref.zero_grad()
        x_local = x[:, dp * B : (dp + 1) * B].chunk(2)[tp_rank]  # this dp rank's batch, this tp rank's sequence
        with dtq.autocast(recipe):
            y = model(x_local)
        (y.float().square().mean() / 2).backward()  # FSDP2 averages over dp; 1/2: sequence split over tp
        opt.step()
        opt.zero_grad()
    # The updates ran on gradients with other stochastic rounding draws and, per data-parallel
    # rank, other MXFP8/NVFP4 column blocks of the activations: parameters agree to 1%.
    for (n, p), (_, pr) in zip(model.named_parameters(), ref.named_parameters()):
        assert _rel(_full(p), pr.detach()) < 1e-2, (n, _rel(_full(p), pr.detach()))

    for quantized in (False, True):
        m = _build_2d(mesh, quantized, recipe, seed=1)
        with dtq.autocast(recipe):
            m(x_local).float().square().mean().backward()
        state = m.state_dict()
        dcp.save(state, checkpoint_id=f"{path}/{quantized}")
        whole = {k: _full(v).cpu() for k, v in state.items() if isinstance(v, torch.Tensor)}
        if rank == 0:
            torch.save(whole, f"{path}/{quantized}.whole.pt")
        if quantized:
            assert any("._payload.columnwise." in k for k in whole)
            # Master-weight casts reduce tensor-wide amaxes over both mesh dims: after a step every
            # rank holds the same per-tensor fields (amax, scale_inv), so gathered shards agree.
            opt = dtq.optim.MasterWeightOptimizer(m.parameters(), torch.optim.SGD, lr=1e-3)
            with dtq.autocast(recipe):
                m(x_local).float().square().mean().backward()
            opt.step()
            for p in opt.quantized:
                local = p._local_tensor
                for d in local.directions:
                    for k, v in local.payload(d).items():
                        if v.dim() == 0:  # a per-tensor field
                            seen = [torch.empty_like(v) for _ in range(world)]
                            dist.all_gather(seen, v.contiguous())
                            assert all(torch.equal(t, seen[0]) for t in seen), (d, k, seen)


def _load_resharded(rank, world, path):
    recipe = _hybrid()
    dev = _device()
    for shape in ((1, 2), (2, 1)):
        mesh = init_device_mesh(dev.type, shape, mesh_dim_names=("dp", "tp"))
        for quantized in (False, True):
            m = _build_2d(mesh, quantized, recipe, seed=2)
            with dtq.autocast(recipe):  # a data-parallel size of 1 trains too (FSDP2's one-rank gathers)
                m(torch.randn(S // shape[1], B, H, device=dev)).float().square().mean().backward()
            m.zero_grad()
            state = m.state_dict()
            dcp.load(state, checkpoint_id=f"{path}/{quantized}")
            m.load_state_dict(state)
            want = torch.load(f"{path}/{quantized}.whole.pt")
            got = {k: _full(v).cpu() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}
            assert got.keys() == want.keys()
            for k in want:
                assert torch.equal(got[k], want[k]), (shape, quantized, k)


def test_fsdp2_x_tp_2x2_trains_and_checkpoints_reshard(tmp_path):
    spawn(_fsdp_tp_train_and_save, 4, str(tmp_path))
    spawn(_load_resharded, 2, str(tmp_path))


def _errors(rank, world):
    dev = _device()
    mesh = init_device_mesh(dev.type, (world,))
    with pytest.raises(TypeError, match="ColwiseParallel applies to dtq.nn.Linear, dtq.nn.LayerNormLinear, not Linear"):
        parallelize_module(torch.nn.Linear(8, 8), mesh, dtq.parallel.ColwiseParallel())

    class OwnForward(dtq.nn.Linear):  # a subclass may run other GEMMs than the style splits
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(TypeError, match="RowwiseParallel applies to dtq.nn.Linear, not OwnForward"):
        parallelize_module(OwnForward(8, 8), mesh, dtq.parallel.RowwiseParallel())
    if dev.type == "cuda":
        with pytest.raises(ValueError, match="weight is on cpu but the TP mesh is on cuda; move the module"):
            parallelize_module(dtq.nn.Linear(64, 64), mesh, dtq.parallel.ColwiseParallel())
    torch.set_default_device(dev)
    mlp = dtq.nn.LayerNormMLP(64, 96, activation="swiglu", name="mlp")
    with pytest.raises(
        ValueError, match="'mlp' uses SwiGLU with swiglu_interleave=None.*B dividing ffn_hidden_size / 2 = 48"
    ):
        parallelize_module(mlp, mesh, dtq.parallel.LayerNormMLPParallel())
    with pytest.raises(ValueError, match=r"weight of shape \[9, 64\] cannot be split evenly along dim 0 over 2"):
        parallelize_module(dtq.nn.Linear(64, 9), mesh, dtq.parallel.ColwiseParallel())
    qlin = dtq.convert(dtq.nn.Linear(64, 64), recipe=dtq.MXFP8BlockScaling(), quantized_params=True)
    with pytest.raises(TypeError, match="apply the TP styles to high-precision weights and quantize afterwards"):
        parallelize_module(qlin, mesh, dtq.parallel.RowwiseParallel())
    with pytest.raises(ValueError, match=r"shape \[3, 4\] cannot be split evenly along dim 0 over 2 ranks"):
        dtq.parallel.tp.SplitToSP.apply(torch.randn(3, 4), mesh.get_group())
    row = parallelize_module(dtq.nn.Linear(64, 48, name="proj"), mesh, dtq.parallel.RowwiseParallel())
    with pytest.raises(
        ValueError,
        match=r"proj.weight \(shape \[48, 64\]\) is sharded along its last dim.*"
        r"Float8RowwiseQuantizer \(rowwise\) has one scale per whole row",
    ):
        dtq.convert(row, recipe=dtq.Float8RowwiseScaling(), quantized_params=True)
    # column-parallel shards hold whole rows: each is the slice of the whole weight's payloads
    # (the columnwise [1, K] amaxes reduced over the TP group)
    col = parallelize_module(dtq.nn.Linear(64, 48, name="qkv"), mesh, dtq.parallel.ColwiseParallel())
    ref = dtq.Float8RowwiseQuantizer().quantize(_full(col.weight))[rank * 24 : (rank + 1) * 24]
    dtq.convert(col, recipe=dtq.Float8RowwiseScaling(), quantized_params=True)
    for d in ref.directions:
        for k, v in ref.payload(d).items():
            assert torch.equal(col.weight._local_tensor.payload(d)[k].view(torch.uint8), v.view(torch.uint8)), (d, k)
    lin = parallelize_module(dtq.nn.Linear(64, 64), mesh, dtq.parallel.RowwiseParallel())
    with pytest.raises(ValueError, match=r"expects 32 input features \(this rank's tensor-parallel shard\)"):
        lin(torch.randn(4, 64))
    torch.set_default_device(None)


def test_tensor_parallel_errors():
    spawn(_errors, 2)
