"""``HybridQuantizer(columnwise_source="rowwise_dequantized")``: the columnwise payload quantized
from the dequantized rowwise one, bitwise, wherever a hybrid goes: a single quantization,
``update_usage``, shards reducing their amaxes (two rounds where both formats take a tensor-wide
amax), master-weight casts (dim-0 shards and flat slices), sequence-parallel and FSDP2 gathers
(which derive the columnwise payload from the gathered rowwise one when that moves fewer bytes),
with real gloo processes. Shards hold values of different magnitudes, so a shard-local amax
would show in the bits."""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dtq
from dtq.codec import columnwise_from_rowwise
from dtq.distributed.amax import reduce_over_shards, sharded_amax
from dtq.parallel import FlatSlice, quantize_master_weights
from dtq.testing import spawn
from tests._collectives import CountAllReduce, gather_rows

M, K = 128, 256
RD = "rowwise_dequantized"


def _rd(rowwise, columnwise) -> dtq.HybridQuantizer:
    return dtq.HybridQuantizer(rowwise=rowwise, columnwise=columnwise, columnwise_source=RD)


def _pairs() -> dict[str, dtq.HybridQuantizer]:
    return {
        "mxfp8->nvfp4": _rd(dtq.MXFP8Quantizer(), dtq.NVFP4Quantizer((1, 16))),  # one amax round
        "fp8->nvfp4": _rd(dtq.Float8Quantizer(), dtq.NVFP4Quantizer((1, 16))),  # two rounds
        "nvfp4->mxfp8": _rd(dtq.NVFP4Quantizer((1, 16)), dtq.MXFP8Quantizer()),  # the rowwise amax only
        "fp8 1x128->fp8 row": _rd(dtq.Float8BlockQuantizer((1, 128)), dtq.Float8RowwiseQuantizer()),  # per column
        "mxfp8->nvfp4 rht": _rd(dtq.MXFP8Quantizer(), dtq.NVFP4Quantizer(random_hadamard=True)),  # max|T y|
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a: dict, b: dict, what) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(_bits(a[k]), _bits(b[k])), (what, k)


