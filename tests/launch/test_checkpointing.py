"""The example trainer's checkpoints and out_dir: a fresh run refuses an out_dir that holds another
run's checkpoints (``--overwrite`` deletes them), a checkpoint is committed atomically (a rank that
fails mid-save leaves the previous complete checkpoint the newest), and ``latest()`` sees
committed checkpoints only."""

import json
import os
import subprocess
import sys

import pytest
import torch

from dtq.launch import checkpointing
from dtq.launch import train as train_mod
from dtq.testing import spawn
from tests.launch.test_train import ROOT, TINY, _env, _records

# One step of the README's tiny config on a little data: a real run in a few seconds.
ONE_STEP = [*TINY, "--steps", "1", "--set", "data.max_bytes=300000", "--set", "train.eval_batches=1"]


def _torchrun_proc(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)


def _fake_old_run(out_dir) -> None:
    """What an earlier run leaves: a complete checkpoint of step 5, the temporary directory of a
    save that crashed, and its metrics log."""
    (out_dir / "checkpoints" / "step_00000005").mkdir(parents=True)
    (out_dir / "checkpoints" / "step_00000005" / ".metadata").write_bytes(b"old run")
    (out_dir / "checkpoints" / "step_00000006.tmp-0123abcd").mkdir()
    (out_dir / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 5, "loss": 9.0}) + "\n")


def test_fresh_run_into_an_out_dir_with_checkpoints_is_refused_and_overwrite_starts_fresh(tmp_path):
    _fake_old_run(tmp_path)
    old_metrics = (tmp_path / "metrics.jsonl").read_text()

    proc = _torchrun_proc(*ONE_STEP, "--out-dir", str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    lines = [line for line in out.splitlines() if "already has checkpoints" in line]
    assert len(lines) == 1, out[-3000:]  # rank 0 says it once; no rank prints a traceback
    assert str(tmp_path) in lines[0] and "step 5" in lines[0]
    assert "--resume" in lines[0] and "--overwrite" in lines[0]
    assert 'dtq/launch/train.py", line' not in out, out[-3000:]
    # A refused run touches nothing.
    assert (tmp_path / "checkpoints" / "step_00000005" / ".metadata").read_bytes() == b"old run"
    assert (tmp_path / "metrics.jsonl").read_text() == old_metrics

    proc = _torchrun_proc(*ONE_STEP, "--out-dir", str(tmp_path), "--overwrite")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    # The old checkpoints, the stale temporary directory and the old metrics are gone.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001"]
    assert checkpointing.latest(tmp_path) == checkpointing.checkpoint_dir(tmp_path, 1)
    assert [r["step"] for r in _records(tmp_path)] == [1]
    assert len(_records(tmp_path, "config")) == 1


def test_a_bad_override_under_torchrun_is_one_line_from_rank_0(tmp_path):
    """A typed-override mistake is caught before any process group exists: rank 0 alone prints it,
    as one line naming the key, and no rank prints a traceback."""
    proc = _torchrun_proc(*ONE_STEP, "--out-dir", str(tmp_path), "--set", "train.recompute=maybe")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    lines = [line for line in out.splitlines() if "config:" in line]
    assert lines == [
        "error: config: train.recompute = 'maybe': Input should be a valid boolean, unable to interpret input"
    ], out[-3000:]
    assert "dtq/launch/" not in out and "ValidationError" not in out, out[-3000:]


def test_resume_with_overwrite_and_bad_configs_are_one_line_errors(capsys):
    for argv, message in [
        (["--resume", "--overwrite"], "error: config: --resume continues the run"),
        (["--set", "train.steps=0"], "error: config: train.steps = 0: Input should be greater than 0"),
    ]:
        with pytest.raises(SystemExit) as e:
            train_mod.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1, err


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    opt.step()  # optimizer state to save (and to load into)
    return model, opt


def _fail_mid_save(rank, world, out):
    import torch.distributed as dist
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    cpu = torch.device("cpu")
    model, opt = _model_and_optimizer(0)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    checkpointing.save(out, 2, model, opt, {"step": 2, "samples": 20, "world_size": world}, cpu)

    # Another save of step 2 (and then of step 3) with other weights, in which rank 1 fails right
    # after writing its files, before anything is committed.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    torch.rand(8)
    write_data = filesystem._FileSystemWriter.write_data

    def write_then_fail(self, plan, planner):
        write_data(self, plan, planner).wait()
        raise RuntimeError("injected: rank 1 dies after writing its part")

    if rank == 1:
        filesystem._FileSystemWriter.write_data = write_then_fail
    try:
        for step in (2, 3):
            with pytest.raises((RuntimeError, CheckpointException), match="injected"):
                checkpointing.save(out, step, model, opt, {"step": step, "samples": 99, "world_size": world}, cpu)
    finally:
        filesystem._FileSystemWriter.write_data = write_data
    dist.barrier()

    # The complete step-2 checkpoint is still the newest and resumes unchanged (not a mix of the
    # two saves); the failed step-3 save left no step directory.
    assert checkpointing.latest(out) == checkpointing.checkpoint_dir(out, 2)
    resumed, resumed_opt = _model_and_optimizer(1)
    state = checkpointing.load(checkpointing.latest(out), resumed, resumed_opt, cpu)
    for k, v in resumed.state_dict().items():
        assert torch.equal(v, good[k]), k
    assert state["samples"] == 20
    assert not checkpointing.checkpoint_dir(out, 3).exists()

    # A save that succeeds replaces the step-2 checkpoint as a whole (the old one renamed aside,
    # then deleted).
    checkpointing.save(out, 2, model, opt, {"step": 2, "samples": 40, "world_size": world}, cpu)
    assert checkpointing.load(checkpointing.latest(out), resumed, resumed_opt, cpu)["samples"] == 40
    for k, v in resumed.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    dist.barrier()
    assert not [p for p in checkpointing.checkpoint_dir(out, 2).parent.iterdir() if ".old-" in p.name]


def test_a_rank_failing_mid_save_leaves_the_last_complete_checkpoint_newest(tmp_path):
    spawn(_fail_mid_save, 2, str(tmp_path), backend="gloo")


def test_latest_ignores_temporary_dirs_and_a_start_tidies_them(tmp_path):
    root = tmp_path / "checkpoints"
    for name, complete in [
        ("step_00000001", True),
        ("step_00000002", False),  # DCP's .metadata missing
        ("step_00000009.tmp-0a1b2c3d", True),  # written, never committed
        ("step_00000004.old-0a1b2c3d", True),  # moved aside, its replacement not in place
        ("step_00000001.old-99ff", True),
    ]:  # moved aside, replaced
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / ".metadata").write_bytes(name.encode())
    assert checkpointing.latest(tmp_path) == root / "step_00000001"

    assert checkpointing.recover(tmp_path) == [root / "step_00000004"]
    assert (root / "step_00000004" / ".metadata").read_bytes() == b"step_00000004.old-0a1b2c3d"
    assert checkpointing.latest(tmp_path) == root / "step_00000004"
    removed = checkpointing.remove_stale(tmp_path)
    assert sorted(p.name for p in removed) == ["step_00000001.old-99ff", "step_00000009.tmp-0a1b2c3d"]
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000002", "step_00000004"]
    assert (root / "step_00000001" / ".metadata").read_bytes() == b"step_00000001"


