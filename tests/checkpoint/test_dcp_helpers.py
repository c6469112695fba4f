"""torch.distributed.checkpoint.state_dict's helpers (get_/set_state_dict, get_/set_model_state_dict,
get_/set_optimizer_state_dict: what torchtitan, Accelerate and Lightning checkpoint through) on dtq
models with MasterWeightOptimizer, for high-precision and quantized parameters of each format
family: sharded state dicts saved with dcp.save in one process and loaded on 2 FSDP2 ranks and the
other way round, full (unsharded) CPU state dicts, and the high-precision export. Also: a plain
optimizer that steps quantized parameters warns once, naming the parameter."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dtq
from dtq.testing import spawn

H, T = 128, 32  # 128 rows: whole 32-row MXFP8 and 16-row NVFP4 blocks on each of 2 ranks
# Quantized parameters of each format family; high-precision shards save plain values whatever
# the recipe, so one recipe covers them.
CASES = [
    ("mxfp8", False),
    ("fp8", True),
    ("fp8_rows", True),
    ("blocks", True),
    ("mxfp8", True),
    ("nvfp4", True),
    ("hybrid", True),
    ("hybrid_rd", True),  # weights' columnwise payloads quantized from their rowwise ones
]
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # torchtitan's sharded checkpoints


def _recipe(fmt: str):
    return {
        "fp8": dtq.Float8CurrentScaling(),
        "fp8_rows": dtq.Float8RowwiseScaling(),
        "blocks": dtq.Float8BlockScaling(),
        "mxfp8": dtq.MXFP8BlockScaling(),
        "nvfp4": dtq.NVFP4BlockScaling(),
        "hybrid": dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling()),
        "hybrid_rd": dtq.hybrid_recipe(
            dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling(), weight_columnwise_source="rowwise_dequantized"
        ),
    }[fmt]


def _hidden(fmt: str) -> int:
    return 2 * H if fmt == "blocks" else H  # 128x128 FP8 blocks: 256 rows keep them whole on 2 ranks


def _fresh(fmt: str, qp: bool, seed: int, mesh=None):
    torch.manual_seed(seed)
    h = _hidden(fmt)
    m = torch.nn.Sequential(dtq.nn.LayerNormMLP(h, h, name="mlp"), dtq.nn.Linear(h, h, name="out"))
    if qp:
        dtq.convert(m, recipe=_recipe(fmt), quantized_params=True)
    if mesh is not None:
        for layer in m:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    return m, dtq.optim.MasterWeightOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2)


def _trained(fmt: str, qp: bool, rank: int, mesh):
    m, opt = _fresh(fmt, qp, 0, mesh)
    x = torch.randn(2 * T, _hidden(fmt), generator=torch.Generator().manual_seed(1))[rank * T : (rank + 1) * T]
    with dtq.autocast(_recipe(fmt)):
        m(x).square().mean().backward()
    opt.step()  # masters and AdamW state to save; the masters now differ from the dequantized payloads
    opt.zero_grad()
    return m, opt


def _full(m, opt) -> dict:
    """Full CPU state dicts (rank 0 gets them; a collective)."""
    return {"model": get_model_state_dict(m, options=FULL), "optim": get_optimizer_state_dict(m, opt, options=FULL)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same(a, b, where: str = "") -> None:
    """Bitwise equal tensors, equal everything else, through nested dicts and lists."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(_bits(a), _bits(b)), where
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), (where, sorted(set(a) ^ set(b), key=str))
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _case(root, world, fmt, qp) -> str:
    return f"{root}/{world}-ranks-{fmt}-{'quantized' if qp else 'hp'}"


