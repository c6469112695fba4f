"""dtq.integrations.lightning: the Precision plugin, on CPU (FSDP2 on 2 gloo ranks, and one device)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import dtq
from dtq.testing import spawn

H = 64


def _data(n=32, out=H):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, H, generator=g), torch.randn(n, out, generator=g)


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

    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        plugins=[plugin],
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _loader():
    x, y = _data(64)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


def _check_lightning(rank, world):
    from lightning.pytorch.strategies import ModelParallelStrategy

    from dtq.integrations.lightning import DtqPrecision

    def fit(plugin):
        module = _lightning_module(convert_in_configure_model=True)
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
        dtq.parallel.comm_stats(reset=True)
        _trainer(strategy, plugin, devices=world).fit(module, _loader())
        return module, dtq.parallel.comm_stats()

    module, stats = fit(DtqPrecision("fp8", quantized_gather=True))
    assert isinstance(module.net[0], dtq.nn.Linear) and hasattr(module.net[0].weight, "device_mesh")
    assert len(module.losses) == 3 and module.losses[2] < module.losses[0], module.losses
    assert stats.get("fp8/rowwise", 0) > 0 and stats.get("fp8/columnwise", 0) > 0, stats
    # quantized_gather="auto" (the default), both ranks on one host: FSDP2 gathers plain shards, the
    # GEMMs quantize the whole weight as the quantized gather delivers it: the same losses, bit for
    # bit, and no dtq gathers
    plain, stats = fit(DtqPrecision("fp8"))
    assert type(plain.net[0].weight._local_tensor) is torch.Tensor and stats == {}, stats
    assert plain.losses == module.losses, (plain.losses, module.losses)


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
    with pytest.raises(ValueError, match="quantized_gather=False needs quantized_params=False"):
        DtqPrecision("mxfp8", quantized_params=True, quantized_gather=False)
    with pytest.raises(ValueError, match=r"quantized_gather='sometimes': expected True .*, False .* or \"auto\""):
        DtqPrecision("mxfp8", quantized_gather="sometimes")
