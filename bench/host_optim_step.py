"""Host time of a fused AdamW step and of the gradient norm over FSDP2's DTensors: through
DTensor's dispatch, against ``dtq.optim.on_local_shards`` and the trainer's local norm over one
rank (``dtq.launch.optim.clip_grad_norm``; over several ranks it takes DTensor's norm too), in one
process, alternating. Any machine:

    torchrun --standalone --nproc-per-node 1 bench/host_optim_step.py [--layers 50] [--dim 64]

Small parameters, so that the kernels take little of the time (on a GPU the step is synchronized
before each timed call, so the host time is not hidden behind a full launch queue). Prints the
median microseconds per call and whether both ways gave the same bits.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dtq
from dtq.launch import optim as launch_optim


def build(layers: int, dim: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, device=device) for _ in range(layers)])
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=50, help="Linear layers (two parameters each)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=40)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    x = torch.randn(8, args.dim, device=device)
    models = {way: build(args.layers, args.dim, device) for way in ("dtensor", "local")}
    opts = {way: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for way, m in models.items()}
    times: dict = {(way, what): [] for way in models for what in ("step", "norm")}
    norms: dict = {}
    for _ in range(args.iters):
        for way, model in models.items():
            model(x).square().mean().backward()
            grads = [q.grad for q in model.parameters()]
            sync()
            t = time.perf_counter()
            if way == "dtensor":
                norm = torch.nn.utils.get_total_norm(grads).full_tensor()
            else:
                # (as the trainer calls it: the clipping factor goes to the fused step; dropped
                # here, so that both ways step alike)
                norm = launch_optim.clip_grad_norm(model.parameters(), 1e9, opts[way])
                opts[way].__dict__.pop("grad_scale", None)
            times[way, "norm"].append(time.perf_counter() - t)
            norms[way] = norm
            sync()
            t = time.perf_counter()
            if way == "dtensor":
                opts[way].step()
            else:
                with dtq.optim.on_local_shards():
                    opts[way].step()
            times[way, "step"].append(time.perf_counter() - t)
            opts[way].zero_grad()
    pairs = zip(models["dtensor"].parameters(), models["local"].parameters())
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in pairs)
    if dist.get_rank() == 0:
        n = sum(1 for _ in models["local"].parameters())
        print(f"{n} parameters over {dist.get_world_size()} rank(s) on {device}, median us per call:")
        for what in ("step", "norm"):
            d, loc = (statistics.median(times[w, what]) * 1e6 for w in models)
            print(f"  {what}: DTensor's dispatch {d:8.0f}   local {loc:8.0f}   ({d - loc:+.0f})")
        print(f"  same parameters: {same}; same norm: {torch.equal(norms['dtensor'], norms['local'])}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
