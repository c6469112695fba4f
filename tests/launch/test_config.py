"""The trainer's pieces in-process: config validation and its error messages, recipes by name,
shape pre-checks, the data order, the LR schedule, the metrics log and the loss plot."""

import dataclasses
import io
import json
import sys

import pytest
import torch

import dtq
from dtq.launch import (
    checkpointing,
    config,
    data,
    metrics,
    optim,
    parallel,
    plot_loss,
    preflight,
    progress,
)
from dtq.launch import train as train_mod
from dtq.launch.model import Decoder, rotary, rotary_table
from dtq.launch.recipes import RECIPES, build_recipe
from dtq.testing import spawn

TINY = "launch/configs/tiny.toml"


def test_tiny_config_loads_and_overrides_apply():
    cfg = config.load(TINY, ["train.steps=7", "train.recipe=fp8", "model.tie_embeddings=false"])
    assert (cfg.train.steps, cfg.train.recipe, cfg.model.tie_embeddings) == (7, "fp8", False)
    assert (cfg.model.hidden, cfg.model.ffn_hidden, cfg.train.batch_size * cfg.model.seq_len) == (256, 512, 256)


def test_unknown_recipe_lists_the_valid_ones():
    with pytest.raises(ValueError) as e:
        config.load(None, ["train.recipe=fp4"])
    for name in RECIPES:
        assert name in str(e.value)
    assert "module:function" in str(e.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stepz=3", "unknown key train.stepz; valid keys of train: steps, batch_size"),
        ("trian.steps=3", "unknown table trian; valid tables: model, data, train, parallel"),
        ("model.hidden=250", "must be a multiple of model.heads"),
        ("train.offload=gpu", "train.offload = 'gpu': Input should be 'none', 'save_on_cpu' or 'dtq'"),
        ("model.kv_heads=2", 'only used by kind = "hf_llama"'),
        ("train.steps=0", "train.steps = 0: Input should be greater than 0"),
        ("parallel.replicate=0", "parallel.replicate = 0: Input should be greater than 0"),
        ("train.keep_checkpoints=-1", "train.keep_checkpoints = -1: Input should be greater than or equal to 0"),
        ("model.vocab=100", "model.vocab = 100: Input should be greater than or equal to 256"),
        ("train.backward_thread=main", "train.backward_thread = 'main': Input should be 'caller' or 'autograd'"),
    ],
)
def test_bad_configs_say_what_to_change(override, message):
    with pytest.raises(ValueError, match=message):
        config.load(None, [override])


def test_quantized_params_need_a_quantizing_recipe():
    with pytest.raises(ValueError, match="quantized_params = true needs a quantizing recipe"):
        config.load(None, ["train.recipe=bf16", "train.quantized_params=true"])


def test_recipes_by_name_and_by_factory():
    assert build_recipe("bf16") is None
    assert build_recipe("hybrid") == dtq.hybrid_recipe(
        dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling(), weight_columnwise_source="rowwise_dequantized"
    )
    assert build_recipe("hybrid-original") == dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling())
    for name in RECIPES:
        build_recipe(name)  # every preset builds
    assert build_recipe("dtq:MXFP8BlockScaling") == dtq.MXFP8BlockScaling()
    assert build_recipe("fp8", "dequantized").backward_override == "dequantized"
    with pytest.raises(TypeError, match="must give a dtq recipe"):
        build_recipe("os:getcwd")
    with pytest.raises(ValueError, match="cannot import"):
        build_recipe("dtq:NoSuchRecipe")
    with pytest.raises(ValueError, match="HybridRecipe with backward_override"):  # dtq's own check
        build_recipe("hybrid", "high_precision")


def test_tensor_parallel_config_errors():
    with pytest.raises(ValueError, match="parallel.sequence_parallel = true needs parallel.tp > 1"):
        config.load(None, ["parallel.sequence_parallel=true"])
    cfg = config.load(None, ["parallel.tp=2", "model.kind=hf_llama"])
    with pytest.raises(ValueError, match='parallel.tp = 2 needs model.kind = "dtq"'):
        parallel.apply_tensor_parallel(None, None, cfg)
    cfg = config.load(None, ["parallel.tp=3", "model.heads=4"])

    class _Mesh(dict):  # only its "tp" size is read before the check
        def __getitem__(self, key):
            return type("M", (), {"size": lambda self: 3})()

    with pytest.raises(ValueError, match="model.heads = 4 must be divisible by parallel.tp = 3"):
        parallel.apply_tensor_parallel(None, _Mesh(), cfg)
    with pytest.raises(ValueError, match=r"parallel.tp \* parallel.replicate = 2 \* 3 must divide the world size 4"):
        parallel.make_mesh(torch.device("cpu"), 4, 2, 3)  # raises before any process group is needed


