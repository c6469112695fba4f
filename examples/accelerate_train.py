"""A tiny model trained through Hugging Face Accelerate with dtq.

    python examples/accelerate_train.py                                          # one process
    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py        # 2 CPU processes (DDP)
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 examples/accelerate_train.py  # 2 GPUs

Accelerate shards with FSDP2 on GPUs only; on CPU its multi-process mode is DDP (Accelerator finds
torchrun's environment). Under FSDP2 with --mixed_precision bf16 the model returns BF16 outputs
(Accelerate sets FSDP2's output_dtype), so the loss takes them in FP32: on CUDA, mse_loss of a BF16
input against an FP32 target fails in backward ("Found dtype Float but expected BFloat16"), with or
without dtq.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from dtq.integrations import accelerate as dtq_accelerate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="mxfp8", help="a dtq.presets name: fp8, mxfp8, nvfp4, hybrid, ...")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    model = dtq_accelerate.convert(accelerator, model, args.recipe)  # before the optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(accelerator.process_index)
    x = torch.randn(1024, 256, generator=g)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, torch.tanh(x.flip(-1))), batch_size=64, shuffle=True
    )
    model, optimizer, loader = dtq_accelerate.prepare(accelerator, model, optimizer, loader)
    accelerator.print(f"{accelerator.num_processes} process(es), {accelerator.distributed_type}")
    step = 0
    while step < args.steps:
        for xb, yb in loader:
            loss = F.mse_loss(model(xb).float(), yb)  # BF16 outputs under FSDP2 mixed precision
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 5 == 0:
                accelerator.print(f"step {step} loss {loss.item():.4f}")
            if step == args.steps:
                break


if __name__ == "__main__":
    main()
