"""dtq.integrations.torchtitan against the installed torchtitan (0.3), on CPU with 2 gloo ranks.

torchtitan's model zoo (``torchtitan.models``) imports triton, which CPU builds of torch do not
ship, so these tests build a tiny model from torchtitan's protocol classes (``Module``,
``BaseModel``, ``ModuleList``, ``ModelConfigConverter``, ``OptimizersContainer``, ``ParallelDims``)
the way its trainer does: a config tree, converted, built on the meta device, FSDP2-sharded,
materialized, initialized by ``init_weights``, trained by its optimizer container.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dtq
from dtq.autocast import autocast_active
from dtq.testing import spawn

H = 64


def _data(n=32, out=H):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, H, generator=g), torch.randn(n, out, generator=g)


def _titan_model_config():
    """A torchtitan-protocol config tree: two residual blocks and an output projection (100
    outputs: no MX blocks fit), each Linear config carrying torchtitan's per-parameter init."""
    from torchtitan.protocols.model import BaseModel
    from torchtitan.protocols.module import Module, ModuleList

    class TitanLinear(torch.nn.Linear, Module):  # torchtitan.models.common.linear.Linear's protocol
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            in_features: int
            out_features: int
            bias: bool = False

        def __init__(self, config):
            super().__init__(config.in_features, config.out_features, bias=config.bias)

    class Block(Module):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            w1: TitanLinear.Config
            w2: TitanLinear.Config

        def __init__(self, config):
            super().__init__()
            self.w1, self.w2 = config.w1.build(), config.w2.build()

        def forward(self, x):
            return x + self.w2(F.relu(self.w1(x)))

    class Tiny(BaseModel):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseModel.Config):
            layers: list
            output: TitanLinear.Config

            def update_from_config(self, *, config, **kwargs):
                pass

            def get_nparams_and_flops(self, model, seq_len):
                return 0, 0

        def __init__(self, config):
            super().__init__()
            self.layers = ModuleList([c.build() for c in config.layers])
            self.output = config.output.build()

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.output(x)

    def linear(i, o):
        return TitanLinear.Config(
            in_features=i, out_features=o, param_init={"weight": lambda p: torch.nn.init.trunc_normal_(p, std=0.05)}
        )

    return Tiny.Config(
        layers=[Block.Config(w1=linear(H, 2 * H), w2=linear(2 * H, H)) for _ in range(2)], output=linear(H, 100)
    )


def _train_titan(rank, world, recipe):
    """Build, shard, initialize and train the tiny model as torchtitan's trainer does; returns it
    and its losses (each rank trains on its own half of the batch)."""
    from torchtitan.components.optimizer.optimizer import default_adamw

    from dtq.integrations.torchtitan import DtqConverter, DtqLinear, post_optimizer_build_fn

    config = DtqConverter.Config(recipe=recipe, filter_fqns=["layers.1.w2"]).build().convert(_titan_model_config())
    with torch.device("meta"):
        model = config.build()
    model.verify_module_protocol()
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {
        "layers.0.w1": "DtqLinear",
        "layers.0.w2": "DtqLinear",
        "layers.1.w1": "DtqLinear",
        "layers.1.w2": "TitanLinear",
        "output": "DtqLinear",
    }, kinds  # per-tensor FP8 takes [100, 64]
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    w = model.layers[0].w1.weight
    assert isinstance(model.layers[0].w1, DtqLinear) and w.full_tensor().std() < 0.06  # param_init, not kaiming
    opt_config = default_adamw(lr=1e-2)
    opt_config.implementation = "for-loop"
    optimizers = opt_config.build(model_parts=[model])
    post_optimizer_build_fn(optimizers, [model], None)
    seen = []
    model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(autocast_active()))
    x, y = _data(n=64, out=100)
    x, y = x[rank::world], y[rank::world]
    losses = []
    for _ in range(3):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        losses.append(loss.item())
        local = w._local_tensor  # the hook reduced the new weights' amaxes (per-tensor FP8 needs them)
        key = local._amax_cache[0]  # (wrapper version, data version, quantizer, dtype): dtq.distributed.gather.amax_key
        assert key[:2] == (local._version, dtq.weights.unwrap(local)._version)
    assert seen == [True] * 3 and losses[2] < losses[0], (seen, losses)
    return model


def _check_titan(rank, world):
    dtq.parallel.comm_stats(reset=True)
    _train_titan(rank, world, "fp8")
    stats = dtq.parallel.comm_stats()
    assert stats.get("fp8/rowwise", 0) > 0 and stats.get("fp8/columnwise", 0) > 0, stats
    # delayed scaling: the forward's dtq.autocast reduces the amaxes over the data-parallel ranks,
    # so ranks that saw different tokens keep identical histories (and they start at zero)
    model = _train_titan(rank, world, "fp8-delayed")
    hist = torch.cat([b.flatten() for n, b in model.named_buffers() if "amax_history_" in n])
    assert hist.numel() and hist.abs().sum() > 0
    both = [torch.empty_like(hist) for _ in range(world)]
    torch.distributed.all_gather(both, hist)
    assert torch.equal(both[0], both[1])


def test_torchtitan_converter_trains_under_fsdp2():
    pytest.importorskip("torchtitan.protocols.model", reason="torchtitan is not installed")
    spawn(_check_titan, 2, backend="gloo")


def test_torchtitan_sharding_of_a_dtq_layer_is_refused():
    pytest.importorskip("torchtitan.protocols.model", reason="torchtitan is not installed")
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.protocols.sharding import ShardingConfig

    from dtq.integrations.torchtitan import DtqLinear

    layer = DtqLinear.Config(
        in_features=H, out_features=H, name="layers.0.wq", sharding_config=ShardingConfig(state_shardings={})
    ).build()
    dims = dict(dp_replicate=1, dp_shard=1, cp=1, pp=1, ep=1)
    with pytest.raises(NotImplementedError, match=r"layers\.0\.wq would be sharded .*spmd_backend='spmd_types'"):
        layer.parallelize(ParallelDims(tp=1, world_size=1, spmd_backend="spmd_types", **dims))
    with pytest.raises(NotImplementedError, match=r"\(tensor_parallel_degree=2\).*filter_fqns"):
        layer.parallelize(ParallelDims(tp=2, world_size=2, spmd_backend="partial_dtensor", **dims))
    assert not hasattr(layer.weight, "device_mesh")  # nothing was sharded


def test_torchtitan_converter_reports_and_strict(caplog):
    pytest.importorskip("torchtitan.protocols.model", reason="torchtitan is not installed")
    from dtq.integrations.torchtitan import DtqConverter

    with caplog.at_level(logging.INFO, logger="dtq"):
        config = DtqConverter.Config(recipe="mxfp8", fsdp_world=1).build().convert(_titan_model_config())
    assert type(config.output).__name__ == "Config" and config.output._owner.__name__ == "TitanLinear"
    assert config.layers[0].w1.name == "layers.0.w1" and config.layers[0].w1.recipe == "mxfp8"
    assert "kept output: MXFP8BlockScaling cannot quantize its weight [100, 64]" in caplog.text
    with pytest.raises(ValueError, match=r"DtqConverter\(strict=True\).*\n  output: MXFP8BlockScaling"):
        DtqConverter.Config(recipe="mxfp8", strict=True).build().convert(_titan_model_config())
