"""``train.size_rule = "auto"`` in the trainer: the dtq modules too small to gain from the recipe
(here: all of them, since on CPU dtq emulates every format) stay in high precision, the run says
so, and trains bitwise as the high-precision recipe does. In this process, one rank."""

from __future__ import annotations

import pytest
import torch

from dtq.launch import train as train_mod
from tests.launch.test_train import ROOT, TINY, _records


def test_size_rule_auto_keeps_small_gemms_in_high_precision(tmp_path, monkeypatch, capsys):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(var, "0")  # the trainer sets these for its group: restored after the test
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    args = ["--launcher", "single", "--config", str(ROOT / TINY[2]), "--steps", "2"]
    args += ["--set", "model.layers=1", "--set", "model.seq_len=64", "--set", "data.max_bytes=300000"]
    args += ["--set", "train.eval_batches=1", "--set", "train.log_every=1"]
    losses = {}
    for label, extra in (("bf16", ["--recipe", "bf16"]), ("fp8", ["--recipe", "fp8"])):
        train_mod.main([*args, *extra, "--set", "train.size_rule=auto", "--out-dir", str(tmp_path / label)])
        losses[label] = [r["loss"] for r in _records(tmp_path / label)]
    out = capsys.readouterr().out
    assert "size rule: 3 of 3 dtq modules kept in high precision (on cpu dtq emulates every quantized GEMM" in out
    assert losses["fp8"] == losses["bf16"] and len(losses["fp8"]) == 2
    # Without the rule the FP8 run quantizes: its losses differ (the comparison above can fail).
    train_mod.main([*args, "--recipe", "fp8", "--out-dir", str(tmp_path / "fp8-all")])
    assert [r["loss"] for r in _records(tmp_path / "fp8-all")] != losses["bf16"]
    with pytest.raises(SystemExit):
        train_mod.main([*args, "--set", "train.size_rule=sometimes", "--out-dir", str(tmp_path / "bad")])
    assert "size_rule" in capsys.readouterr().err


def _evaluate_without_graph(rank, world):
    from dtq.launch import config, data
    from dtq.launch.model import build_model
    from dtq.launch.recipes import build_recipe

    cfg = config.load(None, ["model.layers=1", "model.seq_len=32", "data.max_bytes=300000", "train.eval_batches=3"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    _, val = data.splits(cfg.data.max_bytes, cfg.data.val_fraction, cfg.model.seq_len, 0)
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append(out.requires_grad))
    loss = train_mod.evaluate(model, val, cfg, build_recipe("fp8", None), torch.device("cpu"), rank, world)
    assert seen == [False] * 3 and loss > 0 and model.training


def test_evaluation_builds_no_autograd_graph():
    """Evaluation runs without autograd. With it on, the running total keeps every batch's graph
    and activations alive: the 1.07 B config on one H100, which trains at 28 GiB, ran out of
    memory evaluating 8 batches when a function inserted above ``evaluate`` took its decorator."""
    from dtq.testing import spawn

    spawn(_evaluate_without_graph, 1, backend="gloo")