def _save(root: str, rank: int, mesh=None) -> None:
    """Train one step (FSDP2 over ``mesh``, or one process), save with the helpers and dcp.save,
    and keep the full state dicts and the high-precision exports (rank 0) as references."""
    world = 1 if mesh is None else mesh.size()
    for fmt, qp in CASES:
        m, opt = _trained(fmt, qp, rank, mesh)
        model_sd, optim_sd = get_state_dict(m, opt, options=FLAT)
        if qp:  # codes, not values: payload entries; the masters in the optimizer's state by name
            assert "0.fc1_weight" not in model_sd and any(".fc1_weight._payload.rowwise." in k for k in model_sd)
            assert isinstance(optim_sd["state.1.weight.master"], DTensor) == (mesh is not None)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=_case(root, world, fmt, qp))
        full = _full(m, opt)
        # the high-precision export agrees with the masters and with the payloads
        hp_masters = dtq.checkpoint.high_precision_state_dict(m, torch.float32, optimizer=opt)
        hp_payloads = dtq.checkpoint.high_precision_state_dict(m, torch.float32)
        if rank == 0:
            assert all(
                not isinstance(v, DTensor) and v.device.type == "cpu"
                for v in full["model"].values()
                if isinstance(v, torch.Tensor)
            )
            if qp:
                for name in ("0.fc1_weight", "0.fc2_weight", "1.weight"):
                    assert torch.equal(hp_masters[name], full["optim"]["state"][name]["master"]), name
            torch.save({**full, "hp_payloads": hp_payloads}, _case(root, world, fmt, qp) + ".pt")


def _load(root: str, saved_on: int, rank: int, mesh=None) -> None:
    """The checkpoints saved on ``saved_on`` ranks, loaded (resharded) on ``mesh`` or in one process
    through dcp.load into the helpers' state dicts; on ``mesh`` also from the full state dicts."""
    for fmt, qp in CASES:
        where = f"{saved_on} ranks, {fmt}, quantized={qp}"
        ref = torch.load(_case(root, saved_on, fmt, qp) + ".pt", weights_only=True)
        m, opt = _fresh(fmt, qp, 1, mesh)
        model_sd, optim_sd = get_state_dict(m, opt, options=FLAT)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=_case(root, saved_on, fmt, qp))
        set_state_dict(m, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=FLAT)
        got = _full(m, opt)
        if rank == 0:
            _assert_same(got["model"], ref["model"], f"{where}: model")
            _assert_same(got["optim"], ref["optim"], f"{where}: optim")
            if qp and mesh is None:  # dequantized payloads: the export without an optimizer
                for name, p in m.named_parameters():
                    if isinstance(p, dtq.QuantizedTensor):
                        assert torch.equal(p.dequantize(torch.float32), ref["hp_payloads"][name]), name
        if mesh is None:
            continue
        # full state dicts on every rank, sharded by the helpers
        # (copies: set_model_state_dict puts this rank's shards into the dict it is given)
        m, opt = _fresh(fmt, qp, 2, mesh)
        set_model_state_dict(m, copy.deepcopy(ref["model"]), options=StateDictOptions(full_state_dict=True))
        set_optimizer_state_dict(m, opt, copy.deepcopy(ref["optim"]), options=StateDictOptions(full_state_dict=True))
        got = _full(m, opt)
        if rank == 0:
            _assert_same(got["model"], ref["model"], f"{where}: model from full")
            _assert_same(got["optim"], ref["optim"], f"{where}: optim from full")


def _on_2_ranks(rank, world, root):
    mesh = init_device_mesh("cpu", (world,))
    _load(root, 1, rank, mesh)
    _save(root, rank, mesh)
    # broadcast_from_rank0 brings no payload entries to the other ranks: a clear error there
    ref = torch.load(_case(root, 1, "hybrid", True) + ".pt", weights_only=True)
    m, _ = _fresh("hybrid", True, 3, mesh)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    if rank == 0:
        set_model_state_dict(m, ref["model"], options=options)
    else:
        with pytest.raises(RuntimeError, match=r"1\.weight: none of its payload entries") as failure:
            set_model_state_dict(m, {}, options=options)
        assert "broadcast_from_rank0=True) brings parameters" in str(failure.value)
    _plain_optimizer_warning(rank, mesh)


