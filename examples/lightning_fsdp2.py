"""A tiny model trained by Lightning with FSDP2 (ModelParallelStrategy) and dtq's Precision plugin.

python examples/lightning_fsdp2.py            # 2 CPU processes, gloo (Lightning launches them)
python examples/lightning_fsdp2.py --gpus 2   # 2 GPUs, NCCL
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from dtq.integrations.lightning import DtqPrecision


class TinyMLP(pl.LightningModule):
    def __init__(self, hidden: int = 256):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)
        )

    def configure_model(self) -> None:
        # Under ModelParallelStrategy, convert before sharding: Lightning's own convert_module call
        # comes after configure_model, and then finds the model converted.
        self.trainer.precision_plugin.convert_module(self)
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=0, help="GPUs to use (0: 2 CPU processes)")
    parser.add_argument("--recipe", default="mxfp8", help="a dtq.presets name: fp8, mxfp8, nvfp4, hybrid, ...")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    devices = args.gpus or 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 256, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.tanh(x.flip(-1)))
    trainer = pl.Trainer(
        accelerator="gpu" if args.gpus else "cpu",
        devices=devices,
        strategy=ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1),
        plugins=[DtqPrecision(args.recipe)],
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(TinyMLP(), torch.utils.data.DataLoader(data, batch_size=64, shuffle=True))


if __name__ == "__main__":
    main()
