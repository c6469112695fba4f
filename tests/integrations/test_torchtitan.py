"""dtq.integrations.torchtitan against the installed torchtitan (0.3), on CPU with 2 gloo ranks.

torchtitan's model zoo (``torchtitan.models``) imports triton, which CPU builds of torch do not
ship, so these tests build a tiny model from torchtitan's protocol classes (``Module``,
``BaseModel``, ``ModuleList``, ``ModelConfigConverter``, ``OptimizersContainer``, ``ParallelDims``)
the way its trainer does: a config tree, converted, built on the meta device, FSDP2-sharded (or
tensor-parallelized by ``Module.parallelize`` from llama3's sharding configs), materialized,
initialized by ``init_weights``, trained by its optimizer container.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

import dtq
from dtq.autocast import autocast_active
from dtq.presets import recipe_from_name
from dtq.testing import spawn

H = 64


def _data(n=32, out=H):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, H, generator=g), torch.randn(n, out, generator=g)


def _titan_linear():
    """torchtitan.models.common.linear.Linear's protocol: an nn.Linear built from its config."""
    from torchtitan.protocols.module import Module

    class TitanLinear(torch.nn.Linear, Module):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            in_features: int
            out_features: int
            bias: bool = False

        def __init__(self, config):
            super().__init__(config.in_features, config.out_features, bias=config.bias)

    return TitanLinear


def _titan_ffn(residual: bool):
    """torchtitan's Linear protocol and a module of two of them, ``w2(relu(w1(x)))`` (plus ``x``
    with ``residual``)."""
    from torchtitan.protocols.module import Module

    TitanLinear = _titan_linear()

    class FeedForward(Module):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            w1: TitanLinear.Config
            w2: TitanLinear.Config

        def __init__(self, config):
            super().__init__()
            self.w1, self.w2 = config.w1.build(), config.w2.build()

        def forward(self, x):
            y = self.w2(F.relu(self.w1(x)))
            return x + y if residual else y

    return TitanLinear, FeedForward


def _titan_tiny():
    """A torchtitan ``BaseModel``: ``output(layers(enter(x)))`` (``enter`` optional)."""
    from torchtitan.protocols.model import BaseModel
    from torchtitan.protocols.module import Module, ModuleList

    class Tiny(BaseModel):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseModel.Config):
            layers: list
            output: Module.Config
            enter: Module.Config | None = None

            def update_from_config(self, *, config, **kwargs):
                pass

            def get_nparams_and_flops(self, model, seq_len):
                return 0, 0

        def __init__(self, config):
            super().__init__()
            self.enter = config.enter.build() if config.enter is not None else None
            self.layers = ModuleList([c.build() for c in config.layers])
            self.output = config.output.build()

        def forward(self, x):
            x = self.enter(x) if self.enter is not None else x
            for layer in self.layers:
                x = layer(x)
            return self.output(x)

    return Tiny


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def _titan_model_config(drawn: dict | None = None):
    """A torchtitan-protocol config tree: two residual blocks and an output projection (100
    outputs: no MX blocks fit), each Linear config carrying torchtitan's per-parameter init.
    With ``drawn``: each init records the whole weight it drew there (by name), and layers.1.w1
    is left to nn.Linear's default initialization."""

    TitanLinear, Block = _titan_ffn(residual=True)

    Tiny = _titan_tiny()

    def init(name):
        def trunc_normal(p):
            torch.nn.init.trunc_normal_(p, std=0.05)
            if drawn is not None:
                drawn[f"{name}.weight"] = _whole(p)

        return None if drawn is not None and name == "layers.1.w1" else {"weight": trunc_normal}

    def linear(i, o, name):
        return TitanLinear.Config(in_features=i, out_features=o, param_init=init(name))

    return Tiny.Config(
        layers=[
            Block.Config(w1=linear(H, 2 * H, f"layers.{i}.w1"), w2=linear(2 * H, H, f"layers.{i}.w2")) for i in range(2)
        ],
        output=linear(H, 100, "output"),
    )


