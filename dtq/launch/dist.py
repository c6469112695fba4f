"""Process-group bootstrap for every way the trainer can be started.

The trainer calls :func:`init_distributed` once. It works out who this process is from the
environment the launcher left behind and initializes ``torch.distributed`` with the ``env://``
rendezvous, so the rest of the code never cares how it was started:

* ``torchrun``: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT are already set;
* ``srun`` (SLURM): SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; the master is the first host of
  the step's node list (``scontrol show hostnames`` when available, else parsed here) and the port
  is derived from the job id, so no rank has to talk to another before the rendezvous;
* ``mpirun``: the rank and size come from ``mpi4py``'s COMM_WORLD; when MASTER_ADDR is not set,
  rank 0 picks a free port and broadcasts ``host:port`` over MPI;
* a plain ``python launch/train.py``: one process on a free local port.

The detection is a pure function of the environment (:func:`detect`) so it can be tested without
any launcher.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping

import torch
import torch.distributed as dist

LAUNCHERS = ("auto", "torchrun", "slurm", "mpi", "single")
# Environment variables by which MPI implementations tell a process its rank.
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "MPI_LOCALRANKID")
DEFAULT_PORT = 29500


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """Who this process is and where the rendezvous lives. ``master_addr`` / ``master_port`` are
    None when they still have to be agreed on (MPI without MASTER_ADDR, single process)."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise RuntimeError(f"launch: the environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"launch: {name}={value!r} is not an integer") from None


def which_launcher(env: Mapping[str, str]) -> str:
    """The launcher that started this process, judged from its environment. torchrun's variables
    win (torchrun inside a SLURM allocation is torchrun); SLURM_PROCID means an ``srun`` task;
    an MPI rank variable means ``mpirun``/``mpiexec``."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun"
    if "SLURM_PROCID" in env and ("SLURM_NTASKS" in env or "SLURM_STEP_NUM_TASKS" in env):
        return "slurm"
    if any(v in env for v in _MPI_RANK_VARS):
        return "mpi"
    return "single"


def first_host(nodelist: str) -> str:
    """The first host name of a SLURM node list such as ``gpu[07-09,12],cpu3`` (-> ``gpu07``).
    Used when ``scontrol`` is not available to expand it."""
    nodelist = nodelist.strip()
    if not nodelist:
        raise RuntimeError("launch: SLURM gave an empty node list")
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist)
    prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
    if ranges is None:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first + suffix


def slurm_master_addr(env: Mapping[str, str]) -> str:
    """MASTER_ADDR if set, else the first host of the step's (or job's) node list."""
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise RuntimeError("launch: running under SLURM but neither MASTER_ADDR nor SLURM_JOB_NODELIST is set")
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run(
                [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, check=True, timeout=30
            ).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass  # fall back to parsing the list ourselves
    return first_host(nodelist)


def slurm_master_port(env: Mapping[str, str]) -> int:
    """MASTER_PORT if set, else a port every task derives alike from the job id (two jobs sharing
    a node then do not collide)."""
    if env.get("MASTER_PORT"):
        return _int(env, "MASTER_PORT")
    return 20000 + _int(env, "SLURM_JOB_ID", 0) % 20000


def _tasks_per_node(env: Mapping[str, str], world: int) -> int:
    # SLURM_STEP_TASKS_PER_NODE looks like "4(x2),3": the first node's count is enough here.
    raw = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
    if raw:
        m = re.match(r"\d+", raw)
        if m:
            return int(m.group(0))
    return world


def detect(env: Mapping[str, str], launcher: str = "auto") -> DistEnv:
    """Rank, world size, local rank and rendezvous address from the environment. For MPI without
    MASTER_ADDR the rank and size are read from ``MPI.COMM_WORLD`` by :func:`init_distributed`, so
    here they come from the MPI implementation's variables when it sets them."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launch: launcher={launcher!r}; use one of {LAUNCHERS}")
    kind = which_launcher(env) if launcher == "auto" else launcher
    if kind == "torchrun":
        world = _int(env, "WORLD_SIZE")
        return DistEnv(
            "torchrun",
            _int(env, "RANK"),
            world,
            _int(env, "LOCAL_RANK", 0),
            _int(env, "LOCAL_WORLD_SIZE", world),
            env.get("MASTER_ADDR") or "127.0.0.1",
            _int(env, "MASTER_PORT", DEFAULT_PORT),
        )
    if kind == "slurm":
        world = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1))
        return DistEnv(
            "slurm",
            _int(env, "SLURM_PROCID"),
            world,
            _int(env, "SLURM_LOCALID", 0),
            _tasks_per_node(env, world),
            slurm_master_addr(env),
            slurm_master_port(env),
        )
    if kind == "mpi":
        rank = next(
            (
                _int(env, v)
                for v in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
                if v in env
            ),
            0,
        )
        world = next((_int(env, v) for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE") if v in env), 1)
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", _int(env, "MPI_LOCALRANKID", 0))
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world)
        addr = env.get("MASTER_ADDR") or None
        return DistEnv(
            "mpi", rank, world, local, local_world, addr, _int(env, "MASTER_PORT", DEFAULT_PORT) if addr else None
        )
    return DistEnv("single", 0, 1, 0, 1, None, None)


def free_port(host: str = "") -> int:
    """A TCP port nothing listens on right now (the rendezvous binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _mpi_env(denv: DistEnv) -> DistEnv:
    """Rank, size and local rank from MPI itself; rank 0 publishes ``host:port`` when MASTER_ADDR
    is not set."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError(
            "launch: started under MPI but mpi4py is not installed; `pip install mpi4py` (or the "
            "project's extra: pip install 'dtq[mpi]'), or start with torchrun"
        ) from None
    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    rank, world, local, local_world = comm.Get_rank(), comm.Get_size(), node.Get_rank(), node.Get_size()
    node.Free()
    addr, port = denv.master_addr, denv.master_port
    if addr is None:
        if rank == 0:
            host = socket.gethostname() if world > local_world else "127.0.0.1"
            addr, port = host, free_port()
        addr, port = comm.bcast((addr, port), root=0)
    return DistEnv("mpi", rank, world, local, local_world, addr, port)


