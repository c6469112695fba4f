"""The example trainer: a byte-level Llama-style decoder on the Python standard library's source,
sharded with FSDP2, its GEMMs quantized by a dtq recipe chosen by name.

Start it any way you like; the process group is set up from what the launcher left behind
(dtq/launch/dist.py). ``dtq-train`` (the installed command), ``python -m dtq.launch.train`` and a
checkout's ``launch/train.py`` are the same program::

    dtq-train --config launch/configs/tiny.toml                                     # one process
    torchrun --standalone --nproc-per-node 2 launch/train.py --config launch/configs/tiny.toml
    torchrun --standalone --nproc-per-node 2 -m dtq.launch.train --config my.toml
    mpirun -np 2 dtq-train --config launch/configs/tiny.toml
    srun --ntasks-per-node 4 --gpus-per-node 4 dtq-train --config ...

Options override the config file (``--set table.key=value`` for any key); ``--resume`` continues
from the newest checkpoint in ``train.out_dir``. A run without it refuses an ``out_dir`` that
already has checkpoints unless ``--overwrite`` (delete them and the metrics log) is given. See
docs/training.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shutil
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dtq
from dtq.distributed import collective
from dtq.launch import checkpointing, data, metrics, optim, parallel, preflight, progress
from dtq.launch import config as config_mod
from dtq.launch import dist as launch_dist
from dtq.launch.model import build_model
from dtq.launch.recipes import build_recipe


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML config file (default: the built-in tiny model)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="TABLE.KEY=VALUE",
        help="override one config key, e.g. --set train.steps=100 (repeatable)",
    )
    p.add_argument("--recipe", help="shorthand for --set train.recipe=NAME")
    p.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")
    p.add_argument("--out-dir", help="shorthand for --set train.out_dir=PATH")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in train.out_dir")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the checkpoints and metrics log already in train.out_dir and start fresh",
    )
    p.add_argument(
        "--launcher",
        default="auto",
        choices=launch_dist.LAUNCHERS,
        help="how this process was started (default: detected from the environment)",
    )
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> config_mod.Config:
    overrides = list(args.set)
    for flag, key in (("recipe", "train.recipe"), ("steps", "train.steps"), ("out_dir", "train.out_dir")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value!s}" if flag == "steps" else f'{key}="{value}"')
    return config_mod.load(args.config, overrides)


# The settings that decide how GEMMs and weights are quantized: a checkpoint records them (run.json).
RECIPE_KEYS = ("recipe", "backward_override", "quantized_params", "size_rule")
DEFAULTS = {"size_rule": "off"}  # what a checkpoint written before a key existed ran with


def recipe_settings(tc: config_mod.TrainConfig) -> dict:
    return {k: getattr(tc, k) for k in RECIPE_KEYS}


def recipe_change(checkpoint: pathlib.Path, tc: config_mod.TrainConfig) -> dict | None:
    """``{key: [the checkpoint's value, this run's]}`` for each recipe setting that differs between
    the run that wrote ``checkpoint`` and this one; None when none does (or the checkpoint has no
    ``run.json``). A change is allowed (the trainer warns and marks it in the metrics log), except
    with quantized parameters, which are stored in the recipe's formats: then it is a
    :class:`~dtq.launch.config.ConfigError`."""
    saved = checkpointing.read_run_info(checkpoint)
    if saved is None:
        return None
    saved = {**DEFAULTS, **saved}
    changed = {k: [saved.get(k), v] for k, v in recipe_settings(tc).items() if saved.get(k) != v}
    if changed and (saved.get("quantized_params") or tc.quantized_params):
        raise config_mod.ConfigError(
            f"config: --resume: {checkpoint} stores quantized weights in the formats of its run's settings "
            f"({_settings(saved)}) and cannot be loaded with {_settings(recipe_settings(tc))}; resume with its "
            "settings, or start a new run (--overwrite, or another train.out_dir)"
        )
    return changed or None


def _settings(values: dict) -> str:
    return ", ".join(f"train.{k} = {v!r}" for k, v in values.items())


def prepare_out_dir(
    tc: config_mod.TrainConfig, resume: bool, overwrite: bool
) -> tuple[pathlib.Path | None, dict | None]:
    """Decide on rank 0 what this run does with ``tc.out_dir`` and tell every rank; returns the
    checkpoint to resume from (None: start at step 0) and the :func:`recipe_change` against it.

    A run without ``resume`` into an ``out_dir`` that has checkpoints is refused (a
    :class:`~dtq.launch.config.ConfigError` on every rank): it would leave them beside its own, and
    a later ``--resume`` could continue the older run. ``overwrite`` deletes them and the metrics
    log first. A checkpoint that a crash left renamed aside is put back, and temporary
    directories of saves that never committed are deleted. Every rank waits until rank 0 is
    done with the files."""
    out_dir = tc.out_dir
    decision: list = [None, None, None]  # [checkpoint to resume from, error message, recipe change]
    if dist.get_rank() == 0:
        checkpointing.recover(out_dir)
        found = checkpointing.latest(out_dir)
        if found is not None and not resume and not overwrite:
            decision[1] = (
                f"config: train.out_dir {out_dir!r} already has checkpoints of an earlier run (newest: "
                f"step {checkpointing.step_of(found)}); pass --resume to continue that run, or "
                "--overwrite to delete its checkpoints and metrics log and start fresh"
            )
        else:
            try:
                if overwrite:
                    if (pathlib.Path(out_dir) / "checkpoints").exists():
                        shutil.rmtree(pathlib.Path(out_dir) / "checkpoints")
                    (pathlib.Path(out_dir) / "metrics.jsonl").unlink(missing_ok=True)
                    found = None
                checkpointing.remove_stale(out_dir)
            except OSError as e:
                decision[1] = f"--overwrite: cannot delete the old run's files in {out_dir!r}: {e}"
            decision[0] = str(found) if resume and found is not None else None
            if decision[0] is not None:
                try:
                    decision[2] = recipe_change(found, tc)
                except config_mod.ConfigError as e:
                    decision[1] = str(e)
    dist.broadcast_object_list(decision, src=0)  # the barrier too: rank 0 has finished with the files
    if decision[1] is not None:
        raise config_mod.ConfigError(decision[1])
    return (pathlib.Path(decision[0]) if decision[0] is not None else None), decision[2]


def activation_memory(cfg: config_mod.TrainConfig, device: torch.device):
    """The context that decides where saved activations live during forward."""
    if cfg.offload == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
    if cfg.offload == "dtq":
        return dtq.parallel.offload()
    return contextlib.nullcontext()


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def run_backward(loss: torch.Tensor, thread: str) -> None:
    """``loss.backward()`` on the thread ``train.backward_thread`` names. "caller" keeps autograd's
    GPU work on this thread: torch's worker thread per device costs host time per op, and a
    quantized step has more ops to launch (bench/results/train1b_1gpu_h200_backward_thread_9cf98e2.txt)."""
    with torch.autograd.set_multithreading_enabled(thread == "autograd"):
        loss.backward()


def quantized(recipe):
    """``dtq.autocast`` of ``recipe`` (None: BF16). Delayed-scaling amax histories are reduced over
    every rank, so all ranks use one scale per tensor and hold the same histories."""
    delayed = recipe is not None and recipe.delayed and dist.get_world_size() > 1
    return dtq.autocast(recipe, enabled=recipe is not None, amax_group=dist.group.WORLD if delayed else None)


def apply_size_rule(model, recipe, setting: str, tokens: int, device) -> tuple[dict, int, str] | None:
    """``train.size_rule = "auto"``: keep the dtq modules whose GEMMs are too small to gain from
    ``recipe`` (at ``tokens`` per GEMM, on ``device``) in high precision. Returns (kept modules,
    dtq modules, the rule's source), or None when no rule applies."""
    if setting == "off" or recipe is None:
        return None
    try:
        rule = dtq.SizeRule.measured(recipe, tokens=tokens, device=device)
    except ValueError as e:
        raise config_mod.ConfigError(f'config: train.size_rule = "auto": {e}') from None
    kept = dtq.apply_size_rule(model, rule)
    total = sum(isinstance(m, dtq.nn.QuantizedModule) for m in model.modules())
    return kept, total, rule.source


@torch.no_grad()
def evaluate(model, val: data.ByteWindows, cfg: config_mod.Config, recipe, device, rank: int, world: int) -> float:
    """Mean validation loss over ``eval_batches`` fixed batches (the same ones every time)."""
    model.eval()
    total = torch.zeros((), device=device)
    b = cfg.train.batch_size
    for i in range(cfg.train.eval_batches):
        x, y = val.batch((i * world + rank) * b, b)
        with quantized(recipe):
            total += lm_loss(model, *data.to_device((x, y), device))
    collective.run(dist.all_reduce, total)  # the tp ranks of a replica hold the same loss: average over all
    model.train()
    return total.item() / (dist.get_world_size() * cfg.train.eval_batches)


def _start_interval(device: torch.device) -> float:
    """The start of a log interval: peak memory is tracked per interval (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return time.perf_counter()


def _peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def train(cfg: config_mod.Config, resume: bool = False, launcher: str = "auto", overwrite: bool = False) -> dict:
    """Run one training job on an initialized or fresh process group; returns the last train
    and validation losses. ``resume``: continue from the newest checkpoint in ``train.out_dir``;
    ``overwrite``: delete the checkpoints and metrics log there first (see :func:`prepare_out_dir`)."""
    if resume and overwrite:
        raise config_mod.ConfigError(
            "config: --resume continues the run whose checkpoints are in train.out_dir, "
            "--overwrite deletes them: pass one or the other"
        )
    denv, device = launch_dist.init_distributed(launcher, cfg.train.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    resumed_from, changed = prepare_out_dir(cfg.train, resume, overwrite)
    if rank != 0:  # every rank would print the same warnings: rank 0 speaks for all
        warnings.filterwarnings("ignore")
    tc = cfg.train
    recipe = build_recipe(tc.recipe, tc.backward_override)
    if recipe is None:  # the high-precision baseline gathers in high precision on purpose
        warnings.filterwarnings("ignore", message=r"dtq: .* is gathered in high precision")
    tokens_per_rank = tc.batch_size * cfg.model.seq_len

    torch.manual_seed(tc.seed)  # the same initial weights on every rank
    model = build_model(cfg.model)
    kept = apply_size_rule(model, recipe, tc.size_rule, tokens_per_rank, device)
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    # Mesh (replicate, dp, tp): the tp ranks of a replica are adjacent; every HSDP replica and FSDP2
    # shard of the data-parallel world reads its own slice of the global batch.
    dp_world, dp_rank = world // cfg.parallel.tp, rank // cfg.parallel.tp
    preflight.check_shapes(
        model,
        recipe,
        tokens_per_rank,
        dp_world // cfg.parallel.replicate,
        cfg.parallel.tp,
        parallel.tp_weight_dims(model) if cfg.parallel.tp > 1 and cfg.model.kind == "dtq" else None,
    )
    mesh = parallel.make_mesh(device, world, cfg.parallel.tp, cfg.parallel.replicate)
    gather_quantized = parallel.quantized_gather(
        cfg.parallel.quantized_gather, parallel.data_parallel_mesh(mesh), tc.quantized_params
    )
    reshard = parallel.reshard_after_forward(cfg.parallel.reshard_after_forward, dp_world // cfg.parallel.replicate)
    units = parallel.fsdp_units(cfg.parallel.fsdp_units, world, reshard)
    model = parallel.parallelize(model, mesh, cfg, recipe, gather_quantized=gather_quantized, units=units)
    model.recompute = tc.recompute
    opt = optim.build_optimizer(model, tc)

    train_data, val_data = data.splits(cfg.data.max_bytes, cfg.data.val_fraction, cfg.model.seq_len, tc.seed)
    step, samples = 0, 0
    if resumed_from is not None:
        optim.materialize_state(opt)
        state = checkpointing.load(resumed_from, model, opt, device)
        step, samples = int(state["step"]), int(state["samples"])
    else:
        torch.manual_seed(tc.seed + 1)  # the training RNG stream (stochastic-rounding seeds)

    log = metrics.MetricsLog(
        pathlib.Path(tc.out_dir) / "metrics.jsonl", rank == 0, resume_step=step if resumed_from is not None else None
    )
    log.write(
        {
            "kind": "config",
            "config": cfg.to_dict(),
            "world_size": world,
            "quantized_gather": gather_quantized,  # parallel.quantized_gather as decided on this mesh
            "fsdp_units": units,  # parallel.fsdp_units as decided
            "launcher": denv.launcher,
            "device": str(device),
            "recipe": repr(recipe),
            "params": n_params,
            "resumed_from": str(resumed_from) if resumed_from else None,
        }
    )
    if changed:
        log.write({"kind": "recipe_change", "step": step, "changed": changed})
        if rank == 0:
            print(
                f"warning: --resume: {resumed_from} was trained with "
                f"{_settings({k: v[0] for k, v in changed.items()})}; this run continues it from step {step} "
                f"with {_settings({k: v[1] for k, v in changed.items()})}, and metrics.jsonl holds both parts "
                '(a "recipe_change" record marks the step). Resume with the checkpoint\'s settings to continue '
                "the same run, or start a new one (--overwrite, or another train.out_dir)",
                file=sys.stderr,
                flush=True,
            )
    console = progress.Console(rank == 0, tc.steps, step, bar=tc.progress_bar)
    if resume and resumed_from is None:
        console.print(f"--resume: no checkpoint in {tc.out_dir}/checkpoints yet; starting from step 0")
    console.print(
        f"dtq {dtq.__version__} | {cfg.model.kind} model, {cfg.model.layers} layers, hidden "
        f"{cfg.model.hidden}: {n_params / 1e6:.2f} M parameters | recipe {tc.recipe}"
        + (" (quantized parameters)" if tc.quantized_params else "")
        + f" | {world} rank(s) via {denv.launcher}, {dist.get_backend()} on {device.type}, mesh "
        f"{parallel.describe(mesh)} | {tokens_per_rank} tokens/rank/step"
        + (f" | resumed at step {step}" if resumed_from else "")
    )
    if recipe is None:
        console.print(
            f"recipe {tc.recipe}: no quantization; GEMMs in {tc.dtype}, all-gathers in high precision "
            "(counted as <dtype>/fallback)"
        )
    elif device.type == "cpu":
        console.print("note: on CPU dtq emulates quantized GEMMs with the reference codecs (exact bits, not speed)")
    if kept is not None:
        console.print(f"size rule: {len(kept[0])} of {kept[1]} dtq modules kept in high precision ({kept[2]})")
    if step >= tc.steps:
        console.print(f"already at step {step} of {tc.steps}; raise train.steps to continue")

    if recipe is not None and not gather_quantized:
        why = " (auto: FSDP2's shards on one host)" if cfg.parallel.quantized_gather == "auto" else " = false"
        console.print(f"parallel.quantized_gather{why}: weights gathered in high precision, quantized by their GEMMs")
    if units == "root":
        why = " (auto: one rank)" if cfg.parallel.fsdp_units == "auto" else ""
        console.print(f"parallel.fsdp_units{why}: FSDP2 on the root only, one gather and one gradient reduction a step")
    # high-precision weights that FSDP2 gathers quantized: their amaxes reduced once per step
    reduce_amaxes = recipe is not None and not tc.quantized_params and gather_quantized
    if reduce_amaxes:
        dtq.parallel.precompute_amax(model, recipe)  # the first step's gathers too
    collectives = metrics.CollectiveBytes()
    with collectives, contextlib.closing(console):
        dtq.parallel.comm_stats(reset=True)
        loss_sum, interval_steps, t0 = torch.zeros((), device=device), 0, _start_interval(device)
        last = {"loss": float("nan"), "val_loss": float("nan")}
        b = tc.batch_size
        while step < tc.steps:
            step += 1
            lr = optim.lr_at(step, tc)
            optim.set_lr(opt, lr)
            x, y = train_data.batch(samples + dp_rank * b, b)  # this replica's slice of the global batch
            x, y = data.to_device((x, y), device)
            with quantized(recipe), activation_memory(tc, device):
                loss = lm_loss(model, x, y)
            run_backward(loss, tc.backward_thread)
            if tc.grad_clip > 0:
                optim.clip_grad_norm(model.parameters(), tc.grad_clip, opt)
            optim.step(opt)
            opt.zero_grad(set_to_none=True)
            if reduce_amaxes:
                dtq.parallel.precompute_amax(model, recipe)  # every weight's amax in one all-reduce
            samples += b * dp_world
            loss_sum += loss.detach()
            interval_steps += 1

            if step % tc.log_every == 0 or step == tc.steps:
                collective.run(dist.all_reduce, loss_sum)
                elapsed = time.perf_counter() - t0
                rec = {
                    "kind": "train",
                    "step": step,
                    "loss": loss_sum.item() / (world * interval_steps),
                    "lr": lr,
                    "tokens_per_s": interval_steps * tokens_per_rank * dp_world / elapsed,
                    "step_s": elapsed / interval_steps,
                    "gathered_bytes": dtq.parallel.comm_stats(reset=True),
                    "collective_bytes": collectives.take(),
                    "peak_memory_bytes": _peak_memory(device),
                    "samples": samples,
                    "elapsed_s": elapsed,
                }
                last["loss"] = rec["loss"]
                log.write(rec)
                console.print(metrics.progress_line(rec, tc.steps))
                loss_sum.zero_()
                interval_steps, t0 = 0, _start_interval(device)
            if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
                last["val_loss"] = evaluate(model, val_data, cfg, recipe, device, dp_rank, dp_world)
                log.write({"kind": "eval", "step": step, "val_loss": last["val_loss"]})
                console.print(f"step {step}: validation loss {last['val_loss']:.4f}")
                dtq.parallel.comm_stats(reset=True)  # eval gathers are not training traffic
                collectives.take()
                t0 = _start_interval(device)
            if (tc.checkpoint_every and step % tc.checkpoint_every == 0) or step == tc.steps:
                path = checkpointing.save(
                    tc.out_dir,
                    step,
                    model,
                    opt,
                    {"step": step, "samples": samples, "world_size": world},
                    device,
                    run_info=recipe_settings(tc),
                    keep=tc.keep_checkpoints,
                )
                console.print(f"checkpoint: {path}")
                collectives.take()
                t0 = _start_interval(device)
            console.step(last["loss"] if interval_steps == 0 else None)
    return last


def _is_first_rank(launcher: str) -> bool:
    """Whether this process is rank 0, before or after the process group is up."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    try:
        return launch_dist.detect(os.environ, launcher).rank == 0
    except (RuntimeError, ValueError):
        return True


def main(argv: list[str] | None = None) -> dict:
    """The command line. A config mistake (a :class:`~dtq.launch.config.ConfigError`: of the config
    file or an override, or found later, which every rank raises alike) is printed as one line by
    rank 0, without a traceback, and the process exits with status 2."""
    args = parse_args(argv)
    try:
        cfg = load_config(args)
        result = train(cfg, resume=args.resume, launcher=args.launcher, overwrite=args.overwrite)
        # Every rank past its last collective before any tears its process groups down: a gloo
        # rank that exits while a peer's work is still in flight can abort at interpreter exit.
        # Through dtq's collective.run, like the trainer's other collectives: it keeps gloo's
        # works, so gloo's worker thread is never the one that frees them (which, at interpreter
        # exit, aborted two-rank CPU runs: docs/troubleshooting.md).
        collective.run(dist.barrier)
        return result
    except config_mod.ConfigError as e:
        if dist.is_initialized():
            collective.run(dist.barrier)  # raised on every rank alike: none is left inside a collective
        if _is_first_rank(args.launcher):
            print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def cli() -> None:
    """The ``dtq-train`` command (and ``launch/train.py``): :func:`main` on ``sys.argv``, exit
    status 0 (a console script passes the return value to ``sys.exit``, which would print the
    result dict as an error)."""
    main()


if __name__ == "__main__":
    cli()