def _train_titan(rank, world, recipe, quantized_gather=True):
    """Build, shard, initialize and train the tiny model as torchtitan's trainer does; returns it,
    its optimizers and its losses (each rank trains on its own half of the batch)."""
    from torchtitan.components.optimizer.optimizer import default_adamw

    from dtq.integrations.torchtitan import DtqConverter, DtqLinear, post_optimizer_build_fn

    converter = DtqConverter.Config(recipe=recipe, filter_fqns=["layers.1.w2"], quantized_gather=quantized_gather)
    config = converter.build().convert(_titan_model_config())
    with torch.device("meta"):
        model = config.build()
    model.verify_module_protocol()
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {
        "layers.0.w1": "DtqLinear",
        "layers.0.w2": "DtqLinear",
        "layers.1.w1": "DtqLinear",
        "layers.1.w2": "TitanLinear",
        "output": "DtqLinear",
    }, kinds  # per-tensor FP8 takes [100, 64]
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(1000 + rank)  # the same initial weights in every call (shards drawn apart)
    with torch.no_grad():
        model.init_weights()
    w = model.layers[0].w1.weight
    assert isinstance(model.layers[0].w1, DtqLinear) and w.full_tensor().std() < 0.06  # param_init, not kaiming
    opt_config = default_adamw(lr=1e-2)
    opt_config.implementation = "for-loop"
    optimizers = opt_config.build(model_parts=[model])
    post_optimizer_build_fn(optimizers, [model], None)
    seen = []
    model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(autocast_active()))
    x, y = _data(n=64, out=100)
    x, y = x[rank::world], y[rank::world]
    losses = []
    for _ in range(3):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        losses.append(loss.item())
        local = w._local_tensor  # the hook reduced the new weights' amaxes (per-tensor FP8 needs them)
        if quantized_gather:
            key = local._amax_cache[0]  # (wrapper version, data version, quantizer, dtype): gather.amax_key
            assert key[:2] == (local._version, dtq.weights.unwrap(local)._version)
        else:  # a plain shard: FSDP2 gathers it as it is
            assert type(local) is torch.Tensor, type(local)
    assert seen == [True] * 3 and losses[2] < losses[0], (seen, losses)
    return model, optimizers, losses


