"""dtq inside torchtitan, Lightning and Accelerate (dtq/integrations), on CPU with gloo ranks.

torchtitan: its model zoo (``torchtitan.models``) imports triton, which CPU builds of torch do not
ship, so these tests build a tiny model from torchtitan's documented protocol classes (``Module``,
``BaseModel``, ``ModuleList``, ``ModelConfigConverter``, ``OptimizersContainer``), the way its
models are built: a config tree, converted, built on the meta device, FSDP2-sharded,
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
from dtq.testing import spawn

H = 64


def _data(n=32, out=H):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, H, generator=g), torch.randn(n, out, generator=g)


# -- torchtitan --------------------------------------------------------------------------------


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
        return TitanLinear.Config(in_features=i, out_features=o,
                                  param_init={"weight": lambda p: torch.nn.init.trunc_normal_(p, std=0.05)})

    return Tiny.Config(layers=[Block.Config(w1=linear(H, 2 * H), w2=linear(2 * H, H)) for _ in range(2)],
                       output=linear(H, 100))


def _check_titan(rank, world, recipe):
    from torchtitan.components.optimizer.optimizer import default_adamw

    from dtq.integrations.torchtitan import DtqConverter, DtqLinear, post_optimizer_build_fn

    config = DtqConverter.Config(recipe=recipe, filter_fqns=["layers.1.w2"]).build().convert(_titan_model_config())
    with torch.device("meta"):
        model = config.build()
    model.verify_module_protocol()
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {"layers.0.w1": "DtqLinear", "layers.0.w2": "DtqLinear", "layers.1.w1": "DtqLinear",
                     "layers.1.w2": "TitanLinear", "output": "TitanLinear"}, kinds
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
    x, y = _data(out=100)
    dtq.parallel.comm_stats(reset=True)
    losses = []
    for _ in range(3):  # no dtq.autocast: the converter bound the recipe
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        losses.append(loss.item())
        local = w._local_tensor  # the hook reduced the new weights' amaxes (per-tensor FP8 needs them)
        assert local._dtq_amax[0][:2] == (local._version, local._data._version)
    assert losses[2] < losses[0], losses
    stats = dtq.parallel.comm_stats()
    assert stats.get("fp8/rowwise", 0) > 0 and stats.get("fp8/columnwise", 0) > 0, stats


def test_torchtitan_converter_trains_under_fsdp2():
    pytest.importorskip("torchtitan.protocols.model", reason="torchtitan is not installed")
    spawn(_check_titan, 2, "fp8", backend="gloo")


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


# -- Lightning ---------------------------------------------------------------------------------


def _lightning_module(convert_in_configure_model: bool):
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.ReLU(), torch.nn.Linear(2 * H, H))
            self.losses = []

        def configure_model(self):
            if not convert_in_configure_model:
                return
            self.trainer.precision_plugin.convert_module(self)  # before fully_shard
            mesh = self.device_mesh["data_parallel"]
            for m in self.net:
                if isinstance(m, torch.nn.Linear):
                    fully_shard(m, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, i):
            loss = F.mse_loss(self.net(batch[0]), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Tiny()


def _trainer(strategy, plugin, devices=1):
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, plugins=[plugin], max_steps=3,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _loader():
    x, y = _data(64)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


def _check_lightning(rank, world):
    from lightning.pytorch.strategies import ModelParallelStrategy

    from dtq.integrations.lightning import DtqPrecision

    module = _lightning_module(convert_in_configure_model=True)
    trainer = _trainer(ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1), DtqPrecision("fp8"),
                       devices=world)
    dtq.parallel.comm_stats(reset=True)
    trainer.fit(module, _loader())
    assert isinstance(module.net[0], dtq.nn.Linear) and hasattr(module.net[0].weight, "device_mesh")
    assert len(module.losses) == 3 and module.losses[2] < module.losses[0], module.losses
    stats = dtq.parallel.comm_stats()
    assert stats.get("fp8/rowwise", 0) > 0 and stats.get("fp8/columnwise", 0) > 0, stats


def test_lightning_plugin_trains_under_fsdp2():
    """Lightning's ModelParallelStrategy (FSDP2) on 2 gloo ranks: the ranks are started by
    dtq.testing.spawn with the environment Lightning reads, so Lightning launches nothing."""
    pytest.importorskip("lightning", reason="lightning is not installed")
    spawn(_check_lightning, 2, backend="gloo")


def test_lightning_plugin_single_device_and_master_weight_check():
    pytest.importorskip("lightning", reason="lightning is not installed")
    from dtq.integrations.lightning import DtqPrecision

    plugin = DtqPrecision(dtq.MXFP8BlockScaling())
    module = _lightning_module(convert_in_configure_model=False)
    _trainer("auto", plugin).fit(module, _loader())  # Lightning calls convert_module itself
    assert isinstance(module.net[0], dtq.nn.Linear) and module.net[0].gemm_state.recipe == dtq.MXFP8BlockScaling()
    assert module.losses[2] < module.losses[0]
    # quantized parameters stepped by a plain optimizer are refused at setup, by name
    plugin = DtqPrecision("mxfp8", quantized_params=True)
    module = _lightning_module(convert_in_configure_model=False)
    with pytest.raises(ValueError, match=r"net\.0\.weight \(and 1 more\) are quantized parameters, stepped by AdamW"):
        _trainer("auto", plugin).fit(module, _loader())


# -- Accelerate --------------------------------------------------------------------------------


def test_accelerate_convert_and_prepare():
    """Single process (Accelerate runs multi-process CPU jobs as DDP: its FSDP2 path is GPU-only)."""
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from dtq.integrations import accelerate as dtq_accelerate

    try:
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.ReLU(), torch.nn.Linear(2 * H, 100))
        model = dtq_accelerate.convert(accelerator, model, "mxfp8")
        assert isinstance(model[0], dtq.nn.Linear) and type(model[2]) is torch.nn.Linear  # 100 rows: no MX blocks
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = dtq_accelerate.prepare(accelerator, model, optimizer)
        x, y = _data(out=100)
        losses = []
        for _ in range(3):
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert model[0].gemm_state.recipe == dtq.MXFP8BlockScaling() and losses[2] < losses[0]
        # quantized parameters need master weights; Accelerate's own FP8 does not stack with dtq
        qmodel = dtq_accelerate.convert(accelerator, torch.nn.Linear(H, H), "mxfp8", quantized_params=True)
        with pytest.raises(ValueError, match=r"weight \(and 0 more\) are quantized parameters, stepped by SGD"):
            dtq_accelerate.prepare(accelerator, qmodel, torch.optim.SGD(qmodel.parameters(), lr=0.1))
        accelerator.state.mixed_precision = "fp8"  # what Accelerator(mixed_precision="fp8") sets
        with pytest.raises(ValueError, match="mixed_precision='fp8'"):
            dtq_accelerate.convert(accelerator, torch.nn.Linear(H, H), "mxfp8")
    finally:
        AcceleratorState._reset_state(True)
