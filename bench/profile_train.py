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
"""

from __future__ import annotations

import argparse
import cProfile
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
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: launch/train.py's arguments")
    args = p.parse_args()
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    from dtq.launch import train

    if args.torch_profiler:
        if args.dump:
            p.error("--dump writes cProfile's stats; it does not apply with --torch-profiler")
        state = profile_steps(*args.torch_profiler, args.top)
        try:
            train.main(train_args)
        finally:
            if "prof" in state and not state.get("done"):
                state["prof"].__exit__(None, None, None)
                print(f"profile_train: training ended before step {args.torch_profiler[1]}; nothing reported")
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


def profile_steps(start: int, end: int, top: int) -> dict:
    """Wrap the trainer's per-step learning-rate call (the first thing each step does) so that
    torch's profiler runs from step ``start`` until step ``end`` begins (steps of this process,
    counted from 1 also when the trainer resumes). Returns the state ``main`` finishes with."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from dtq.launch import optim

    set_lr, state = optim.set_lr, {"step": 0}
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def counted(opt, lr):
        state["step"] += 1
        if state["step"] == start:
            sync()
            state["prof"] = profile(activities=activities)
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        elif state["step"] == end and "prof" in state:
            sync()
            wall = (time.perf_counter() - state["t0"]) / (end - start)
            state["prof"].__exit__(None, None, None)
            state["done"] = True
            events = state["prof"].key_averages()
            print(f"== torch profiler, steps {start}-{end - 1}: wall {wall * 1e3:.1f} ms/step")
            for key in ("self_device_time_total", "self_cpu_time_total")[0 if cuda else 1 :]:
                print(events.table(sort_by=key, row_limit=top, max_name_column_width=90))
        return set_lr(opt, lr)

    optim.set_lr = counted
    return state


if __name__ == "__main__":
    main()