def _decoder(*overrides):
    cfg = config.load(TINY, list(overrides))
    torch.manual_seed(0)
    return Decoder(cfg.model), cfg


def test_preflight_accepts_the_tiny_shapes_for_every_recipe():
    model, cfg = _decoder()
    for name in RECIPES:
        preflight.check_shapes(model, build_recipe(name), cfg.train.batch_size * cfg.model.seq_len, 2)


def test_preflight_explains_which_dims_must_be_multiples_of_what():
    model, _ = _decoder("model.hidden=200", "model.ffn_hidden=400")
    with pytest.raises(ValueError) as e:
        preflight.check_shapes(model, build_recipe("mxfp8"), 256, 1)
    assert "multiple of the MX block size 32" in str(e.value) and "model.hidden" in str(e.value)
    model, _ = _decoder()
    with pytest.raises(ValueError, match=r"train.batch_size \* model.seq_len.*multiple of 16"):
        preflight.check_shapes(model, build_recipe("nvfp4"), 24, 1)
    with pytest.raises(ValueError, match=r"FSDP2 over 4 ranks gives shards of 64 rows.*multiple of 128"):
        preflight.check_shapes(model, build_recipe("fp8-block"), 256, 4)


def test_preflight_checks_tensor_parallel_shards():
    """Row-parallel weights (attn.proj, mlp fc2) halve K per TP rank, column-parallel ones N: a
    hidden size MXFP8 takes whole can leave shards it cannot block."""
    model, cfg = _decoder()  # hidden 256
    dims = parallel.tp_weight_dims(model)
    tokens = cfg.train.batch_size * cfg.model.seq_len
    preflight.check_shapes(model, build_recipe("mxfp8"), tokens, 1)
    preflight.check_shapes(model, build_recipe("mxfp8"), tokens, 1, tp=8, tp_dims=dims)  # K = 32 per rank
    with pytest.raises(ValueError, match=r"attn.proj input .*this rank's parallel.tp shard.*multiple of the MX block"):
        preflight.check_shapes(model, build_recipe("mxfp8"), tokens, 1, tp=16, tp_dims=dims)  # K = 16 per rank
    with pytest.raises(ValueError, match=r"parallel.tp = 3 does not divide its dim 0"):
        preflight.check_shapes(model, build_recipe("fp8"), tokens, 1, tp=3, tp_dims=dims)


def test_corpus_is_the_stdlib_in_sorted_order():
    files = data.stdlib_files()
    assert files and all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    tokens = data.load_corpus(200_000)
    assert tokens.dtype == torch.uint8 and tokens.numel() == 200_000
    assert bytes(tokens[:64].tolist()) == files[0].read_bytes()[:64]


def test_data_order_is_resumable_and_ranks_read_disjoint_samples():
    tokens = data.load_corpus(100_000)
    a, b = data.ByteWindows(tokens, 64, seed=3), data.ByteWindows(tokens, 64, seed=3)
    x0, y0 = a.batch(0, 4)
    x1, _ = a.batch(4, 4)  # rank 1 of 2 at the same step
    assert x0.shape == (4, 64) and torch.equal(x0[:, 1:], y0[:, :-1])
    assert not any(torch.equal(r, s) for r in x0 for s in x1)
    # A fresh reader (a resumed run) reads the same samples at any position, past an epoch too.
    assert torch.equal(a.batch(a.count + 5, 3)[0], b.batch(a.count + 5, 3)[0])
    assert not torch.equal(a.batch(a.count, 4)[0], a.batch(0, 4)[0])  # a new epoch, a new order