def _plain_optimizer_warning(rank, mesh) -> None:
    """A plain optimizer on FSDP2-sharded quantized parameters (DTensors) warns, naming the first."""
    m, _ = _fresh("mxfp8", True, 4, mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    with dtq.autocast(_recipe("mxfp8")):
        m(torch.randn(T, H)).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    ours = [str(w.message) for w in caught if "quantized parameter" in str(w.message)]
    assert len(ours) == 1 and "AdamW updates 3 quantized parameter(s) in place, the first mlp.fc1_weight" in ours[0], (
        ours
    )


def test_state_dict_helpers_save_on_1_load_on_2_and_back(tmp_path):
    """Saved in one process, loaded on 2 FSDP2 ranks; saved there, loaded in one process."""
    _save(str(tmp_path), 0)
    spawn(_on_2_ranks, 2, str(tmp_path), backend="gloo")  # CPU meshes
    _load(str(tmp_path), 2, 0)


def test_earlier_layouts_still_load(tmp_path):
    """State dicts and DCP checkpoints written before the helpers worked: FP8 codes as FP8 under
    layout-1 keys, the quantizer itself in the extra state, MasterWeightOptimizer's
    {"inner", "masters"}."""
    from dtq.checkpoint import entry_key

    src, src_opt = _fresh("hybrid", True, 0)
    for p in src.parameters():
        p.grad = torch.ones_like(p.dequantize() if isinstance(p, dtq.QuantizedTensor) else p)
    src_opt.step()
    old = {k: v for k, v in src.state_dict().items() if "._payload." not in k}
    for mname, mod in src.named_modules():
        if isinstance(mod, dtq.nn.QuantizedModule):
            for w in mod.weight_names():
                p = getattr(mod, w)
                old[f"{mname}._extra_state"][w]["quantizer"] = p.quantizer
                for d in p.directions:
                    for k, v in p.payload(d).items():
                        old[entry_key(f"{mname}.{w}", p.quantizer, d, k, layout=1)] = v.clone()
    old_opt = {"inner": src_opt.inner.state_dict(), "masters": [m.detach().clone() for m in src_opt.masters]}
    assert all("master" not in st for st in src_opt.inner.state.values())  # state_dict() left it alone
    dcp.save({"model": old, "optim": old_opt}, checkpoint_id=str(tmp_path))
    expected = get_state_dict(src, src_opt)

    m, opt = _fresh("hybrid", True, 1)  # in memory
    m.load_state_dict(old)
    opt.load_state_dict(old_opt)
    _assert_same(get_state_dict(m, opt), expected)

    m, opt = _fresh("hybrid", True, 2)  # from disk, through the layout-1 templates
    opt.state_dict()  # materializes AdamW's state
    templates = {
        "model": dtq.checkpoint.layout1_state_dict(m),
        "optim": {"inner": opt.inner.state_dict(), "masters": [x.detach() for x in opt.masters]},
    }
    dcp.load(templates, checkpoint_id=str(tmp_path))
    m.load_state_dict(templates["model"])
    opt.load_state_dict(templates["optim"])
    _assert_same(get_state_dict(m, opt), expected)


def test_plain_optimizer_on_quantized_parameters_warns_once(monkeypatch):
    import dtq.tensor

    monkeypatch.setattr(dtq._warn, "_warned", set())
    recipe = dtq.Float8CurrentScaling()
    for make, expected in [
        (lambda ps: dtq.optim.MasterWeightOptimizer(ps, torch.optim.AdamW, lr=1e-4), 0),
        (lambda ps: torch.optim.AdamW(ps, lr=1e-4), 1),
    ]:
        torch.manual_seed(0)
        m = dtq.convert(
            torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Linear(H, H)), recipe=recipe, quantized_params=True
        )
        opt = make(m.parameters())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                with dtq.autocast(recipe):
                    m(torch.randn(T, H)).sum().backward()
                opt.step()
                opt.zero_grad()
        ours = [str(w.message) for w in caught if "quantized parameter" in str(w.message)]
        assert len(ours) == expected, ours
    assert (
        "AdamW updates 2 quantized parameter(s) in place, the first 0.weight (param_groups[0]['params'][0]" in ours[0]
    )
    assert "dtq.optim.MasterWeightOptimizer(params, torch.optim.AdamW" in ours[0]
