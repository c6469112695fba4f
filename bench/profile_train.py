"""Where the example trainer's step time goes: runs ``launch/train.py`` (same arguments) under
cProfile and prints the functions with the most time per training step, so a host-bound step
(GPU idle between kernels) shows what to cut.

    python bench/profile_train.py --top 40 -- --config launch/configs/llama300m.toml --recipe fp8 \\
        --set train.steps=20 --out-dir /tmp/prof

Profiling slows Python code about twofold; read the rows relative to each other.

``--torch-profiler 25:30``: torch's profiler (host and GPU) over steps 25 to 29 instead, printing
the wall time per step, then the ops and kernels by GPU time and by host time
(``bench/results/swiglu_kernels_h200/prof-*.txt`` came from a first version of it, whose header
line also summed the GPU column, counting ops and their kernels twice). A step whose
``cudaStreamSynchronize`` waits little is bound by host time.

Under ``torchrun`` each rank prints its own tables, headed with its rank, and a line of its GPU's
time: NCCL kernels, other kernels, and how long any ran (a rank that waits for a late one spends
its step in NCCL's kernels).

``--stacks`` (with ``--torch-profiler``): then each kernel's time by the op that launched it, that
op's caller, input shapes and the Python stack that issued it (the copies a step makes, say).

``--cprofile-steps 25:30``: cProfile over those steps only (the compile of the first steps left
out), printed by internal time, per step.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pathlib
import pstats
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--dump", default="", help="also write the raw pstats here")
    p.add_argument(
        "--torch-profiler", type=_window, default=None, metavar="START:END", help="torch's profiler over these steps"
    )
    p.add_argument("--stacks", action="store_true", help="with --torch-profiler: kernels by op and Python stack")
    p.add_argument(
        "--cprofile-steps", type=_window, default=None, metavar="START:END", help="cProfile over these steps only"
    )
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: launch/train.py's arguments")
    args = p.parse_args()
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    from dtq.launch import train

    if args.torch_profiler:
        if args.dump:
            p.error("--dump writes cProfile's stats; it does not apply with --torch-profiler")
        state = profile_steps(*args.torch_profiler, args.top, args.stacks)
        try:
            train.main(train_args)
        finally:
            if "prof" in state and not state.get("done"):
                state["prof"].__exit__(None, None, None)
                print(f"profile_train: training ended before step {args.torch_profiler[1]}; nothing reported")
        return
    if args.cprofile_steps:
        cprofile_steps(*args.cprofile_steps, args.top, args.dump)
        train.main(train_args)
        return
    prof = cProfile.Profile()
    prof.enable()
    train.main(train_args)
    prof.disable()
    if args.dump:
        prof.dump_stats(args.dump)
    stats = pstats.Stats(prof)
    for key in ("cumulative", "tottime"):
        print(f"\n=== by {key}")
        stats.sort_stats(key).print_stats(args.top)


def _window(text: str) -> tuple[int, int]:
    try:
        start, end = (int(s) for s in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give START:END, two step numbers such as 25:30") from None
    if not 1 <= start < end:
        raise argparse.ArgumentTypeError(f"{text!r}: needs 1 <= START < END (steps of this process, from 1)")
    return start, end


def _on_steps(start: int, end: int, begin, finish) -> None:
    """Call ``begin()`` as step ``start`` begins and ``finish(steps)`` as step ``end`` begins, by
    wrapping the trainer's per-step learning-rate call (the first thing each step does; steps of
    this process, counted from 1)."""
    from dtq.launch import optim

    set_lr, step = optim.set_lr, [0]

    def counted(opt, lr):
        step[0] += 1
        if step[0] == start:
            begin()
        elif step[0] == end:
            finish(end - start)
        return set_lr(opt, lr)

    optim.set_lr = counted


def cprofile_steps(start: int, end: int, top: int, dump: str) -> None:
    """cProfile from step ``start`` until step ``end`` begins: the steady state, no compile."""
    prof = cProfile.Profile()

    def finish(steps: int) -> None:
        prof.disable()
        if dump:
            prof.dump_stats(dump)
        print(f"== cProfile, steps {start}-{end - 1} ({steps} steps), by internal time")
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)

    _on_steps(start, end, prof.enable, finish)


def profile_steps(start: int, end: int, top: int, stacks: bool = False) -> dict:
    """torch's profiler from step ``start`` until step ``end`` begins. Returns the state ``main``
    finishes with. ``stacks``: also each op's kernels by the Python stack that issued the op."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    state: dict = {}
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # (the Python frames of each op need the verbose config on torch 2.11-2.13)
    extra = {
        "with_stack": True,
        "record_shapes": True,
        "experimental_config": torch._C._profiler._ExperimentalConfig(verbose=True),
    }

    def begin() -> None:
        sync()
        state["prof"] = profile(activities=activities, **(extra if stacks else {}))
        state["prof"].__enter__()
        state["t0"] = time.perf_counter()

    def finish(steps: int) -> None:
        sync()
        wall = (time.perf_counter() - state["t0"]) / steps
        state["prof"].__exit__(None, None, None)
        state["done"] = True
        events = state["prof"].key_averages()
        rank = os.environ.get("RANK")
        who = f" (rank {rank})" if rank is not None else ""
        print(f"== torch profiler{who}, steps {start}-{end - 1}: wall {wall * 1e3:.1f} ms/step")
        if cuda:
            print(f"== device{who}: {device_summary(state['prof'], steps)}")
        for key in ("self_device_time_total", "self_cpu_time_total")[0 if cuda else 1 :]:
            print(events.table(sort_by=key, row_limit=top, max_name_column_width=90))
        if stacks:
            print_by_stack(state["prof"].events(), steps, top, cuda)

    _on_steps(start, end, begin, finish)
    return state