def _check_titan(rank, world, root):
    from tests.parallel.test_sharded_equals_single import _state

    dtq.parallel.comm_stats(reset=True)
    model, optimizers, losses = _train_titan(rank, world, "fp8")
    stats = dtq.parallel.comm_stats()
    assert stats.get("fp8/rowwise", 0) > 0 and stats.get("fp8/columnwise", 0) > 0, stats
    # quantized_gather=False: plain weights gathered unquantized, the GEMMs quantizing the whole
    # weight as the quantized gather delivers it: the same losses, bit for bit, and no dtq gathers
    dtq.parallel.comm_stats(reset=True)
    plain_losses = _train_titan(rank, world, "fp8", quantized_gather=False)[2]
    assert plain_losses == losses, (plain_losses, losses)
    assert dtq.parallel.comm_stats() == {}
    # torchtitan's checkpointer saves and restores the high-precision dtq weights
    checkpointer = _titan_checkpointer(root, model, optimizers)
    assert checkpointer.save(curr_step=3)
    saved = _state(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert checkpointer.load(step=3)
    _check_same(_state(model), saved)
    # delayed scaling: the forward's dtq.autocast reduces the amaxes over the data-parallel ranks,
    # so ranks that saw different tokens keep identical histories (and they start at zero)
    model, _, _ = _train_titan(rank, world, "fp8-delayed")
    hist = torch.cat([b.flatten() for n, b in model.named_buffers() if "amax_history_" in n])
    assert hist.numel() and hist.abs().sum() > 0
    both = [torch.empty_like(hist) for _ in range(world)]
    torch.distributed.all_gather(both, hist)
    assert torch.equal(both[0], both[1])


def test_torchtitan_converter_trains_under_fsdp2(tmp_path):
    pytest.importorskip("torchtitan.protocols.model", reason="torchtitan is not installed")
    spawn(_check_titan, 2, str(tmp_path), backend="gloo")


QP_RECIPES = ("fp8-delayed", "fp8", "mxfp8")  # a per-tensor scale (its amax reduced over the shards), 32-row blocks
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # torchtitan's default_adamw


class _PlainTiny(torch.nn.Module):
    """The tiny torchtitan model's computation and parameter names, in plain torch modules (for
    ``dtq.convert``)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {"w1": torch.nn.Linear(H, 2 * H, bias=False), "w2": torch.nn.Linear(2 * H, H, bias=False)}
            )
            for _ in range(2)
        )
        self.output = torch.nn.Linear(H, 100, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer["w2"](F.relu(layer["w1"](x)))
        return self.output(x)


@contextlib.contextmanager
def _recording_default_init(drawn: dict | None):
    """nn.Linear's default initialization (kaiming_uniform_), recording the whole weight it drew as
    layers.1.w1's (the one layer _titan_model_config(drawn) leaves to it)."""
    real = torch.nn.init.kaiming_uniform_

    def recording(t, *args, **kwargs):
        out = real(t, *args, **kwargs)
        assert "layers.1.w1.weight" not in drawn
        drawn["layers.1.w1.weight"] = _whole(t)
        return out

    torch.nn.init.kaiming_uniform_ = real if drawn is None else recording
    try:
        yield
    finally:
        torch.nn.init.kaiming_uniform_ = real


def _titan_quantized(recipe: str, mesh, drawn: dict | None = None, seed: int = 100):
    """The tiny model built as torchtitan's trainer builds it, converted with quantized
    parameters: on the meta device, FSDP2-sharded, materialized, initialized by init_weights.
    DTensor's random ops on a CPU mesh draw each shard from its rank's generator: seeded apart,
    so that the shards differ (equal shards would have their global amax as local one)."""
    from dtq.integrations.torchtitan import DtqConverter

    converter = DtqConverter.Config(recipe=recipe, filter_fqns=["layers.1.w2"], quantized_params=True).build()
    config = converter.convert(_titan_model_config(drawn))
    with torch.device("meta"):
        model = config.build()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(seed + mesh.get_local_rank())
    with torch.no_grad(), _recording_default_init(drawn):
        model.init_weights()
    return model


def _titan_optimizers(model, master_weights: bool = True):
    """torchtitan's optimizer container for ``model``: default_adamw's config, through
    master_weight_optimizers unless ``master_weights=False``."""
    from torchtitan.components.optimizer.optimizer import default_adamw

    from dtq.integrations.torchtitan import master_weight_optimizers

    config = default_adamw(**ADAMW)
    config.implementation = "for-loop"
    return (master_weight_optimizers(config) if master_weights else config).build(model_parts=[model])


def _steps(model, optimizer, n: int, recipe=None) -> torch.Tensor:
    """``n`` steps on the whole batch (every rank the same), under ``dtq.autocast(recipe)`` if given."""
    x, y = _data(n=64, out=100)
    losses = []
    for _ in range(n):
        with dtq.autocast(recipe) if recipe is not None else contextlib.nullcontext():
            loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def _single_process(recipe: str, drawn: dict):
    """The same model in one process, from the same initial weights, by dtq.convert(quantized_params=True)."""
    ref = _PlainTiny()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(drawn[name])
    dtq.convert(
        ref,
        recipe=recipe_from_name(recipe),
        quantized_params=True,
        fsdp_world=2,
        module_filter_fn=lambda m, fqn: fqn != "layers.1.w2",
    )
    return ref, dtq.optim.MasterWeightOptimizer(ref.parameters(), torch.optim.AdamW, foreach=False, **ADAMW)


def _check_titan_quantized(rank, world, root):
    from dtq.integrations.torchtitan import post_optimizer_build_fn
    from tests.parallel.test_sharded_equals_single import _compare, _state

    mesh = init_device_mesh("cpu", (world,))
    none = torch.zeros(0)
    for recipe in QP_RECIPES:
        drawn: dict = {}
        model = _titan_quantized(recipe, mesh, drawn)
        ref, ref_opt = _single_process(recipe, drawn)
        quantized = sorted(n for n, p in model.named_parameters() if isinstance(p.to_local(), dtq.QuantizedTensor))
        assert quantized == sorted(n for n, p in ref.named_parameters() if isinstance(p, dtq.QuantizedTensor))
        assert len(quantized) == (3 if recipe == "mxfp8" else 4), quantized  # MXFP8 keeps output [100, 64]
        _compare(recipe, "initial payloads", none, none, model, ref)
        with pytest.raises(
            ValueError, match=r"torchtitan: layers\.0\.w1\.weight \(and \d more\) .* by AdamW.*quantized_"
        ):
            post_optimizer_build_fn(_titan_optimizers(model, master_weights=False), [model], None)
        optimizers = _titan_optimizers(model)
        post_optimizer_build_fn(optimizers, [model], None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = _steps(model, optimizers, 3)
        assert not [w for w in caught if "quantized parameter" in str(w.message)], caught  # the masters step them
        _compare(recipe, "trained", losses, _steps(ref, ref_opt, 3, recipe_from_name(recipe)), model, ref)
        assert losses[-1] < losses[0], losses
        # torchtitan's checkpointer (the model's state dict and the container's flat state,
        # through DCP), into a model and optimizers built and initialized anew
        assert _titan_checkpointer(f"{root}/{recipe}", model, optimizers).save(curr_step=3)
        loaded = _titan_quantized(recipe, mesh, seed=200)
        loaded_opts = _titan_optimizers(loaded)
        post_optimizer_build_fn(loaded_opts, [loaded], None)
        assert _titan_checkpointer(f"{root}/{recipe}", loaded, loaded_opts).load(step=3)
        _check_same(_state(loaded), _state(model))
        flat = _flat_local(optimizers.state_dict())
        assert sum(k.endswith(".master") for k in flat) == len(quantized), sorted(flat)
        _check_same(_flat_local(loaded_opts.state_dict()), flat)
        assert torch.equal(_steps(loaded, loaded_opts, 1), _steps(model, optimizers, 1))
        _check_same(_state(loaded), _state(model))


def _titan_checkpointer(folder: str, model, optimizers):
    """torchtitan's checkpoint manager (DCP, synchronous) for one model part and its optimizers."""
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(
        enable=True, folder=folder, interval=1, keep_latest_k=0, initial_load_model_only=False
    )
    return config.build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=None, states={}, sd_adapter=None
    )


def _flat_local(flat: dict) -> dict:
    """torchtitan's flat optimizer state: this rank's tensors (the masters among them) as bits."""
    return {k: dtq.weights.local_data(v.to_local() if hasattr(v, "to_local") else v) for k, v in flat.items()}


def _check_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for k, v in want.items():
        same = (
            torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
            if isinstance(v, torch.Tensor)
            else got[k] == v
        )
        assert same, k


def test_torchtitan_quantized_params_match_single_process(tmp_path):
    """DtqConverter.Config(quantized_params=True) under FSDP2 on 2 ranks, with torchtitan's build
    order and optimizer container: initial payloads, losses and trained payloads bitwise the
    single-process dtq.convert(quantized_params=True) run; a plain optimizer refused by name;
    torchtitan's checkpoint round trip bitwise."""
    pytest.importorskip("torchtitan.protocols.model", reason="torchtitan is not installed")
    spawn(_check_titan_quantized, 2, str(tmp_path), backend="gloo")


S, B, FFN = 32, 2, 2 * H  # batch-first activations [B, S, H], torchtitan's layout


def _layouts():
    """torchtitan.models.common.decoder_sharding's placements and its colwise / rowwise Linear
    configs, as llama3 declares them (that module imports triton, so they are restated here)."""
    import spmd_types as spmd
    from torchtitan.distributed.parallel_dims import MeshAxisName, SpmdLayout
    from torchtitan.protocols.sharding import ShardingConfig

    DP, CP, TP = MeshAxisName.DP, MeshAxisName.CP, MeshAxisName.TP

    def param(tp):
        return SpmdLayout({DP: spmd.R, CP: spmd.R, TP: tp})

    def act(tp):
        return SpmdLayout({DP: spmd.S(0), CP: spmd.S(1), TP: tp})

    sp = SpmdLayout({DP: spmd.V, CP: spmd.V, TP: spmd.V}, partition_spec=(DP, (CP, TP), None))

    def colwise(**inputs):
        return ShardingConfig(
            state_shardings={"weight": param(spmd.S(0)), "bias": param(spmd.S(0))},
            out_src_shardings=act(spmd.S(-1)),
            **inputs,
        )

    def rowwise(output_sp):
        return ShardingConfig(
            state_shardings={"weight": param(spmd.S(1)), "bias": param(spmd.R)},
            out_src_shardings=act(spmd.P),
            out_dst_shardings=sp if output_sp else act(spmd.I),
        )

    return spmd, ShardingConfig, act, sp, colwise, rowwise


def _titan_tp_model_config(sp: bool, linears: bool):
    """A decoder-like torchtitan config tree with its TP sharding declared as llama3 does: the
    activations between blocks are the sequence shard (``sp``) or replicated; each block's FFN
    w1 is colwise and w2 rowwise (reduce-scattered back to the sequence shard under ``sp``). In
    block 0 the FFN gathers its input itself (llama3's FFN boundary); in block 1 w1 declares
    the sequence shard as its input, so the gather is w1's own. ``linears=False``: the Linear
    configs declare nothing (the boundaries only), for dtq's styles applied by hand."""
    from torchtitan.protocols.module import Module

    spmd, ShardingConfig, act, sp_layout, colwise, rowwise = _layouts()
    between = sp_layout if sp else act(spmd.R)
    TitanLinear, FeedForward = _titan_ffn(residual=False)

    class Boundary(Module):  # redistributes its input (torchtitan's embedding / final norm boundaries)
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            pass

        def __init__(self, config):
            super().__init__()

        def forward(self, x):
            return x

    class Block(Module):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            ffn: FeedForward.Config

        def __init__(self, config):
            super().__init__()
            self.ffn = config.ffn.build()

        def forward(self, x):
            return x + self.ffn(x)

    Tiny = _titan_tiny()

    def linear(i, o, sharding=None):
        init = {"weight": lambda p: torch.nn.init.trunc_normal_(p, std=0.05), "bias": torch.nn.init.zeros_}
        return TitanLinear.Config(
            in_features=i, out_features=o, bias=True, param_init=init, sharding_config=sharding if linears else None
        )

    def block(gather_in_w1):
        w1_input = dict(in_src_shardings={"input": between}, in_dst_shardings={"input": act(spmd.R)})
        ffn_input = dict(in_src_shardings={"x": between}, in_dst_shardings={"x": act(spmd.R)})
        return Block.Config(
            ffn=FeedForward.Config(
                w1=linear(H, FFN, colwise(**(w1_input if gather_in_w1 else {}))),
                w2=linear(FFN, H, rowwise(sp)),
                sharding_config=None if gather_in_w1 else ShardingConfig(**ffn_input),
            )
        )

    return Tiny.Config(
        enter=Boundary.Config(
            sharding_config=ShardingConfig(in_src_shardings={"x": act(spmd.R)}, in_dst_shardings={"x": between})
        ),
        layers=[block(False), block(sp)],
        output=Boundary.Config(
            sharding_config=ShardingConfig(in_src_shardings={"x": between}, in_dst_shardings={"x": act(spmd.R)})
        ),
    )


def _hand_styles(sp: bool) -> dict:
    """dtq's styles for the Linears of _titan_tp_model_config, picked by hand."""
    out = dict(use_local_output=False)
    return {
        "layers.0.ffn.w1": dtq.parallel.ColwiseParallel(**out),
        "layers.1.ffn.w1": dtq.parallel.ColwiseParallel(sequence_parallel=sp, sequence_dim=1, **out),
        "layers.0.ffn.w2": dtq.parallel.RowwiseParallel(sequence_parallel=sp, sequence_dim=1, **out),
        "layers.1.ffn.w2": dtq.parallel.RowwiseParallel(sequence_parallel=sp, sequence_dim=1, **out),
    }


def _full_weights(model) -> dict:
    g = torch.Generator().manual_seed(3)
    return {n: torch.randn(p.shape, generator=g) * 0.05 for n, p in model.named_parameters()}


def _train_tp(sp: bool, how: str, parallel_dims, steps: int = 3, recipe: str = "mxfp8"):
    """Build the model as torchtitan's trainer does and train it on the whole batch (the TP ranks
    share it). ``how``: "titan" (torchtitan's sharding configs, run by the converter's
    DtqLinear), "hand" (dtq's styles applied by hand), "single" (no tensor parallelism).
    Returns the losses, the first step's output and the trained parameters, whole."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.components.optimizer.optimizer import default_adamw

    from dtq.integrations.torchtitan import DtqConverter, post_optimizer_build_fn

    config = _titan_tp_model_config(sp, linears=how == "titan")
    # quantized gathers: the high-precision weight wrapper under torchtitan's TP ("auto" would give
    # plain weights on this one host)
    config = DtqConverter.Config(recipe=recipe, strict=True, quantized_gather=True).build().convert(config)
    with torch.device("meta"):
        model = config.build()
    if how != "single":
        model.parallelize(parallel_dims)
    if how == "hand":
        parallelize_module(model, parallel_dims.get_mesh("tp"), _hand_styles(sp))
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
        for (n, p), full in zip(model.named_parameters(), _full_weights(model).values()):
            local = distribute_tensor(full, p.device_mesh, p.placements).to_local() if isinstance(p, DTensor) else full
            (p.to_local() if isinstance(p, DTensor) else p).copy_(local)
    opt_config = default_adamw(lr=1e-2)
    opt_config.implementation = "for-loop"
    optimizers = opt_config.build(model_parts=[model])
    post_optimizer_build_fn(optimizers, [model], parallel_dims)
    x, y = (t.view(B, S, H) for t in _data(n=B * S))
    losses, outs = [], []
    for _ in range(steps):
        out = model(x)
        out = out.to_local() if isinstance(out, DTensor) else out
        loss = F.mse_loss(out, y)
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        losses.append(loss.item())
        outs.append(out.detach())
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    return losses, outs[0], params, model


def _check_titan_tp(rank, world):
    import torchtitan.distributed.parallel_dims as titan_dims
    from torch.distributed.tensor import Replicate, Shard
    from torchtitan.distributed.parallel_dims import ParallelDims

    titan_dims.device_type = "cpu"  # torchtitan picks "cuda" on a CPU-only torch
    dims = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, pp=1, ep=1, tp=world, world_size=world, spmd_backend="partial_dtensor"
    )
    for sp in (True, False):
        dtq.parallel.comm_stats(reset=True)
        losses, first, params, model = _train_tp(sp, "titan", dims)
        stats = dtq.parallel.comm_stats(reset=True)
        ffn = model.layers[1].ffn
        assert type(ffn.w1).__name__ == "DtqLinear" and ffn.w1.weight.placements == (Shard(0),)
        assert ffn.w2.weight.placements == (Shard(1),) and ffn.w2.bias.placements == (Replicate(),)
        assert ffn.w1.weight.to_local().shape == (FFN // world, H), ffn.w1.weight.to_local().shape
        assert losses[-1] < losses[0], losses
        if sp:
            # quantized sequence-parallel gathers only, per step: block 1's w1 input and both w2's
            # output gradients, each [S, B, H] as MXFP8 (1 code byte + 1/32 scale byte per element)
            # rowwise (fprop / dgrad) and columnwise (wgrad)
            moved = 3 * 3 * S * B * H * 33 // 32
            assert stats == {"mxfp8/rowwise": moved, "mxfp8/columnwise": moved}, stats
        else:
            assert stats == {}, stats  # no sequence shards: the row GEMMs all-reduce in high precision
        # the same model with dtq's styles picked by hand runs the same ops: the same bits
        hand_losses, hand_first, hand_params, _ = _train_tp(sp, "hand", dims)
        assert losses == hand_losses, (losses, hand_losses)
        assert torch.equal(first, hand_first)
        for n, p in params.items():
            assert torch.equal(p, hand_params[n]), n
        # one process without tensor parallelism: only the row GEMMs' partial sums add up otherwise
        single_losses, single_first, _, _ = _train_tp(sp, "single", dims, steps=1)
        assert (first - single_first).norm() / single_first.norm() < 1e-5
        assert abs(losses[0] - single_losses[0]) < 1e-5 * losses[0], (losses, single_losses)
    # delayed scaling: the TP ranks hold shares of the same tensors (and a sequence-parallel
    # gather quantizes every rank's rows with one scale), so their histories agree too
    model = _train_tp(True, "titan", dims, steps=2, recipe="fp8-delayed")[3]
    hist = torch.cat([b.flatten() for n, b in model.named_buffers() if "amax_history_" in n])
    both = [torch.empty_like(hist) for _ in range(world)]
    torch.distributed.all_gather(both, hist)
    assert hist.abs().sum() > 0 and torch.equal(both[0], both[1])


def test_torchtitan_tensor_parallel_runs_dtq_styles():
    pytest.importorskip("torchtitan.protocols.model", reason="torchtitan is not installed")
    spawn(_check_titan_tp, 2, backend="gloo")


def test_torchtitan_sharding_dtq_cannot_run_is_refused():
    """What dtq's styles cannot run stays refused, by the layer's name, before anything is sharded
    (so before any process group is needed)."""
    pytest.importorskip("torchtitan.protocols.model", reason="torchtitan is not installed")
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.protocols.sharding import LocalMapConfig

    from dtq.integrations.torchtitan import DtqLinear

    spmd, ShardingConfig, act, sp, colwise, rowwise = _layouts()

    def layer(sharding, out=H):
        return DtqLinear.Config(in_features=H, out_features=out, name="layers.0.wq", sharding_config=sharding).build()

    other = dict(dp_replicate=1, dp_shard=1, cp=1, pp=1, ep=1, tp=1, world_size=1)
    for backend in ("spmd_types", "full_dtensor"):
        with pytest.raises(NotImplementedError, match=rf"layers\.0\.wq would be sharded .*spmd_backend='{backend}'"):
            layer(colwise()).parallelize(ParallelDims(spmd_backend=backend, **other))
    dims = ParallelDims(**{**other, "tp": 2, "world_size": 2}, spmd_backend="partial_dtensor")
    row = rowwise(False).state_shardings
    refused = {  # what torchtitan would do -> why dtq's styles cannot
        "colwise output all-gathered": (colwise(out_dst_shardings=act(spmd.R)), "output stays sharded on its feature"),
        "rowwise output left partial": (
            ShardingConfig(state_shardings=row, out_src_shardings=act(spmd.P)),
            "sums the partial outputs itself",
        ),
        "rowwise input replicated": (
            ShardingConfig(state_shardings=row, in_src_shardings={"input": act(spmd.R)}, out_dst_shardings=sp),
            r"takes its input sharded on the feature dim \(weight S\(1\), input R -> None",
        ),
        "replicated weight": (ShardingConfig(state_shardings={"weight": act(spmd.R)}), "its weight is placed R on"),
        "colwise GEMM on a sequence shard": (colwise(in_src_shardings={"input": sp}), "with a replicated destination"),
        "local_map region": (colwise(local_map=LocalMapConfig(in_grad_placements=None)), "under local_map"),
        "another argument": (colwise(in_src_shardings={"h": sp}), r"its input shardings name \['h'\]"),
    }
    for what, (sharding, why) in refused.items():
        lin = layer(sharding)
        with pytest.raises(NotImplementedError, match=rf"layers\.0\.wq has a tensor-parallel sharding config .*{why}"):
            lin.parallelize(dims)
        assert not hasattr(lin.weight, "device_mesh"), what  # nothing was sharded
    with pytest.raises(ValueError, match=r"tensor_parallel_degree=2, MXFP8BlockScaling cannot quantize layers\.0\.wq"):
        layer(colwise(), out=96).parallelize(dims)  # 48-row shards: no whole 32-row MXFP8 blocks
    quantized = DtqLinear.Config(
        in_features=H, out_features=H, name="layers.0.wq", sharding_config=colwise(), quantized_params=True
    ).build()
    with pytest.raises(
        NotImplementedError, match=r"layers\.0\.wq holds a quantized parameter .*tensor_parallel_degree=2"
    ):
        quantized.parallelize(dims)
    assert not hasattr(quantized.weight, "device_mesh")
    # delayed scaling under TP shares histories over every rank, which pipeline stages cannot
    from dtq.integrations.torchtitan import post_optimizer_build_fn

    delayed = DtqLinear.Config(in_features=H, out_features=H, recipe="fp8-delayed").build()
    staged = ParallelDims(**{**other, "tp": 2, "pp": 2, "world_size": 4}, spmd_backend="partial_dtensor")
    with pytest.raises(NotImplementedError, match=r"tensor_parallel_degree=2 and pipeline_parallel_degree=2 is not"):
        post_optimizer_build_fn([torch.optim.SGD(delayed.parameters(), lr=0.1)], [delayed], staged)


def test_torchtitan_converter_reports_and_strict(caplog):
    pytest.importorskip("torchtitan.protocols.model", reason="torchtitan is not installed")
    from dtq.integrations.torchtitan import DtqConverter

    with caplog.at_level(logging.INFO, logger="dtq"):
        config = DtqConverter.Config(recipe="mxfp8", fsdp_world=1).build().convert(_titan_model_config())
    assert type(config.output).__name__ == "Config" and config.output._owner.__name__ == "TitanLinear"
    assert config.layers[0].w1.name == "layers.0.w1" and config.layers[0].w1.recipe == "mxfp8"
    assert "kept output: MXFP8BlockScaling cannot quantize its weight [100, 64]" in caplog.text
    with pytest.raises(ValueError, match=r"DtqConverter\(strict=True\).*\n  output: MXFP8BlockScaling"):
        DtqConverter.Config(recipe="mxfp8", strict=True).build().convert(_titan_model_config())
    refused = r"DtqConverter.Config: quantized_gather=False needs quantized_params=False .*keep quantized_gather"
    with pytest.raises(ValueError, match=refused):
        DtqConverter.Config(quantized_params=True, quantized_gather=False).build()
    with pytest.raises(ValueError, match=r"quantized_gather='yes': expected True .*, False .* or \"auto\""):
        DtqConverter.Config(quantized_gather="yes").build()


def test_torchtitan_quantized_linear_in_one_process():
    """Without FSDP2 (one process, or a pipeline stage without data-parallel sharding) a quantized
    DtqLinear built on the meta device is initialized without a collective: its payloads are
    bitwise the quantization of the weight its param_init drew."""
    pytest.importorskip("torchtitan.protocols.model", reason="torchtitan is not installed")
    from dtq.integrations.torchtitan import DtqLinear

    drawn = {}

    def init(p):
        torch.nn.init.trunc_normal_(p, std=0.05)
        drawn["weight"] = p.detach().clone()

    config = DtqLinear.Config(
        in_features=H, out_features=2 * H, recipe="fp8", name="w1", quantized_params=True, param_init={"weight": init}
    )
    with torch.device("meta"):
        layer = config.build()
    assert isinstance(layer.weight, dtq.QuantizedTensor) and layer.weight.device.type == "meta"
    layer.to_empty(device="cpu")
    with torch.no_grad():
        layer.init_states()
    want = layer.weight.quantizer.quantize(drawn["weight"])
    for d in want.directions:
        for k, v in want.payload(d).items():
            got = layer.weight.payload(d)[k]
            assert torch.equal(got.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), (d, k)
