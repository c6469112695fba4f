"""bench/fidelity_study.sh end to end on CPU (two recipes of the tiny config, a few steps, one
process each), and bench/fidelity_summary.py on hand-made logs: the final-loss average, the BF16
reference, logs of several device calls, and the refusal of runs trained differently."""

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.launch.test_train import ROOT, _env

_spec = importlib.util.spec_from_file_location("fidelity_summary", ROOT / "bench" / "fidelity_summary.py")
summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summary)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_study_script_trains_each_recipe_and_summarises_them(tmp_path):
    """Two recipes, 3 steps each (logged every step, evaluated at 2 and 3): each run's metrics and
    console land in $OUT/<recipe>.*, and fidelity.md / .json compare them with the BF16 run.
    Resharding after forward: on one rank the default keeps the weights the step-2 evaluation
    gathered for step 3, which then gathers nothing, and the table's gathered bytes are step 3's."""
    out = tmp_path / "out"
    env = _env() | {
        "OUT": str(out),
        "RUN_DIR": str(tmp_path / "runs"),
        "CONFIG": "launch/configs/tiny.toml",
        "STEPS": "3",
        "RECIPES": "bf16 hybrid",
        "EXTRA": "--set data.max_bytes=300000 --set train.log_every=1 --set train.eval_every=2 "
        "--set train.eval_batches=1 --set parallel.reshard_after_forward=true",
        "PYTHON": sys.executable,
    }
    proc = subprocess.run(
        ["bash", "bench/fidelity_study.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for recipe in ("bf16", "hybrid"):
        log = (out / f"{recipe}.log").read_text()
        assert "step 3/3 | loss" in log and "rc=0" in log, log
        assert [json.loads(line)["kind"] for line in (out / f"{recipe}.jsonl").read_text().splitlines()][0] == "config"
    assert not (tmp_path / "runs" / "hybrid").exists()  # the checkpoint is not kept
    table = (out / "fidelity.md").read_text()
    assert table in proc.stdout
    rows = [line for line in table.splitlines() if line.startswith("| bf16 ") or line.startswith("| hybrid ")]
    assert len(rows) == 2 and "| 3 |" in rows[1] and "mxfp8/rowwise" in rows[1] and "nvfp4/columnwise" in rows[1]
    assert "%" in rows[1].split("|")[6] and "(3)" in rows[1].split("|")[7]  # vs BF16; validation at step 3
    result = json.loads((out / "fidelity.json").read_text())
    assert result["reference"] == "bf16" and [r["label"] for r in result["runs"]] == ["bf16", "hybrid"]
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: the script draws no PNG (pip install 'dtq[plot]')")
    assert (out / "fidelity.png").read_bytes()[:8] == PNG_MAGIC


def _write_log(path, recipe, losses, evals, log_every=1, **train):
    """A metrics log as the trainer writes it: a config record, train records every ``log_every``
    steps (``losses`` are the interval means), eval records ``{step: val_loss}``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model": {"layers": 2, "hidden": 256},
        "data": {"max_bytes": 1000},
        "train": {"recipe": recipe, "steps": log_every * len(losses), "seed": 0, "quantized_params": recipe != "bf16"}
        | train,
    }
    records = [{"kind": "config", "config": cfg, "world_size": 1, "device": "cpu"}]
    for i, loss in enumerate(losses, 1):
        records.append(
            {
                "kind": "train",
                "step": i * log_every,
                "loss": loss,
                "tokens_per_s": 100.0 * i,
                "gathered_bytes": {"mxfp8/rowwise": 4000 * log_every},
                "peak_memory_bytes": 2**30 * i,
            }
        )
        if i * log_every in evals:
            records.append({"kind": "eval", "step": i * log_every, "val_loss": evals[i * log_every]})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_final_train_loss_averages_whole_log_intervals_from_the_end():
    train = [{"step": s, "loss": loss} for s, loss in [(4, 9.0), (8, 3.0), (12, 2.0), (14, 1.0)]]
    assert summary.final_train_loss(train, 2) == (1.0, [14])
    assert summary.final_train_loss(train, 5) == ((2.0 * 4 + 1.0 * 2) / 6, [12, 14])  # whole intervals: 6 steps
    assert summary.final_train_loss(train, 100) == ((9 * 4 + 3 * 4 + 2 * 4 + 1 * 2) / 14, [4, 8, 12, 14])


def test_summary_of_several_calls_finds_the_bf16_reference_and_names_equal_stems_apart(tmp_path, capsys):
    """Logs of two device calls: the reference is the run whose config says bf16; two logs named
    hybrid.jsonl are told apart by their folders; a run stopped early compares at its own steps."""
    bf16 = _write_log(tmp_path / "a" / "bf16.jsonl", "bf16", [4.0, 3.0, 2.0, 2.0], {2: 2.5, 4: 2.0})
    _write_log(tmp_path / "a" / "hybrid.jsonl", "hybrid", [4.0, 3.3, 2.2, 2.1], {2: 2.6, 4: 2.1})
    _write_log(tmp_path / "b" / "hybrid.jsonl", "hybrid", [4.0, 3.3], {2: 2.75}, steps=4)  # stopped at step 2
    png = tmp_path / "loss.png"
    args = [str(p) for p in sorted(tmp_path.glob("*/hybrid.jsonl"))] + [
        "--md",
        str(tmp_path / "t.md"),
        "--last-steps",
        "2",
    ]
    if importlib.util.find_spec("matplotlib") is not None:
        args += ["--png", str(png)]
    result = summary.main(args + ["--bf16", str(bf16)])
    assert [r["label"] for r in result["runs"]] == ["bf16", "a/hybrid", "b/hybrid"] and result["reference"] == "bf16"
    table = (tmp_path / "t.md").read_text()
    assert table in capsys.readouterr().out
    lines = {line.split(" | ")[0]: line.split(" | ") for line in table.splitlines() if line.startswith("| ")}
    assert lines["| a/hybrid"][4:8] == ["2.1500", "+7.50%", "2.1000 (4)", "+5.00%"]  # (2.2 + 2.1) / 2 vs 2.0
    assert lines["| b/hybrid"][3:8] == ["2 of 4 (incomplete)", "3.6500", "+4.29%", "2.7500 (2)", "+10.00%"]
    assert lines["| a/hybrid"][8:11] == ["300", "4.00 KB (mxfp8/rowwise 4.00 KB)", "4.0 |"]
    assert lines["| bf16"][5] == "—"
    assert summary.main([*args, str(bf16)])["reference"] == "bf16"  # found by its config
    assert summary.main(args)["reference"] is None  # no BF16 run given: nothing to compare with
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == PNG_MAGIC


def test_summary_refuses_runs_trained_unlike_the_reference(tmp_path, capsys):
    bf16 = _write_log(tmp_path / "bf16.jsonl", "bf16", [3.0, 2.0], {2: 2.0})
    other = _write_log(tmp_path / "fp8.jsonl", "fp8", [3.0, 2.0], {2: 2.0}, seed=1, lr=0.1)
    with pytest.raises(SystemExit, match=r"fp8.jsonl was not trained like the reference .*train.seed: 1 != 0"):
        summary.main([str(bf16), str(other)])
    result = summary.main([str(bf16), str(other), "--allow-mismatch"])
    assert "train.lr: 0.1 != None" in result["notes"][0] and "differs from the reference" in capsys.readouterr().out
    second = _write_log(tmp_path / "c" / "bf16.jsonl", "bf16", [3.0, 2.0], {2: 2.0})
    with pytest.raises(SystemExit, match="2 logs ran recipe bf16.*--bf16 FILE"):
        summary.main([str(bf16), str(second)])


def test_plot_loss_adds_a_panel_relative_to_the_baseline(tmp_path):
    pytest.importorskip("matplotlib")
    from dtq.launch import plot_loss

    base = _write_log(tmp_path / "bf16" / "metrics.jsonl", "bf16", [4.0, 3.0, 2.0], {3: 2.0})
    run = _write_log(tmp_path / "fp8" / "metrics.jsonl", "fp8", [4.1, 3.1, 2.1], {3: 2.1})
    plain = plot_loss.main([str(base.parent), str(run.parent), "-o", str(tmp_path / "a.png")])
    both = plot_loss.main([str(base.parent), str(run.parent), "-o", str(tmp_path / "b.png"), "--baseline", str(base)])
    assert both.read_bytes()[:8] == PNG_MAGIC
    assert both.stat().st_size > plain.stat().st_size  # the second panel
    with pytest.raises(ValueError, match="has no training records"):
        (tmp_path / "empty.jsonl").write_text("")
        plot_loss.plot([str(run)], str(tmp_path / "c.png"), baseline=str(tmp_path / "empty.jsonl"))
