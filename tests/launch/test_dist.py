"""dtq/launch/dist.py: who a process is, from the environment each launcher leaves behind (no real
SLURM or MPI needed here; tests/launch/test_train.py runs torchrun and mpirun for real)."""

import os
import stat

import pytest
import torch

from dtq.launch import dist as ld


def test_torchrun_variables_win():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "n0",
        "MASTER_PORT": "1234",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
    }  # torchrun inside an allocation
    assert ld.detect(env) == ld.DistEnv("torchrun", 3, 8, 1, 4, "n0", 1234)


def test_slurm_ranks_and_master_from_nodelist(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the node list is parsed here
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NODELIST": "gpu[07-08,12],cpu3",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    }
    d = ld.detect(env)
    assert d == ld.DistEnv("slurm", 5, 8, 1, 4, "gpu07", 20000 + 123456 % 20000)
    # the step's own task count and node list take precedence over the job's
    d = ld.detect({**env, "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "a[3-4]"})
    assert (d.world_size, d.master_addr) == (4, "a3")
    # explicit MASTER_ADDR / MASTER_PORT are respected
    d = ld.detect({**env, "MASTER_ADDR": "head", "MASTER_PORT": "29400"})
    assert (d.master_addr, d.master_port) == ("head", 29400)


def test_slurm_master_via_scontrol(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'node-a\\nnode-b\\n'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node-[a-b]"}
    assert ld.detect(env).master_addr == "node-a"


@pytest.mark.parametrize(
    "nodelist, first",
    [("n1", "n1"), ("n[1-3]", "n1"), ("n[003,007]-ib", "n003-ib"), ("a1,b[2-3]", "a1"), ("rack[4-5]", "rack4")],
)
def test_first_host(nodelist, first):
    assert ld.first_host(nodelist) == first


def test_slurm_without_nodelist_or_master_is_an_error(monkeypatch):
    with pytest.raises(RuntimeError, match="SLURM_JOB_NODELIST"):
        ld.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


def test_mpi_variables():
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    # no MASTER_ADDR: the address is agreed on over MPI at init time
    assert ld.detect(env) == ld.DistEnv("mpi", 1, 2, 1, 2, None, None)
    assert ld.detect({**env, "MASTER_ADDR": "h"}).master_port == ld.DEFAULT_PORT
    assert ld.detect({"PMI_RANK": "0", "PMI_SIZE": "4"}).world_size == 4


def test_single_process_and_forced_launcher():
    assert ld.detect({}) == ld.DistEnv("single", 0, 1, 0, 1, None, None)
    # a batch script running plain python inside an allocation can say so
    assert ld.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "single").world_size == 1
    with pytest.raises(ValueError, match="launcher="):
        ld.detect({}, "pbs")


def test_bad_values_name_the_variable():
    with pytest.raises(RuntimeError, match="SLURM_PROCID='x'"):
        ld.detect({"SLURM_PROCID": "x", "SLURM_NTASKS": "2", "MASTER_ADDR": "h"})


def test_device_choice(monkeypatch):
    d = ld.DistEnv("torchrun", 1, 2, 1, 2, "h", 1)
    assert ld.choose_device(d, "cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert ld.choose_device(d) == torch.device("cuda", 1)
    # 4 ranks on a node with 2 GPUs: every rank of the node falls back to the CPU, together
    assert ld.choose_device(ld.DistEnv("torchrun", 3, 4, 3, 4, "h", 1)) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="local rank 3 has no GPU"):
        ld.choose_device(ld.DistEnv("torchrun", 3, 4, 3, 4, "h", 1), "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert ld.choose_device(d) == torch.device("cpu")