def device_summary(prof, steps: int) -> str:
    """The GPU's time per step: its kernels' and copies' summed durations, NCCL's apart, and how
    long any of them ran (the union of their intervals on all streams). Over several ranks, a rank
    whose NCCL kernels run much longer than the others' waits in them for a late rank (NCCL's
    kernels spin until every rank has joined, sharing the GPU with the compute beside them)."""
    import torch

    spans, nccl, other = [], 0, 0
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        begin, length = e.start_ns(), e.duration_ns()
        spans.append((begin, begin + length))
        if "nccl" in e.name().lower():
            nccl += length
        else:
            other += length
    busy, reach = 0, None
    for begin, end in sorted(spans):
        if reach is None or begin > reach:
            busy, reach = busy + end - begin, end
        elif end > reach:
            busy, reach = busy + end - reach, end
    ms = 1e6 * steps
    return (
        f"NCCL {nccl / ms:.1f} ms/step, other kernels and copies {other / ms:.1f}, "
        f"some GPU work running {busy / ms:.1f}"
    )


def print_by_stack(events, steps: int, top: int, cuda: bool) -> None:
    """Kernel time per step grouped by (op, the op that called it, kernel, input shapes, Python
    stack of the nearest op that has one): where a kernel comes from, not only what it is. On a
    machine without a GPU, the ops' own CPU time instead."""
    import collections

    count, total = collections.Counter(), collections.Counter()
    for e in events:
        kernels = list(e.kernels or []) if cuda else [None]
        if not kernels or (not cuda and not e.name.startswith("aten::")):
            continue
        a = e
        while a is not None and not a.stack:
            a = a.cpu_parent
        frames = [f for f in (a.stack if a is not None else []) if "torch/profiler" not in f][:6]
        parent = e.cpu_parent.name if e.cpu_parent is not None else "-"
        for k in kernels:
            key = (e.name, parent, k.name[:70] if k else "cpu", str(e.input_shapes)[:70], "\n        ".join(frames))
            count[key] += 1
            total[key] += k.duration if k else e.self_cpu_time_total
    print(f"== {'kernel' if cuda else 'op'} time per step by op and Python stack")
    for key in sorted(total, key=total.get, reverse=True)[:top]:
        op, parent, kernel, shapes, frames = key
        print(f"{count[key] / steps:6.1f} x {total[key] / steps / 1e3:7.3f} ms  {op} (in {parent}) {kernel} {shapes}")
        print(f"        {frames}")


if __name__ == "__main__":
    main()
