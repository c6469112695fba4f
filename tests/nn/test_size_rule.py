"""The size rule (issue 16, "never slower" at small hidden sizes): GEMMs too small to gain from a
recipe stay in high precision, named in a report.

``dtq.convert(size_rule=...)`` keeps small ``nn.Linear`` layers (reported, not refused);
``dtq.apply_size_rule`` keeps small dtq modules in high precision under every recipe, bitwise as
``dtq.autocast(enabled=False)`` computes them, also under recompute and FSDP2 (their gathers move
high precision, counted and said once), and with quantized parameters (their weights stay the
master weights). ``SizeRule.measured`` looks up what ``bench/gemm_sizes.py`` measured.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

import dtq
from dtq.testing import spawn

FP8 = dtq.Float8CurrentScaling()
RULE = dtq.SizeRule(min_features=128, min_weight_numel=128 * 256)


class Net(torch.nn.Module):
    """A small dtq Linear, a LayerNormMLP with both GEMMs small, and a Linear the rule quantizes."""

    def __init__(self):
        super().__init__()
        self.small = dtq.nn.Linear(64, 64, bias=False, name="small")
        self.mlp = dtq.nn.LayerNormMLP(64, 64, bias=False, normalization="RMSNorm", activation="swiglu", name="mlp")
        self.up = dtq.nn.Linear(64, 128, bias=False, name="up")
        self.big = dtq.nn.Linear(128, 256, bias=False, name="big")

    def forward(self, x):
        return self.big(self.up(x + self.mlp(self.small(x))))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _step(model, x, ctx, *, recompute: bool = False):
    x = x.detach().clone().requires_grad_()
    with ctx:
        y = checkpoint(model, x, use_reentrant=False) if recompute else model(x)
    y.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def _bits_equal(a, b) -> bool:
    ya, xa, ga = a
    yb, xb, gb = b
    return (
        torch.equal(ya, yb)
        and torch.equal(xa, xb)
        and ga.keys() == gb.keys()
        and all(torch.equal(ga[k], gb[k]) for k in ga)
    )


# -- the rule itself -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, field", [({"min_features": -1}, "min_features"), ({"min_weight_numel": 2.5}, "min_weight_numel")]
)
def test_rule_is_validated(kw, field):
    with pytest.raises(ValueError, match=f"dtq.SizeRule: {field}="):
        dtq.SizeRule(**kw)
    with pytest.raises(ValueError, match="min_features=True must be an int"):
        dtq.SizeRule(min_features=True)


def test_why_small_at_the_thresholds():
    assert RULE.why_small(256, 128) is None and RULE.why_small(128, 256) is None
    assert "weight [127, 4096] needs min(N, K) >= 128" in RULE.why_small(127, 4096)
    assert RULE.why_small(128, 255).startswith("below the size rule")
    assert dtq.SizeRule().why_small(1, 1) is None
    assert dtq.SizeRule(keep_all=True, source="emulated").why_small(8192, 8192) == "below the size rule: emulated"


def test_measured_rules(monkeypatch):
    """The table bench/gemm_sizes.py measured on sm_90, looked up by format and token count; no
    gains where a device emulates the format; a clear error where nothing was measured."""
    cpu = dtq.SizeRule.measured(FP8, device="cpu")
    assert cpu.keep_all and "on cpu dtq emulates" in cpu.source
    cap = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap[0])
    hopper = dtq.SizeRule.measured(FP8, device="cuda:0")
    assert (hopper.min_features, hopper.min_weight_numel, hopper.keep_all) == (2048, 2048 * 8192, False)
    assert hopper.source == "measured on sm_90: fp8 at 8192 tokens"
    more = dtq.SizeRule.measured(FP8, tokens=20000, device="cuda:0")  # the largest measured count below
    assert (more.min_features, more.min_weight_numel) == (2048, 2048 * 2048) and "16384 tokens" in more.source
    row = dtq.SizeRule.measured(dtq.Float8RowwiseScaling(), device="cuda:0")
    assert (row.min_features, row.min_weight_numel) == (4096, 4096 * 8192)
    with pytest.raises(ValueError, match="measured at 8192 tokens per GEMM and up, not at 4096"):
        dtq.SizeRule.measured(FP8, tokens=4096, device="cuda:0")
    for recipe, losing in ((dtq.MXFP8BlockScaling(), "mxfp8"), (dtq.presets.recipe_from_name("hybrid"), "nvfp4")):
        rule = dtq.SizeRule.measured(recipe, device="cuda:0")
        assert rule.keep_all and f"{losing} at 8192 tokens slower than high precision at every size" in rule.source
    # A recipe mixing formats takes the strictest threshold of each.
    mixed = dtq.CustomRecipe(
        lambda role: dtq.Float8RowwiseQuantizer() if role.tensor_type == "weight" else dtq.Float8BlockQuantizer()
    )
    mixed_rule = dtq.SizeRule.measured(mixed, device="cuda:0")
    assert mixed_rule.min_features == 4096 and mixed_rule.source == (
        "measured on sm_90: fp8_block at 8192 tokens, fp8_row at 8192 tokens"
    )
    nothing = dtq.SizeRule.measured(dtq.CustomRecipe(lambda role: None), device="cuda:0")
    assert nothing.why_small(1, 1) is None
    for other in ((8, 0), (10, 0)):  # nothing measured there
        cap[0] = other
        with pytest.raises(ValueError, match=r"no size rule was measured for Float8CurrentScaling \(fp8\) on sm_"):
            dtq.SizeRule.measured(FP8, device="cuda:0")
    with pytest.raises(TypeError, match="recipe must be a dtq recipe"):
        dtq.SizeRule.measured("fp8")


# -- dtq.convert ---------------------------------------------------------------------------------


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 128)
        self.c = torch.nn.Linear(128, 256)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def test_convert_keeps_and_reports_small_linears():
    torch.manual_seed(0)
    model, report = dtq.convert(Plain(), recipe=FP8, size_rule=RULE, strict=True, report=True)
    assert report.converted == ("c",) and isinstance(model.c, dtq.nn.Linear)
    assert type(model.a) is torch.nn.Linear and type(model.b) is torch.nn.Linear
    assert report.refused == {}  # asked for: strict does not refuse them
    assert "weight [128, 64] needs min(N, K) >= 128" in report.skipped["b"]
    assert "kept b: below the size rule" in str(report)
    with pytest.raises(ValueError, match="size_rule='auto'\\) needs the recipe"):
        dtq.convert(Plain(), size_rule="auto")
    with pytest.raises(ValueError, match="size_rule='big'; pass a dtq.SizeRule"):
        dtq.convert(Plain(), recipe=FP8, size_rule="big")
    # "auto": the rule measured for this device (on the CPU, where dtq emulates every format,
    # nothing gains; on sm_90 these layers are far below it).
    _, auto = dtq.convert(Plain(), recipe=FP8, size_rule="auto", report=True)
    assert auto.converted == () and all(v.startswith("below the size rule") for v in auto.skipped.values())
    # quantized_params: only the converted layers hold quantized weights.
    qmodel = dtq.convert(Plain(), recipe=FP8, size_rule=RULE, quantized_params=True)
    assert isinstance(qmodel.c.weight, dtq.QuantizedTensor) and not isinstance(qmodel.b.weight, dtq.QuantizedTensor)


# -- dtq.apply_size_rule on dtq modules ---------------------------------------------------------


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_kept_modules_compute_as_high_precision(recompute):
    """The modules the rule keeps compute bitwise what they compute outside any recipe; the big
    one still quantizes (a wrongly kept module, or a rule that changed nothing, fails here)."""
    x = torch.randn(4, 8, 64)
    kept_net = _net()
    kept = dtq.apply_size_rule(kept_net, RULE)
    assert set(kept) == {"small", "mlp", "up"}
    assert "fc1_weight: below the size rule: weight [128, 64]" in kept["mlp"]
    assert kept_net.big.gemm_state.high_precision is None
    got = _step(kept_net, x, dtq.autocast(FP8), recompute=recompute)
    # The reference: the same model with the small modules outside the recipe and `big` inside it.
    ref_net = _net()
    small_hp = torch.nn.ModuleList([ref_net.small, ref_net.mlp, ref_net.up])
    for m in small_hp:
        m.forward = _high_precision(m.forward)
    want = _step(ref_net, x, dtq.autocast(FP8), recompute=recompute)
    assert _bits_equal(got, want)
    everything_hp = _step(_net(), x, dtq.autocast(FP8, enabled=False), recompute=recompute)
    assert not torch.equal(got[0], everything_hp[0])  # `big` really quantized


def _high_precision(forward):
    def run(*args, **kwargs):
        with dtq.autocast(None, enabled=False):
            return forward(*args, **kwargs)

    return run


def test_kept_modules_and_quantized_params():
    net = _net()
    dtq.apply_size_rule(net, RULE)
    dtq.convert(net, recipe=FP8, quantized_params=True)
    assert not isinstance(net.small.weight, dtq.QuantizedTensor)
    assert not isinstance(net.mlp.fc1_weight, dtq.QuantizedTensor)
    assert isinstance(net.big.weight, dtq.QuantizedTensor)
    with pytest.raises(ValueError, match=r"apply_size_rule: big\.weight is already a quantized parameter"):
        dtq.apply_size_rule(net, dtq.SizeRule(min_features=4096))
    # Re-applying a looser rule lets modules follow the recipe again.
    net = _net()
    dtq.apply_size_rule(net, RULE)
    assert dtq.apply_size_rule(net, dtq.SizeRule()) == {} and net.small.gemm_state.high_precision is None
    with pytest.raises(TypeError, match="rule must be a dtq.SizeRule"):
        dtq.apply_size_rule(net, "auto")


def _train(net, x, steps: int = 2) -> torch.Tensor:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        with dtq.autocast(FP8):
            loss = net(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def _check_fsdp2(rank, world):
    import warnings

    from torch.distributed.fsdp import fully_shard

    x = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(1))
    single = _net()
    dtq.apply_size_rule(single, RULE)
    want = _train(single, x)
    net = _net()
    dtq.apply_size_rule(net, RULE)
    mesh = init_device_mesh("cpu", (world,))
    for m in (net.small, net.mlp, net.up, net.big):
        fully_shard(m, mesh=mesh)
    fully_shard(net, mesh=mesh)
    dtq.parallel.comm_stats(reset=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        dtq.parallel.precompute_amax(net, FP8)  # skips the kept modules' weights
        got = _train(net, x)
    assert torch.equal(got, want), (got, want)
    stats = dtq.parallel.comm_stats()
    assert stats.get("fp8/rowwise", 0) > 0 and stats.get("float32/fallback", 0) > 0, stats
    assert any("a size rule keeps its module in high precision" in str(w.message) for w in said)


def test_fsdp2_gathers_kept_modules_in_high_precision():
    """On 2 gloo ranks (the same data on both) FSDP2 training is bitwise the single-process run,
    the kept modules' weights gathered in high precision (counted as fall-back and said once,
    with the reason) and `big`'s in FP8."""
    spawn(_check_fsdp2, 2, backend="gloo")


def test_gemm_sizes_picks_the_rule_converting_most_gaining_points():
    """bench/gemm_sizes.py's selection, which the measured table comes from: the thresholds that
    convert the most grid points, each at >= margin; none when no point gains."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
    from gemm_sizes import loosest_rule

    grid = {(1024, 1024): 0.3, (1024, 8192): 0.97, (2048, 2048): 0.6, (2048, 4096): 1.16, (2048, 8192): 1.29}
    grid |= {(4096, 4096): 1.27, (4096, 8192): 1.35, (8192, 8192): 1.46}
    assert loosest_rule(grid, 1.05) == (2048, 2048 * 4096)  # 5 points; (1024, 4096*4096) converts 4
    assert loosest_rule(grid, 1.2) == (1024, 2048 * 8192)  # ties: the smaller thresholds
    assert loosest_rule({(1024, 1024): 0.5}, 1.0) is None
