"""Master-weight casts (dim-0 shards and flat ZeRO slices through blocks), MasterWeightOptimizer,
and the batched amax reductions, with real processes (gloo on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dtq
from dtq.parallel import FlatSlice, quantize_master_weights
from dtq.testing import spawn
from tests._collectives import CountAllReduce, gather_rows

M, K = 256, 384


def _quantizers():
    return [
        dtq.Float8Quantizer(),
        dtq.Float8BlockQuantizer((128, 128)),
        dtq.Float8BlockQuantizer((1, 128)),
        dtq.Float8RowwiseQuantizer(),
        dtq.MXFP8Quantizer(),
        dtq.NVFP4Quantizer((16, 16)),
        dtq.NVFP4Quantizer(),
        dtq.IdentityQuantizer(torch.bfloat16),
        dtq.HybridQuantizer(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer((16, 16))),
        dtq.HybridQuantizer(rowwise=dtq.Float8BlockQuantizer(), columnwise=dtq.IdentityQuantizer()),
    ]


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _check_casts(rank, world):
    g = torch.Generator().manual_seed(0)
    dev = _device()
    masters = [(torch.randn(M, K, generator=g) * (i + 1)).to(dev) for i, _ in enumerate(_quantizers())]
    quantizers = _quantizers()
    full = [q.quantize(m) for q, m in zip(quantizers, masters)]
    rows = M // world

    # dim-0 shards: stale shards, fresh masters, one all-reduce for all parameters
    whole = [i for i, q in enumerate(quantizers) if all(rows % q.block_rows(d) == 0 for d in ("rowwise", "columnwise"))]
    split = [i for i in range(len(quantizers)) if i not in whole]
    for i in split:  # blocks taller than a shard: the docs/design.md §5.4 error, pointing to FlatSlice
        with pytest.raises(ValueError, match="cannot hold whole 128-row"):
            quantize_master_weights([quantizers[i].quantize(torch.zeros(rows, K, device=dev))], [masters[i][:rows]])
    quantizers, full, masters_w = [quantizers[i] for i in whole], [full[i] for i in whole], [masters[i] for i in whole]
    shards = [q.quantize(torch.zeros(rows, K, device=dev)) for q in quantizers]
    with CountAllReduce() as count:
        quantize_master_weights(shards, [m[rank * rows : (rank + 1) * rows] for m in masters_w])
    assert count.calls == 1
    for q, f, s in zip(quantizers, full, shards):
        for d in f.directions:
            for k, v in f.payload(d).items():
                fields = q.codec(d).fields()
                got = gather_rows(s.payload(d)[k], world) if fields[k] is not None else s.payload(d)[k]
                assert torch.equal(_bits(got), _bits(v)), (q, d, k)

    # flat slices that cut through blocks: boundaries at odd multiples of 16 elements
    quantizers = _quantizers()
    full = [q.quantize(m) for q, m in zip(quantizers, masters)]
    bounds = [0] + [(M * K * r // world) // 32 * 32 + 16 for r in range(1, world)] + [M * K]
    start, end = bounds[rank], bounds[rank + 1]
    params = [q.quantize(torch.zeros(M, K, device=dev)) for q in quantizers]
    with CountAllReduce() as count:
        quantize_master_weights(params, [FlatSlice(m.reshape(-1)[start:end], start) for m in masters])
    assert count.calls == 1
    for q, f, p in zip(quantizers, full, params):
        for d in f.directions:
            for k, v in f.payload(d).items():
                got = p.payload(d)[k]
                if k == "data":  # each rank wrote its own elements' codes
                    per = got.numel() // (M * K) if got.numel() >= M * K else 0.5
                    a, b = int(start * per), int(end * per)
                    assert torch.equal(_bits(got).reshape(-1)[a:b], _bits(v).reshape(-1)[a:b]), (q, d)
                else:  # scales: identical on every rank, equal to the full cast's
                    assert torch.equal(_bits(got), _bits(v)), (q, d, k)


def test_master_weight_casts_2_ranks():
    spawn(_check_casts, 2)


def test_master_weight_casts_4_ranks():
    spawn(_check_casts, 4)


def test_flat_slice_errors():
    q = dtq.NVFP4Quantizer(random_hadamard=True)
    t = q.quantize(torch.randn(64, 64))
    with pytest.raises(ValueError, match="transforms its columnwise direction across rows"):
        quantize_master_weights([t], [FlatSlice(torch.zeros(100), 0)])
    t = dtq.NVFP4Quantizer().quantize(torch.randn(64, 64))
    with pytest.raises(ValueError, match="even element index"):
        quantize_master_weights([t], [FlatSlice(torch.zeros(101), 1)])
    with pytest.raises(ValueError, match="outside the 4096 elements"):
        quantize_master_weights([t], [FlatSlice(torch.zeros(100), 4090)])
    with pytest.raises(TypeError, match="is not quantized"):
        quantize_master_weights([torch.zeros(4, 4)], [torch.zeros(4, 4)])


def test_master_weight_optimizer_single_process():
    torch.manual_seed(0)
    model = dtq.convert(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)),
        recipe=dtq.NVFP4BlockScaling(),
        quantized_params=True,
    )
    opt = dtq.optim.MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    x, t = torch.randn(64, 64), torch.randn(64, 64)
    losses = []
    for _ in range(8):
        with dtq.autocast(dtq.NVFP4BlockScaling()):
            loss = torch.nn.functional.mse_loss(model(x), t)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    for p, m in zip(opt.quantized, opt.masters):  # the parameters are the cast of the masters
        ref = p.quantizer.quantize(m.detach())
        for d in ref.directions:
            for k, v in ref.payload(d).items():
                assert torch.equal(_bits(p.payload(d)[k]), _bits(v))
    # state_dict round trip restores masters, optimizer state and the parameters' bits
    import copy

    sd = copy.deepcopy(opt.state_dict())
    before = [p.dequantize().clone() for p in opt.quantized]
    with torch.no_grad():
        for m in opt.masters:
            m.add_(1.0)
    opt.load_state_dict(sd)
    assert all(torch.equal(p.dequantize(), b) for p, b in zip(opt.quantized, before))


def test_master_weight_optimizer_param_groups_and_live_groups_after_load():
    torch.manual_seed(0)
    model = dtq.convert(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)),
        recipe=dtq.MXFP8BlockScaling(),
        quantized_params=True,
    )
    groups = [
        {"params": [model[0].weight, model[0].bias], "weight_decay": 0.0},
        {"params": [model[1].weight, model[1].bias], "lr": 0.5},
    ]
    opt = dtq.optim.MasterWeightOptimizer(groups, torch.optim.AdamW, lr=1.0)
    assert len(opt.masters) == 2  # quantized parameters inside groups get FP32 masters
    assert [g["lr"] for g in opt.param_groups] == [1.0, 0.5] and opt.param_groups[0]["weight_decay"] == 0.0
    assert all(any(m is q for q in g["params"]) for m, g in zip(opt.masters, opt.inner.param_groups))
    opt.load_state_dict(opt.state_dict())
    opt.param_groups[0]["lr"] = 0.25  # what an LR scheduler does after a resume
    assert opt.inner.param_groups[0]["lr"] == 0.25
    import copy
    import pickle

    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):  # the wrapper survives both
        assert [g["lr"] for g in clone.param_groups] == [0.25, 0.5] and len(clone.masters) == 2
    fresh = dtq.optim.MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=1.0)
    fresh.state_dict()  # materializes AdamW's state for dcp.load; the step count stays 0
    assert all(float(st["step"]) == 0 for st in fresh.inner.state.values())
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(o is opt))
    opt.step()  # no gradients: AdamW skips the parameters, the hook still runs
    assert calls == [True]
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.1)
    assert opt.inner.param_groups[1]["lr"] == pytest.approx(0.05) and scheduler.get_last_lr()[1] == pytest.approx(0.05)