def _skewed(rows: int, world: int, seed: int = 0) -> torch.Tensor:
    """Rows in ``world`` bands of different magnitudes (each shard's amax is its own)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=g)
    return x * torch.repeat_interleave(1.7 ** torch.arange(world, dtype=torch.float32), rows // world)[:, None]


# -- one process ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(_pairs()))
def test_columnwise_is_the_columnwise_format_of_the_dequantized_rowwise(name):
    q = _pairs()[name]
    x = _skewed(M, 2).bfloat16()
    row = q.rowwise.quantize(x, columnwise=False)
    col = q.columnwise.quantize(row.dequantize(torch.float32), rowwise=False)  # the definition
    got = q.quantize(x)
    _same(got.payload("rowwise"), row.payload("rowwise"), name)
    _same(got.payload("columnwise"), col.payload("columnwise"), name)
    _same(q.quantize(x, rowwise=False).payload("columnwise"), col.payload("columnwise"), name)
    assert q.quantize(x, rowwise=False).directions == ("columnwise",)
    _same(columnwise_from_rowwise(q, row.payload("rowwise"), (M, K)), col.payload("columnwise"), name)
    # update_usage builds it from the rowwise payload held, no source needed
    _same(
        q.quantize(x, columnwise=False).update_usage(columnwise=True).payload("columnwise"),
        got.payload("columnwise"),
        name,
    )
    # the original source gives other bits (else the option would be pointless)
    orig = dtq.HybridQuantizer(rowwise=q.rowwise, columnwise=q.columnwise)
    assert not torch.equal(orig.quantize(x).payload("columnwise")["data"], got.payload("columnwise")["data"])
    assert q.format_name.endswith(",rowwise_dequantized)") and q.aliases(("rowwise", "columnwise")) == {}


def test_settings_are_validated_and_pickle():
    with pytest.raises(ValueError, match="columnwise_source='bogus'"):
        dtq.HybridQuantizer(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer(), columnwise_source="bogus")
    with pytest.raises(ValueError, match="rounds stochastically"):
        _rd(dtq.MXFP8Quantizer(), dtq.NVFP4Quantizer(stochastic_rounding=True))
    with pytest.raises(ValueError, match="weight_columnwise_source='x'"):
        dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling(), weight_columnwise_source="x")
    q = _rd(dtq.MXFP8Quantizer(), dtq.NVFP4Quantizer())
    assert pickle.loads(pickle.dumps(q)) == q
    old = dtq.HybridQuantizer(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer())
    state = {k: v for k, v in old.__getstate__().items() if k != "columnwise_source"}  # pickled before the option
    back = dtq.HybridQuantizer.__new__(dtq.HybridQuantizer)
    back.__setstate__(state)
    assert back == old and back.columnwise_source == "original"


def test_hybrid_recipe_uses_it_for_weights_only_and_gradients_refuse_it():
    recipe = dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling(), weight_columnwise_source=RD)
    role = dtq.QuantizerRole("linear", "weight", "layers.0.fc1")
    assert recipe.quantizer(role).columnwise_source == RD
    assert recipe.quantizer(dtq.QuantizerRole("linear", "input", "layers.0.fc1")).columnwise_source == "original"
    assert not isinstance(
        recipe.quantizer(dtq.QuantizerRole("linear", "grad_output", "layers.0.fc1")), dtq.HybridQuantizer
    )

    def factory(role):
        return _rd(dtq.MXFP8Quantizer(), dtq.NVFP4Quantizer())

    with pytest.raises(ValueError, match=r"grad_output.*layers\.0\.fc1.*weights \(and inputs\) only"):
        dtq.CustomRecipe(factory).quantizer(dtq.QuantizerRole("linear", "grad_output", "layers.0.fc1"))


def test_a_linear_trains_under_it_with_quantized_parameters():
    """fprop, dgrad and wgrad run on such payloads; the stored weight holds both directions, the
    columnwise one derived from the rowwise one."""
    torch.manual_seed(0)
    lin = dtq.nn.Linear(K, M, name="out")
    recipe = dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling(), weight_columnwise_source=RD)
    dtq.convert(lin, recipe=recipe, quantized_params=True)
    w = lin.weight
    assert w.quantizer.columnwise_source == RD
    _same(columnwise_from_rowwise(w.quantizer, w.payload("rowwise"), (M, K)), w.payload("columnwise"), "stored")
    x = torch.randn(32, K, requires_grad=True)
    with dtq.autocast(recipe):
        lin(x).square().mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and lin.weight.grad is not None


# -- shards, master casts and sequence-parallel gathers ---------------------------------------------


def _check_shards(rank, world):
    whole = _skewed(M * world // 2, world)
    rows = whole.shape[0] // world
    local = whole[rank * rows : (rank + 1) * rows]
    group = dist.group.WORLD
    for name, q in _pairs().items():
        for rowwise in (True, False):
            ref = q.quantize(whole, rowwise=rowwise)
            with CountAllReduce() as count:
                amax = sharded_amax(q, local, lambda a: reduce_over_shards(a, group), rowwise=rowwise)
            assert count.calls == (2 if q.deferred_amax() else 1), (name, count.calls)
            got = q.quantize(local, rowwise=rowwise, amax=amax)
            for d in ref.directions:
                for k, v in ref.payload(d).items():
                    g = got.payload(d)[k]
                    rowful = q.codec(d).fields()[k] is not None
                    assert torch.equal(_bits(gather_rows(g, world) if rowful else g), _bits(v)), (name, rowwise, d, k)

    # master-weight casts: dim-0 shards (one all-reduce, a second for two-round hybrids) and flat slices
    quantizers = list(_pairs().values())
    full = [q.quantize(whole) for q in quantizers]
    shards = [q.quantize(torch.zeros(rows, K)) for q in quantizers]
    with CountAllReduce() as count:
        quantize_master_weights(shards, [local] * len(quantizers))
    assert count.calls == 2
    for q, f, s in zip(quantizers, full, shards):
        for d in f.directions:
            for k, v in f.payload(d).items():
                got = gather_rows(s.payload(d)[k], world) if q.codec(d).fields()[k] is not None else s.payload(d)[k]
                assert torch.equal(_bits(got), _bits(v)), (q, d, k)
    flat_ok = [q for q in quantizers if q.codec("columnwise").amax_space() == "x"]
    n = whole.numel()
    bounds = [0] + [(n * r // world) // 32 * 32 + 16 for r in range(1, world)] + [n]  # cut through blocks
    start, end = bounds[rank], bounds[rank + 1]
    params = [q.quantize(torch.zeros_like(whole)) for q in flat_ok]
    quantize_master_weights(params, [FlatSlice(whole.reshape(-1)[start:end], start)] * len(flat_ok))
    for q, p in zip(flat_ok, params):
        f = q.quantize(whole)
        for d in f.directions:
            for k, v in f.payload(d).items():
                got = p.payload(d)[k]
                if k == "data":
                    per = got.numel() / n
                    a, b = int(start * per), int(end * per)
                    assert torch.equal(_bits(got)[a:b], _bits(v)[a:b]), (q, d)
                else:
                    assert torch.equal(_bits(got), _bits(v)), (q, d, k)
    hadamard = next(q for q in quantizers if q.codec("columnwise").amax_space() != "x")
    with pytest.raises(ValueError, match="flat slice cannot be cast piecewise"):
        quantize_master_weights([hadamard.quantize(torch.zeros_like(whole))], [FlatSlice(local.reshape(-1), 0)])

    # sequence-parallel gathers: the rowwise payload moves, the columnwise one is derived
    x = _skewed(64 * world, world, seed=1).bfloat16()
    xl = x[rank * 64 : (rank + 1) * 64]
    for name, q in _pairs().items():
        dtq.parallel.comm_stats(reset=True)
        got = dtq.parallel.gather_along_first_dim(xl, quantizer=q, rowwise=True, columnwise=True)
        stats = dtq.parallel.comm_stats(reset=True)
        ref = q.quantize(x)
        for d in ref.directions:
            _same(got.payload(d), ref.payload(d), (name, d))
        fmt = q.columnwise.format_name
        assert stats.get(f"{fmt}/columnwise_derived", 0) > 0 and f"{fmt}/columnwise" not in stats, (name, stats)
    # columnwise only: by bytes, NVFP4 columnwise (0.56 B/element) moves rather than FP8 rowwise (1)
    q = _pairs()["fp8->nvfp4"]
    dtq.parallel.comm_stats(reset=True)
    got = dtq.parallel.gather_along_first_dim(xl, quantizer=q, rowwise=False, columnwise=True)
    stats = dtq.parallel.comm_stats(reset=True)
    _same(got.payload("columnwise"), q.quantize(x, rowwise=False).payload("columnwise"), "fp8->nvfp4 columnwise")
    assert set(stats) == {"nvfp4/columnwise"}, stats


def test_shards_master_casts_and_sequence_parallel_2_ranks():
    spawn(_check_shards, 2, backend="gloo")


# -- FSDP2 ----------------------------------------------------------------------------------------


def _factory_fp8_nvfp4(role):  # both formats take a tensor-wide amax: two rounds; NVFP4 columnwise moves
    if role.tensor_type == "weight":
        return _rd(dtq.Float8Quantizer(), dtq.NVFP4Quantizer((1, 16)))
    return dtq.MXFP8Quantizer()


def _factory_nvfp4_mxfp8(role):  # NVFP4 rowwise is smaller than MXFP8 columnwise: always derived
    if role.tensor_type == "weight":
        return _rd(dtq.NVFP4Quantizer((1, 16)), dtq.MXFP8Quantizer())
    return dtq.MXFP8Quantizer()


def _model(recipe, quantized_params: bool, world: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        dtq.nn.Linear(K, K, bias=False, name="0"), torch.nn.GELU(), dtq.nn.Linear(K, K, name="2")
    )
    with torch.no_grad():
        for i in (0, 2):
            model[i].weight.mul_(_skewed(K, world, seed=i).abs().add(0.5))  # shards of different magnitudes
    if quantized_params:
        dtq.convert(model, recipe=recipe, quantized_params=True)
    return model


def _train(model, recipe, quantized_params: bool):
    opt_cls = torch.optim.AdamW
    opt = (
        dtq.optim.MasterWeightOptimizer(model.parameters(), opt_cls, lr=1e-2)
        if quantized_params
        else opt_cls(model.parameters(), lr=1e-2)
    )
    g = torch.Generator().manual_seed(3)
    losses = []
    for step in range(3):
        x = torch.randn(32, K, generator=g) * (1 + step)
        with dtq.autocast(recipe):
            loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _local(p: torch.Tensor) -> torch.Tensor:
    p = p._local_tensor if hasattr(p, "_local_tensor") else p
    return p.__dtq_unwrap__() if hasattr(p, "__dtq_unwrap__") else p


def _check_fsdp(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    for factory, qp, raf in itertools.product((_factory_fp8_nvfp4, _factory_nvfp4_mxfp8), (False, True), (True, False)):
        recipe = dtq.CustomRecipe(factory)
        config = (factory.__name__, qp, raf)
        ref = _model(recipe, qp, world)
        ref_losses = _train(ref, recipe, qp)
        model = _model(recipe, qp, world)
        for i in (0, 2):
            fully_shard(model[i], mesh=mesh, reshard_after_forward=raf)
        fully_shard(model, mesh=mesh, reshard_after_forward=raf)
        dtq.parallel.comm_stats(reset=True)
        losses = _train(model, recipe, qp)
        stats = dtq.parallel.comm_stats(reset=True)
        assert torch.equal(_bits(losses), _bits(ref_losses)), (config, losses.tolist(), ref_losses.tolist())
        for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
            got, want = _local(p), _local(r)
            if isinstance(got, dtq.QuantizedTensor):  # the whole reference's payload rows of this shard
                for d in got.directions:
                    for k, v in got.payload(d).items():
                        ref_v = want.payload(d)[k]
                        full = gather_rows(v, world) if got.quantizer.codec(d).fields()[k] is not None else v
                        assert torch.equal(_bits(full), _bits(ref_v)), (config, name, d, k)
            else:
                n = got.shape[0]  # this rank's rows of the reference
                assert torch.equal(_bits(got), _bits(want[rank * n : (rank + 1) * n])), (config, name)
        # what moved: a forward gather of both directions (reshard_after_forward=False) or a cheaper
        # rowwise payload derives the columnwise one; else the NVFP4 columnwise payload moves
        derived = "nvfp4/columnwise_derived" if factory is _factory_fp8_nvfp4 else "mxfp8/columnwise_derived"
        moves_columnwise = factory is _factory_fp8_nvfp4 and raf
        assert (derived in stats) != moves_columnwise, (config, stats)
        assert ("nvfp4/columnwise" in stats) == moves_columnwise, (config, stats)
        assert "mxfp8/columnwise" not in stats, (config, stats)


def test_fsdp2_equals_single_process_2_ranks():
    spawn(_check_fsdp, 2, backend="gloo")