def test_prune_keeps_the_newest_committed_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 10):
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / ".metadata").write_bytes(b"x")
    (root / "step_00000011.tmp-0a1b").mkdir()  # a save in progress is not a checkpoint yet
    assert checkpointing.prune(tmp_path, 0) == []  # 0: keep all
    assert sorted(p.name for p in checkpointing.prune(tmp_path, 2)) == ["step_00000001", "step_00000002"]
    assert sorted(os.listdir(root)) == ["step_00000003", "step_00000010", "step_00000011.tmp-0a1b"]


def test_keep_checkpoints_and_a_recipe_change_at_resume(tmp_path, monkeypatch, capsys):
    """``train.keep_checkpoints`` keeps the newest k; resuming under another recipe warns once and
    marks the step in metrics.jsonl (the log then holds two recipes), and is refused with quantized
    parameters, whose checkpoint holds the old recipe's formats. In this process, one rank."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(var, "0")  # the trainer sets these for its group: restored after the test
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # leaves this process's threads alone
    args = [
        "--launcher",
        "single",
        "--config",
        str(ROOT / TINY[2]),
        "--set",
        "model.layers=1",
        "--set",
        "model.seq_len=64",
        "--set",
        "data.max_bytes=300000",
        "--set",
        "train.eval_batches=1",
        "--set",
        "train.checkpoint_every=1",
        "--set",
        "train.keep_checkpoints=1",
        "--out-dir",
        str(tmp_path),
    ]
    steps = lambda: sorted(checkpointing.step_of(p) for p in (tmp_path / "checkpoints").iterdir())  # noqa: E731

    train_mod.main([*args, "--steps", "2", "--recipe", "bf16"])
    assert steps() == [2]
    assert checkpointing.read_run_info(checkpointing.latest(tmp_path))["recipe"] == "bf16"
    capsys.readouterr()

    train_mod.main([*args, "--steps", "3", "--recipe", "fp8", "--resume"])
    out = capsys.readouterr()
    assert "resumed at step 2" in out.out and out.err.count("warning: --resume") == 1, out.err
    assert "train.recipe = 'bf16'" in out.err and "train.recipe = 'fp8'" in out.err
    assert _records(tmp_path, "recipe_change") == [
        {"kind": "recipe_change", "step": 2, "changed": {"recipe": ["bf16", "fp8"]}}
    ]
    assert steps() == [3]

    with pytest.raises(SystemExit) as e:
        train_mod.main([*args, "--steps", "4", "--resume", "--set", "train.quantized_params=true"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: config: --resume: ") and err.count("\n") == 1, err
    assert "cannot be loaded" in err and steps() == [3]