def test_batches_reach_the_device_as_their_values():
    """``data.to_device`` (the trainer's batch copy) gives the batch's values on the device (on a
    GPU from pinned memory, copied contiguous first); its point there, not waiting for the stream,
    is tested with the stream's synchronisation check (below)."""
    rows = torch.arange(3 * 9).reshape(3, 9)
    x, y = rows[:, :-1], rows[:, 1:]  # the strided views ByteWindows.batch returns
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = data.to_device((x, y), dev)
    assert [t.device.type for t in out] == [dev.type] * 2
    assert torch.equal(out[0].cpu(), x) and torch.equal(out[1].cpu(), y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_batch_copy_does_not_wait_for_the_previous_step():
    """A pageable ``.to("cuda")`` synchronizes the stream: every step would start after the previous
    one ended, with an empty launch queue (the FP8 trainer step is host-bound on the GPU machines)."""
    rows = torch.arange(4 * 65).reshape(4, 65)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x, y = data.to_device((rows[:, :-1], rows[:, 1:]), torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(x.cpu(), rows[:, :-1]) and torch.equal(y.cpu(), rows[:, 1:])


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    tc = config.TrainConfig(steps=20, lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    assert [optim.lr_at(s, tc) for s in (1, 4)] == [0.25, 1.0]
    assert optim.lr_at(20, tc) == pytest.approx(0.1)
    assert all(optim.lr_at(s, tc) >= optim.lr_at(s + 1, tc) for s in range(4, 20))


def test_rotary_preserves_norms_and_is_relative():
    q = torch.randn(1, 2, 8, 16)
    r = rotary(q, 10000.0)
    assert torch.allclose(r.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    assert torch.equal(r[..., 0, :], q[..., 0, :])  # position 0 is not rotated
    # the decoder's once-per-step table gives the bits of the angles computed in place
    assert torch.equal(rotary(q, 10000.0, rotary_table(8, 16, 10000.0, q.device)), r)


@pytest.mark.usefixtures("fresh_dynamo")
def test_attention_backward_concatenates_qkvs_gradients():
    """q, k and v are split from the QKV output, not unpacked: compiled backward then concatenates
    their gradients into qkv's [seq, batch, heads, 3, head_dim] view. Unpacked (dynamo traces one
    select each), backward summed three zero-filled gradients, and inductor's amax over qkv's
    gradient read every source for every element (42 against 53 us a layer at the 1.07 B shapes
    on an H200)."""
    from dtq.launch.config import ModelConfig
    from dtq.launch.model import Attention
    from tests._aot import capturing_backend

    torch.manual_seed(0)
    attn = Attention(ModelConfig(hidden=64, heads=2, ffn_hidden=128, layers=1, seq_len=8), "attn")
    x = torch.randn(8, 2, 64, requires_grad=True)
    backend, graphs = capturing_backend()
    torch.compile(attn, backend=backend, fullgraph=True)(x).sum().backward()
    _, backward = graphs
    backward_ops = [  # (op, output shape)
        (str(n.target), tuple(n.meta["val"].shape) if isinstance(n.meta.get("val"), torch.Tensor) else None)
        for n in backward.graph.nodes
        if n.op == "call_function"
    ]
    assert not [op for op, _ in backward_ops if "select_backward" in op], backward_ops
    # (RoPE's backward has a concatenation of its own, of q's and k's halves)
    assert ("aten.cat.default", (8, 2, 2, 3, 32)) in backward_ops, backward_ops


def test_metrics_log_drops_records_after_the_resumed_step(tmp_path):
    log = metrics.MetricsLog(tmp_path / "m.jsonl", True)
    for step in (1, 2, 3):
        log.write({"kind": "train", "step": step, "loss": 1.0 / step})
    metrics.MetricsLog(tmp_path / "m.jsonl", True, resume_step=2)
    assert [r["step"] for r in metrics.read(tmp_path / "m.jsonl")] == [1, 2]
    line = metrics.progress_line(
        {
            "step": 2,
            "loss": 3.14159,
            "lr": 1e-3,
            "tokens_per_s": 12345.6,
            "gathered_bytes": {"mxfp8/rowwise": 1_350_000},
        },
        30,
    )
    assert line == "step  2/30 | loss 3.1416 | lr 1.0e-03 | 12,346 tok/s | gathered 1.35 MB (mxfp8/rowwise 1.35 MB)"


def _log(path, losses):
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for i, loss in enumerate(losses, 1):
            f.write(json.dumps({"kind": "train", "step": i, "loss": loss}) + "\n")
        f.write(json.dumps({"kind": "eval", "step": len(losses), "val_loss": losses[-1]}) + "\n")


def test_plot_loss_writes_one_png_for_several_runs(tmp_path):
    pytest.importorskip("matplotlib")
    _log(tmp_path / "bf16", [5.0, 4.0, 3.0])
    _log(tmp_path / "hybrid", [5.1, 4.1, 3.1])
    out = plot_loss.main(
        [str(tmp_path / "bf16"), str(tmp_path / "hybrid" / "metrics.jsonl"), "-o", str(tmp_path / "loss.png")]
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_loss_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    _log(tmp_path / "run", [1.0])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match=r"pip install 'dtq\[plot\]'"):
        plot_loss.plot([str(tmp_path / "run")], str(tmp_path / "x.png"))


def test_config_round_trips_through_its_dict():
    cfg = config.load(TINY)
    assert config.from_dict(cfg.to_dict()) == cfg
    assert dataclasses.replace(cfg.train, backward_override="none").backward_override is None


def test_quantized_gather_off_refuses_quantized_params():
    assert config.load(TINY, ["parallel.quantized_gather=false"]).parallel.quantized_gather is False
    with pytest.raises(ValueError, match=r"quantized_gather = false needs train.quantized_params = false"):
        config.load(TINY, ["parallel.quantized_gather=false", "train.quantized_params=true"])


def _quantized_gather_decisions(rank, world, hosts):
    import socket

    socket.gethostname = lambda: hosts[rank]  # this rank's host, as the collective reports it
    flat = parallel.data_parallel_mesh(parallel.make_mesh(torch.device("cpu"), world, tp=1))
    hsdp = parallel.data_parallel_mesh(parallel.make_mesh(torch.device("cpu"), world, tp=1, replicate=2))
    spans = len(set(hosts)) > 1
    assert parallel.quantized_gather("auto", flat, quantized_params=False) is spans
    # HSDP with one rank per replica: each weight's shards lie on one rank, whatever the hosts
    assert parallel.quantized_gather("auto", hsdp, quantized_params=False) is False
    for setting in (True, False):
        assert parallel.quantized_gather(setting, flat, quantized_params=False) is setting
    assert parallel.quantized_gather("auto", flat, quantized_params=True) is True  # gathered as stored


@pytest.mark.parametrize("hosts", [("node-a", "node-a"), ("node-a", "node-b")], ids=["one_host", "two_hosts"])
def test_quantized_gather_auto_quantizes_only_gathers_across_hosts(hosts):
    """``parallel.quantized_gather = "auto"`` (the default) asks the FSDP2 shard group for its
    hosts over a real gloo collective: plain gathers within one host, quantized across hosts."""
    assert config.load(None).parallel.quantized_gather == "auto"
    assert config.load(TINY, ["parallel.quantized_gather=auto", "train.quantized_params=true"]).train.quantized_params
    spawn(_quantized_gather_decisions, 2, hosts, backend="gloo")


def test_quantized_params_optimizer_groups_and_lr_after_resume():
    """build_optimizer gives MasterWeightOptimizer's masters two AdamW groups (no decay on norms
    and embeddings), and set_lr still reaches the inner optimizer after load_state_dict (which
    replaces the inner optimizer's param_groups list)."""
    cfg = config.load(TINY, ["train.quantized_params=true"])
    torch.manual_seed(0)
    model = dtq.convert(
        Decoder(cfg.model), recipe=build_recipe("hybrid"), quantized_params=True, module_filter_fn=lambda m, fqn: False
    )
    opt = optim.build_optimizer(model, cfg.train)
    assert isinstance(opt, dtq.optim.MasterWeightOptimizer) and len(opt.masters) == 8  # qkv, proj, fc1, fc2 x 2 layers
    decay, no_decay = opt.inner.param_groups
    assert {id(p) for p in decay["params"]} == {id(m) for m in opt.masters}
    assert (
        no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 6
    )  # 2 norms x 2 layers, final norm, tied embedding
    opt.load_state_dict(opt.state_dict())
    optim.set_lr(opt, 0.125)
    assert [g["lr"] for g in opt.inner.param_groups] == [0.125, 0.125]


def test_the_300m_config_fits_every_recipe_on_4_ranks():
    cfg = config.load("launch/configs/llama300m.toml")
    with torch.device("meta"):  # shapes only: nothing is allocated or initialized
        model = Decoder(cfg.model)
    n = sum(p.numel() for p in model.parameters())
    assert 300e6 < n < 320e6
    for name in ("bf16", "fp8", "fp8-block", "fp8-row", "mxfp8", "nvfp4", "hybrid"):
        preflight.check_shapes(model, build_recipe(name), cfg.train.batch_size * cfg.model.seq_len, 4)


def test_the_1b_config_fits_every_recipe_in_each_8_gpu_layout():
    """FSDP2 over 8, HSDP 2 x 4 (shards over 4) and FSDP2 4 x TP 2 (column-parallel weights split
    over 8, row-parallel ones halve K): every recipe's blocks fit every shard."""
    cfg = config.load("launch/configs/llama1b.toml")
    with torch.device("meta"):
        model = Decoder(cfg.model)
    n = sum(p.numel() for p in model.parameters())
    assert 1.0e9 < n < 1.1e9
    tokens = cfg.train.batch_size * cfg.model.seq_len
    for name in ("bf16", "fp8", "fp8-block", "fp8-row", "mxfp8", "nvfp4", "hybrid"):
        for shards in (8, 4):
            preflight.check_shapes(model, build_recipe(name), tokens, shards)
        preflight.check_shapes(model, build_recipe(name), tokens, 4, tp=2, tp_dims=parallel.tp_weight_dims(model))
    assert cfg.model.heads % 2 == 0 and cfg.model.seq_len % 2 == 0


def test_the_1b_single_gpu_config_is_the_1b_model_and_fits_every_recipe_on_1_rank():
    """llama1b_1gpu.toml (bench/fidelity_study.sh) lowers llama1b.toml to one GPU: the same model,
    data and peak learning rate, 300 steps; every recipe of the study fits its shapes unsharded."""
    cfg = config.load("launch/configs/llama1b_1gpu.toml")
    four = config.load("launch/configs/llama1b.toml")
    assert cfg.model == four.model and cfg.data == four.data
    assert (cfg.train.lr, cfg.train.min_lr_ratio, cfg.train.dtype) == (
        four.train.lr,
        four.train.min_lr_ratio,
        "bfloat16",
    )
    assert (cfg.train.steps, cfg.train.batch_size, cfg.train.eval_every, cfg.train.checkpoint_every) == (300, 4, 50, 0)
    with torch.device("meta"):
        model = Decoder(cfg.model)
    tokens = cfg.train.batch_size * cfg.model.seq_len
    for name in ("bf16", "fp8", "fp8-block", "fp8-row", "mxfp8", "nvfp4", "hybrid", "nvfp4_1d_weight"):
        preflight.check_shapes(model, build_recipe(name), tokens, 1)


def test_progress_line_shows_collectives_step_time_and_peak_memory():
    rec = {
        "step": 20,
        "loss": 3.0,
        "lr": 1e-3,
        "tokens_per_s": 1234.0,
        "step_s": 0.095,
        "gathered_bytes": {"fp8/rowwise": 2_000_000},
        "collective_bytes": {"reduce_scattered": 4_000_000},
        "peak_memory_bytes": 3 * 2**30,
    }
    line = metrics.progress_line(rec, 40)
    assert line.endswith(
        "gathered 2.00 MB (fp8/rowwise 2.00 MB) | reduce-scattered 4.00 MB | 95 ms/step | peak 3.0 GiB"
    )
    assert "peak" not in metrics.progress_line({**rec, "peak_memory_bytes": None}, 40)  # CPU


def test_collective_counter_restores_torch_distributed_on_exit():
    import torch.distributed as dist

    before = {name: getattr(dist, name) for name in metrics.CollectiveBytes._WRAPPED if hasattr(dist, name)}
    with metrics.CollectiveBytes() as counter:
        assert all(getattr(dist, name) is not fn for name, fn in before.items())
    assert all(getattr(dist, name) is fn for name, fn in before.items()) and counter.take() == {}


def _save_with_histories(rank, world, path):
    torch.manual_seed(0)
    model = dtq.convert(torch.nn.Sequential(torch.nn.Linear(16, 16)), recipe=dtq.DelayedScaling(amax_history_len=4))
    model[0].amax_history_0_input.copy_(torch.tensor([4.0, 3.0, 2.0, 1.0]))  # equal on every rank, as shared
    opt = torch.optim.AdamW(model.parameters())
    checkpointing.save(path, 1, model, opt, {"step": 1, "samples": 2, "world_size": world}, torch.device("cpu"))


def _load_on_more_ranks(rank, world, path):
    import warnings

    torch.manual_seed(1)
    model = dtq.convert(torch.nn.Sequential(torch.nn.Linear(16, 16)))  # no histories yet
    opt = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "written by 2 ranks, this run has 4"
        state = checkpointing.load(checkpointing.checkpoint_dir(path, 1), model, opt, torch.device("cpu"))
    assert state["step"] == 1
    assert torch.equal(model[0].amax_history_0_input, torch.tensor([4.0, 3.0, 2.0, 1.0])), rank


def test_resume_on_more_ranks_takes_rank0_histories(tmp_path):
    """Ranks a checkpoint has no entries for (a resume on a larger world) start from rank 0's
    delayed-scaling histories, which the trainer keeps equal on every rank."""
    spawn(_save_with_histories, 2, str(tmp_path), backend="gloo")
    spawn(_load_on_more_ranks, 4, str(tmp_path), backend="gloo")


def test_overrides_are_checked_against_the_field_types():
    from dtq.launch import config as config_mod

    cfg = config_mod.load(
        None,
        [
            "train.recompute=False",
            "train.quantized_params=no",
            "train.compile=TRUE",
            "train.lr=1",
            "train.out_dir=2024",
        ],
    )
    assert cfg.train.recompute is False and cfg.train.quantized_params is False and cfg.train.compile is True
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float) and cfg.train.out_dir == "2024"
    for override, message in [
        ("train.steps=abc", "config: train.steps = 'abc': Input should be a valid integer"),
        ("train.steps=true", "config: train.steps = True: Input should be a valid integer"),
        ("train.steps=2.5", "config: train.steps = 2.5: Input should be a valid integer"),
        (
            "train.recompute=maybe",
            "config: train.recompute = 'maybe': Input should be a valid boolean, unable to interpret input",
        ),
        ("train.lr=fast", "config: train.lr = 'fast': Input should be a valid number"),
    ]:
        with pytest.raises(config_mod.ConfigError) as e:
            config_mod.load(None, [override])
        assert str(e.value) == message


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_an_interactive_terminal(capsys):
    """A tqdm bar over the steps is drawn on rank 0 into a terminal only, beside the log lines,
    which read the same with or without it; a pipe (CI, a log file) never gets one."""
    pytest.importorskip("tqdm")
    terminal = _Terminal()
    console = progress.Console(True, total=4, initial=1, stream=terminal)
    assert console.has_bar
    console.step()
    console.print("step 2/4 | loss 1.0000")
    console.step(loss=1.0)
    console.close()
    assert "1/4" in terminal.getvalue() and "step 2/4" not in terminal.getvalue()
    assert capsys.readouterr().out == "step 2/4 | loss 1.0000\n"
    for stream, enabled, bar in [(io.StringIO(), True, True), (_Terminal(), False, True), (_Terminal(), True, False)]:
        console = progress.Console(enabled, total=4, stream=stream, bar=bar)  # a pipe; rank 1; progress_bar = false
        console.step()
        console.print("step 1/4")
        console.close()
        assert not console.has_bar and stream.getvalue() == ""
        assert capsys.readouterr().out == ("step 1/4\n" if enabled else "")


def test_reshard_after_forward_auto_keeps_weights_gathered_on_one_shard():
    """ "auto" (the default) reshards only when FSDP2 shards over more than one rank; explicit
    booleans (TOML or the words the other boolean keys take) are kept as given."""
    assert config.load(TINY).parallel.reshard_after_forward == "auto"
    assert parallel.reshard_after_forward("auto", 1) is False
    assert parallel.reshard_after_forward("auto", 2) is True
    for word, value in (("false", False), ("no", False), ("true", True)):
        setting = config.load(TINY, [f"parallel.reshard_after_forward={word}"]).parallel.reshard_after_forward
        assert setting is value and parallel.reshard_after_forward(setting, 1) is value
    refused = r"parallel.reshard_after_forward = 'sometimes': Input should be a valid boolean.*, or 'auto'$"
    with pytest.raises(config.ConfigError, match=refused):
        config.load(TINY, ["parallel.reshard_after_forward=sometimes"])


def test_fsdp_units_auto_is_the_root_in_a_one_rank_job_only():
    """ "auto" puts FSDP2 on the root only where the whole job is one rank (TP ranks count) and
    the blocks keep their gathered weights; an explicit choice is kept; "root" with blocks that
    would reshard after forward is refused (the root never reshards)."""
    assert config.load(TINY).parallel.fsdp_units == "auto"
    assert parallel.fsdp_units("auto", 1, reshard=False) == "root"
    assert parallel.fsdp_units("auto", 1, reshard=True) == "blocks"  # (reshard_after_forward=true asked for)
    assert parallel.fsdp_units("auto", 2, reshard=False) == "blocks"  # (HSDP with one rank per replica too)
    assert parallel.fsdp_units("blocks", 1, reshard=False) == "blocks"
    assert parallel.fsdp_units("root", 4, reshard=False) == "root"
    refused = r"parallel.fsdp_units = 'leaves': Input should be 'auto', 'blocks' or 'root'"
    with pytest.raises(config.ConfigError, match=refused):
        config.load(TINY, ["parallel.fsdp_units=leaves"])
    refused = r'parallel.fsdp_units = "root" never reshards after forward.*reshard_after_forward = false or "auto"'
    with pytest.raises(ValueError, match=refused):
        config.load(TINY, ["parallel.fsdp_units=root", "parallel.reshard_after_forward=true"])
    assert config.load(TINY, ["parallel.fsdp_units=root", "parallel.reshard_after_forward=false"])


def _units_on_one_rank(rank, world):
    from torch.distributed.fsdp import FSDPModule

    from dtq.launch.model import build_model

    for setting, sharded in (("auto", ["root"]), ("blocks", ["root", "layers.0", "layers.1"])):
        cfg = config.load(TINY, [f"parallel.fsdp_units={setting}"])
        mesh = parallel.make_mesh(torch.device("cpu"), world, 1)
        units = parallel.fsdp_units(cfg.parallel.fsdp_units, world, reshard=False)
        model = parallel.parallelize(build_model(cfg.model), mesh, cfg, gather_quantized=False, units=units)
        assert [n or "root" for n, m in model.named_modules() if isinstance(m, FSDPModule)] == sharded
        with pytest.raises(ValueError, match=r"parallelize: units = 'auto'; \"blocks\" or \"root\""):
            parallel.parallelize(build_model(cfg.model), mesh, cfg, gather_quantized=False, units="auto")


def test_parallelize_shards_the_root_only_where_fsdp_units_says_so():
    """The decision reaches FSDP2: with "root" no block is a ``fully_shard`` unit of its own."""
    spawn(_units_on_one_rank, 1, backend="gloo")


def test_optimizer_is_multi_tensor_adamw_on_cpu():
    """The fused AdamW kernel is for GPUs (where it spares the multi-tensor version's host time);
    CPU runs keep torch's default implementation, whose bits the CPU tests were written against."""
    cfg = config.load(TINY)
    opt = optim.build_optimizer(Decoder(cfg.model), cfg.train)
    assert type(opt) is torch.optim.AdamW and not opt.defaults["fused"]


@pytest.mark.parametrize("thread", ["caller", "autograd"])
def test_backward_runs_on_the_thread_the_config_names(thread):
    # train.backward_thread: "caller" turns torch's worker thread per device off for the step's
    # backward (what a GPU backward then runs on); "autograd" leaves it on
    seen = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(torch._C._is_multithreading_enabled()))
    train_mod.run_backward(y.sum(), thread)
    assert seen == [thread == "autograd"]
    assert torch._C._is_multithreading_enabled()  # the setting is the step's only
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def _rotary_table_under_mixed_precision(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dtq.launch.model import build_model

    cfg = config.load(TINY, [])
    tokens = torch.randint(0, cfg.model.vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    outs = []
    for own_table in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg.model)
        if own_table:  # each block computes the angles itself, as before the decoder's table
            model.rotary = lambda seq, device: None
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)  # (casts floating tensors in its arguments)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        outs.append(model(tokens))
    assert torch.equal(outs[0], outs[1])


def test_the_decoders_rotary_table_reaches_its_blocks_in_fp32_under_fsdp2_mixed_precision():
    """The decoder makes the table once per sequence length and hands it to every block; FSDP2's
    BF16 mixed precision would round a table passed as a tuple of tensors (it casts a block's
    floating tensor arguments), which changed q and k against the blocks' own fp32 angles."""
    spawn(_rotary_table_under_mixed_precision, 1, backend="gloo")
