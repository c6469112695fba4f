"""Multi-rank test harness: real processes, real collectives (gloo on CPU, NCCL on GPUs)."""

from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(world_size: int) -> str:
    """NCCL when every rank can have its own GPU, else gloo."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _worker(fn, rank, world_size, port, backend, timeout_s, args, errors):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    faulthandler.enable()  # a native abort prints every thread's Python stack, not only "terminate called"
    failed = True
    try:
        # CPU ranks share the machine's cores instead of each taking all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch.device("cuda", rank) if backend == "nccl" else None,
        )
        torch.manual_seed(1234)  # same default RNG stream on every rank
        fn(rank, world_size, *args)
        dist.barrier()
        failed = False
    except BaseException:  # noqa: BLE001 - report everything to the parent
        errors.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if not failed:
        # The rank's work is done and checked: leave without interpreter teardown. CI once saw a
        # rank that had raised nothing abort with "terminate called without an active exception"
        # (a C++ thread object destroyed while running: torch's gloo / TCPStore threads are the
        # only ones in these processes); nothing of the test runs in that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


_PORT_TAKEN = ("Address already in use", "EADDRINUSE", "address already in use")


def spawn(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None, timeout: float = 300.0
) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes with
    ``torch.distributed`` initialised on a free local port. ``fn`` and ``args`` must be
    picklable (a module-level function). The first failing rank's exception is re-raised here
    with its rank and traceback; a run longer than ``timeout`` seconds is killed and reported.
    If another process took the chosen port before the ranks bound it, it retries on a new one."""
    for attempt in range(3):
        try:
            return _spawn_once(fn, world_size, args, backend, timeout)
        except RuntimeError as e:
            if attempt == 2 or not any(m in str(e) for m in _PORT_TAKEN):
                raise


def _spawn_once(fn: Callable[..., Any], world_size: int, args: tuple, backend: str | None, timeout: float) -> None:
    backend = backend or default_backend(world_size)
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(
            f"spawn(backend='nccl', world_size={world_size}) needs {world_size} GPUs, "
            f"found {torch.cuda.device_count()}; use backend='gloo' or fewer ranks"
        )
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, backend, timeout, args, errors), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failures = []
    while any(p.is_alive() for p in procs):
        while not errors.empty():
            failures.append(errors.get())
        if failures or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for p in procs:
        p.join(timeout=5 if failures else max(0.0, deadline - time.monotonic()))
    while not errors.empty():
        failures.append(errors.get())
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if failures:
        rank, tb = failures[0]  # the first to fail is most likely the cause
        others = sorted({r for r, _ in failures} - {rank})
        raise RuntimeError(
            f"rank {rank} of {world_size} failed" + (f" (ranks {others} failed too)" if others else "") + f":\n{tb}"
        )
    if alive:
        raise TimeoutError(f"ranks {alive} of {world_size} were still running after {timeout:.0f} s and were killed")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"ranks exited abnormally (rank, exit code): {bad}")