def choose_device(denv: DistEnv, device: str = "auto") -> torch.device:
    """``cuda:LOCAL_RANK`` when this node has a GPU for each of its ranks (or ``device="cuda"``),
    else the CPU. Deciding from the node's rank count keeps every rank of a node in agreement."""
    if device == "cpu":
        return torch.device("cpu")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" or (device == "auto" and n >= denv.local_world_size and n > 0):
        if denv.local_rank >= n:
            raise RuntimeError(
                f"launch: local rank {denv.local_rank} has no GPU (this node has {n}); start at most "
                f'{n} ranks per node or set device = "cpu"'
            )
        return torch.device("cuda", denv.local_rank)
    if device not in ("auto", "cuda"):
        raise ValueError(f"launch: device={device!r}; use 'auto', 'cuda' or 'cpu'")
    return torch.device("cpu")


def init_distributed(
    launcher: str = "auto", device: str = "auto", timeout: datetime.timedelta = datetime.timedelta(minutes=10)
) -> tuple[DistEnv, torch.device]:
    """Initialize the default process group (NCCL when every rank has a GPU, else gloo) and return
    who this process is and its device. A single process gets a one-rank group, so FSDP2 and DCP
    run the same code path everywhere."""
    denv = detect(os.environ, launcher)
    if denv.launcher == "mpi":
        denv = _mpi_env(denv)
    if denv.launcher == "single":
        denv = dataclasses.replace(denv, master_addr="127.0.0.1", master_port=free_port("127.0.0.1"))
    os.environ.update(
        RANK=str(denv.rank),
        WORLD_SIZE=str(denv.world_size),
        LOCAL_RANK=str(denv.local_rank),
        LOCAL_WORLD_SIZE=str(denv.local_world_size),
        MASTER_ADDR=str(denv.master_addr),
        MASTER_PORT=str(denv.master_port),
    )
    dev = choose_device(denv, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif "OMP_NUM_THREADS" not in os.environ:  # CPU ranks share the node's cores (mpirun/srun do not say)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, denv.local_world_size)))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=denv.rank,
        world_size=denv.world_size,
        timeout=timeout,
        device_id=dev if dev.type == "cuda" else None,
    )
    return denv, dev
