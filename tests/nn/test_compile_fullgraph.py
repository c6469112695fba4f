"""``torch.compile(fullgraph=True)`` of dtq modules and of a plain model after ``dtq.convert``: no graph
break under any recipe, and compiled results bitwise the eager ones (the GEMM custom op runs the
eager kernels; only the code between GEMMs is compiled, here with ops whose compiled bits equal
eager's on CPU). Two steps each, so cached graphs and delayed-scaling histories are checked too."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import dtq
from tests._aot import capturing_backend
from tests._recipe_matrix import RECIPES

H = 64
ALL = {**RECIPES, "fp8_high_precision_bwd": lambda: dtq.Float8CurrentScaling(backward_override="high_precision")}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


class Block(torch.nn.Module):
    """A small Llama-style block of plain torch modules (what users hand to dtq.convert)."""

    def __init__(self, act=F.silu):
        super().__init__()
        self.act = act
        self.qkv = torch.nn.Linear(H, 3 * H, bias=False)
        self.o = torch.nn.Linear(H, H, bias=False)
        self.up = torch.nn.Linear(H, 2 * H, bias=True)
        self.down = torch.nn.Linear(H, H, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, H // 2).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, H)
        x = x + self.o(a)
        g, u = self.up(x).chunk(2, dim=-1)
        return x + self.down(self.act(g) * u)


MODULES = {
    "converted_block": lambda: dtq.convert(Block()),
    "converted_block_quantized_params": lambda r: dtq.convert(Block(), recipe=r, quantized_params=True),
    # inductor's generated silu differs from eager's in the last bit; relu and mul are exact
    "converted_relu_block": lambda: dtq.convert(Block(torch.relu)),
    "converted_relu_block_quantized_params": lambda r: dtq.convert(Block(torch.relu), recipe=r, quantized_params=True),
    "linear": lambda: dtq.nn.Linear(H, H),
    "layernorm_linear": lambda: dtq.nn.LayerNormLinear(H, 2 * H),
    "layernorm_mlp_gelu": lambda: dtq.nn.LayerNormMLP(H, 2 * H),
    "layernorm_mlp_swiglu": lambda: dtq.nn.LayerNormMLP(H, 2 * H, activation="swiglu"),
    "grouped_linear": lambda: _Grouped(),
}


class _Grouped(torch.nn.Module):
    """dtq.nn.GroupedLinear with fixed splits (its forward takes them as an argument)."""

    def __init__(self):
        super().__init__()
        self.g = dtq.nn.GroupedLinear(2, H, H)

    def forward(self, x):
        rows = x.reshape(-1, H)
        return self.g(torch.cat([rows, rows * 0.5]), [rows.shape[0]] * 2)  # 32 rows per GEMM (MX blocks)


def _make(module: str, recipe):
    torch.manual_seed(0)
    return MODULES[module](recipe) if module.endswith("quantized_params") else MODULES[module]()


def _step(model, x, recipe, seed):
    torch.manual_seed(seed)  # stochastic rounding draws its seeds from torch's RNG: the same on both sides
    x = x.detach().clone().requires_grad_()
    with dtq.autocast(recipe):
        y = model(x)
    y.float().square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [y.detach(), x.grad, *grads]


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items() if "amax_history" in k}


def _check(module: str, recipe_name: str, backend: str) -> None:
    recipe = ALL[recipe_name]()
    x = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(1))
    eager_model, model = _make(module, recipe), _make(module, recipe)
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # a graph break raises
    for step in range(2):
        want = _step(eager_model, x, recipe, seed=10 + step)
        got = _step(compiled, x, recipe, seed=10 + step)
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype and torch.equal(a, b), (module, recipe_name, step, i)
    hist, want_hist = _state(model), _state(eager_model)
    assert hist.keys() == want_hist.keys()
    assert all(torch.equal(hist[k], want_hist[k]) for k in hist)


@pytest.mark.parametrize("recipe", list(ALL))
@pytest.mark.parametrize("module", [m for m in MODULES if "relu" not in m])
def test_fullgraph_aot_eager_equals_eager(module, recipe):
    _check(module, recipe, "aot_eager")


@pytest.mark.parametrize("recipe", ["fp8", "hybrid_mxfp8_nvfp4", "fp8_delayed"])
@pytest.mark.parametrize("module", ["converted_relu_block", "converted_relu_block_quantized_params"])
def test_fullgraph_inductor_equals_eager(module, recipe):
    _check(module, recipe, "inductor")


@pytest.mark.parametrize("recipe", ["fp8", "fp8_delayed"])
def test_compiled_plain_calls_run_their_plans_with_amaxes_from_the_graph(recipe):
    """Under current scaling a compiled GEMM call runs the plan eager runs (``LinearPlan``: the same
    kept fields, e.g. FP8 codes written transposed on a GPU), and the tensor-wide amaxes of its
    input and of dy are computed in the graph (where inductor fuses them into the kernels that
    produce those tensors) and handed to the ops. Delayed scaling takes neither."""
    backend, graphs = capturing_backend()
    r = ALL[recipe]()
    model = _make("converted_block", r)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(2, 16, H)
    want = _step(_make("converted_block", r), x, r, seed=0)
    got = _step(compiled, x, r, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    planned = recipe == "fp8"
    linears = [m for m in model.modules() if isinstance(m, dtq.nn.Linear)]
    assert [bool(m._slots(r, 0).plans) for m in linears] == [planned] * 4
    fw, bw = graphs
    ops = {fw: (torch.ops.dtq.linear_fw.default, 5), bw: (torch.ops.dtq.linear_backward.default, 14)}
    for g, (op, amax_arg) in ops.items():
        calls = [n for n in g.graph.nodes if n.target is op]
        assert len(calls) == 4
        for n in calls:
            amax = n.args[amax_arg]
            assert (amax is not None and _reduces_with_amax(amax)) == planned, (op, amax)


class SplitBlock(torch.nn.Module):
    """A block whose GEMMs read shared inputs: q, k and v one x, gate and up another."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(H, H, bias=False) for _ in range(4))
        self.gate, self.up = torch.nn.Linear(H, 2 * H, bias=False), torch.nn.Linear(H, 2 * H, bias=False)
        self.down = torch.nn.Linear(2 * H, H, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        # (no norms: inductor's differ from eager's in the last bit; the residual add is exact)
        q, k, v = (p(x).view(b, s, 2, H // 2).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, H))
        return x + self.down(torch.relu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_gemms_reading_one_input_quantize_it_once(backend, monkeypatch):
    """q, k and v read one x, gate and up another: compiled, each such x is quantized once per step
    (``dtq::quantize_input``, whose identical calls AOTAutograd merges), as eager does, and the
    bits are eager's. Seven GEMMs, four quantized inputs. Inductor quantizes them with its own
    kernels (``dtq.nn._fused_input``): four FP8 buffers in the forward graph, no op call."""
    from torch._inductor.utils import run_and_get_code

    from dtq.nn.linear_plan import LinearPlan

    r = dtq.Float8CurrentScaling()
    torch.manual_seed(0)
    eager = dtq.convert(SplitBlock())
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(2, 16, H)
    calls = []
    real = LinearPlan.quantize_input
    monkeypatch.setattr(LinearPlan, "quantize_input", lambda self, *a: calls.append(1) or real(self, *a))
    for step in range(2):
        want = _step(eager, x, r, seed=step)
        calls.clear()
        got, code = run_and_get_code(_step, compiled, x, r, step)
        if backend == "inductor":
            fp8_buffers = [line for line in code[0].splitlines() if "empty_strided" in line and "float8_e4m3fn" in line]
            assert len(calls) == 0 and (step or len(fp8_buffers) == 4), (step, len(calls), fp8_buffers)
        else:
            assert len(calls) == 4, (step, len(calls))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step


def _reduces_with_amax(node) -> bool:
    """Whether an FX node is an ``aten.amax`` or computed from one by dtype casts and views."""
    while node.target is not torch.ops.aten.amax.default:
        if not node.args or not isinstance(node.args[0], torch.fx.Node):
            return False
        node = node.args[0]
    return True


def test_recipe_change_recompiles_and_uses_the_new_recipe():
    """The active recipe is a guard: switching recipes between steps runs the new recipe's GEMMs."""
    model = _make("linear", None)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(32, H)
    for recipe in (dtq.Float8CurrentScaling(), dtq.MXFP8BlockScaling(), None):
        with dtq.gemm.record_paths() as paths, dtq.autocast(recipe, enabled=recipe is not None):
            got = compiled(x)
        with dtq.autocast(recipe, enabled=recipe is not None):
            want = model(x)
        assert torch.equal(got, want)
        assert len(paths) == (0 if recipe is None else 1)  # the compiled call's fprop GEMM ran


def test_autocast_off_recompiles_a_quantized_parameter_model():
    """``dtq.autocast(recipe, enabled=False)`` around a compiled model whose weights are quantized
    (and whose recipe ``dtq.convert`` bound) computes in high precision from the dequantized
    weights, as eager does, and switching back runs the recipe again: the autocast state is a
    guard. (Seen failing under torch 2.11 on a GPU machine: the recipe's graph ran with autocast
    off; torch 2.13 recompiles.)"""
    r = dtq.Float8CurrentScaling()
    torch.manual_seed(0)
    model = dtq.convert(
        torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.Linear(2 * H, H)), recipe=r, quantized_params=True
    )
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(32, H)
    for enabled in (True, False, True):
        with dtq.autocast(r, enabled=enabled):
            assert torch.equal(compiled(x), model(x)), enabled


def _wrapped_step(model, x, recipe, seed, wrap):
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    with dtq.autocast(recipe):
        y = wrap(model, x)
    y.float().square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [y.detach(), x.grad, *grads]


WRAPS = {
    "checkpoint": lambda m, x: torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False),
    "checkpoint_reentrant": lambda m, x: torch.utils.checkpoint.checkpoint(m, x, use_reentrant=True),
    "save_on_cpu": lambda m, x: _on_cpu(m, x),
}


def _on_cpu(m, x):
    with torch.autograd.graph.save_on_cpu():
        return m(x)


@pytest.mark.parametrize("wrap", list(WRAPS))
@pytest.mark.parametrize("recipe", ["fp8", "fp8_delayed", "hybrid_mxfp8_nvfp4", "fp8_dequantized_bwd"])
def test_recompute_and_offload_around_compiled_blocks(recipe, wrap):
    """torch.utils.checkpoint (non-reentrant and reentrant) and save_on_cpu around a compiled
    block give the eager bits; the recompute runs outside dtq.autocast and still uses the
    forward's recipe (and, under delayed scaling, the forward's scales)."""
    r = ALL[recipe]()
    x = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(3))
    eager_model, model = _make("converted_block", r), _make("converted_block", r)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for step in range(2):
        want = _wrapped_step(eager_model, x, r, 20 + step, WRAPS[wrap])
        got = _wrapped_step(compiled, x, r, 20 + step, WRAPS[wrap])
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (recipe, wrap, step, i)
    hist, want_hist = _state(model), _state(eager_model)
    assert all(torch.equal(hist[k], want_hist[k]) for k in want_hist)


def test_high_precision_eval_after_no_grad_eval_under_a_recipe():
    """A no_grad forward under a recipe (evaluation) is no checkpoint: a later forward outside
    dtq.autocast runs in high precision, as eager does."""
    model = _make("linear", None)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(32, H)
    with torch.no_grad():
        with dtq.autocast(dtq.Float8CurrentScaling()):
            compiled(x)
        assert torch.equal(compiled(x), model(x))
        assert torch.equal(compiled(x), torch.nn.functional.linear(x, model.weight.__dtq_unwrap__(), model.bias))


def test_forward_outside_autocast_while_a_recompute_is_pending_is_refused():
    """After a checkpointed forward whose backward has not run, a compiled forward outside
    dtq.autocast cannot be told from the recompute: it is refused with a message, not run under
    the wrong precision."""
    model = _make("linear", None)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(32, H, requires_grad=True)
    with dtq.autocast(dtq.Float8CurrentScaling()):
        torch.utils.checkpoint.checkpoint(compiled, x, use_reentrant=False)
    with pytest.raises(RuntimeError, match="recompute has not run yet"):
        compiled(x)


def _fsdp_matrix(rank, world, recipe_names):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(30 + rank))
    for recipe_name in recipe_names:
        for quantized_params in (False, True) if recipe_name != "none" else (False,):
            for reshard in (True, False):
                r = ALL[recipe_name]() if recipe_name != "none" else None  # none: identity-format gathers

                def sharded(compiled: bool):
                    torch.manual_seed(0)
                    kw = {"recipe": r, "quantized_params": True} if quantized_params else {}
                    blocks = [dtq.convert(Block(torch.relu), **kw) for _ in range(2)]
                    if compiled:  # torchtitan's order: compile each block, then shard it
                        blocks = [torch.compile(b, backend="aot_eager", fullgraph=True) for b in blocks]
                    model = torch.nn.Sequential(*blocks)
                    for b in model:
                        fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
                    return fully_shard(model, mesh=mesh)

                losses = {}
                for compiled in (False, True):
                    torch._dynamo.reset()
                    model = sharded(compiled)
                    opt = torch.optim.SGD(model.parameters(), lr=0.1)
                    losses[compiled] = []
                    for step in range(2):  # the second step runs on updated weights (new scales)
                        torch.manual_seed(40 + step)
                        with dtq.autocast(
                            r,
                            enabled=r is not None,
                            amax_group=dist.group.WORLD if r is not None and r.delayed else None,
                        ):
                            y = model(x)
                        loss = y.float().square().mean()
                        loss.backward()
                        opt.step()
                        opt.zero_grad()
                        losses[compiled].append(loss.detach())
                assert all(torch.equal(a, b) for a, b in zip(losses[True], losses[False])), (
                    recipe_name,
                    quantized_params,
                    reshard,
                    losses,
                )
    dist.barrier()


@pytest.mark.parametrize(
    "recipe_names",
    [("none", "fp8", "fp8_delayed", "fp8_dequantized_bwd"), ("mxfp8", "nvfp4", "hybrid_mxfp8_nvfp4")],
    ids=["fp8", "mx_nvfp4"],
)
def test_fsdp2_over_fullgraph_compiled_blocks_equals_eager(recipe_names):
    """FSDP2 (2 gloo ranks) over blocks compiled with fullgraph=True, then sharded: the losses of
    two training steps are bitwise those of the eager sharded model, for current, delayed, MX, NVFP4
    and hybrid recipes, high-precision and quantized parameters, and both
    reshard_after_forward settings (the backward gather refills other directions). (128x128 weight
    blocks cannot be sharded at these sizes: the custom recipe runs single-process above.) Two
    spawns: each compiles 12-14 graph pairs, about two minutes on two cores."""
    from dtq.testing import spawn

    spawn(_fsdp_matrix, 2, recipe_names, backend="gloo", timeout=600)


def test_blocks_of_one_structure_share_one_graph():
    """Each module is an opaque graph input, not a constant: twelve blocks compiled one by one
    (torchtitan's way) trace once, beyond dynamo's recompile limit of eight, and each still
    updates its own delayed-scaling history."""
    torch._dynamo.utils.counters.clear()
    r = dtq.DelayedScaling()
    models = [dtq.convert(Block(torch.relu)) for _ in range(12)]
    compiled = [torch.compile(m, backend="aot_eager", fullgraph=True) for m in models]
    x = torch.randn(2, 16, H)
    with dtq.autocast(r):
        for i, c in enumerate(compiled):
            c(x * (i + 1)).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    firsts = [m.qkv.amax_history_0_input[0] for m in models]
    assert all(torch.equal(f, x.abs().amax() * (i + 1)) for i, f in enumerate(firsts))


def test_name_dependent_custom_recipe_compiles_each_module_with_its_quantizers():
    """A CustomRecipe may pick quantizers by module name (here: 'keep' stays high precision):
    each module then gets a graph of its own, with its own quantizers."""

    def factory(role):
        return None if role.name.startswith("keep") else dtq.Float8Quantizer()

    r = dtq.CustomRecipe(factory)
    x = torch.randn(32, H)
    for name in ("keep", "quant"):
        torch.manual_seed(0)
        m = dtq.nn.Linear(H, H, name=name)
        with dtq.autocast(r):
            got = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
            assert torch.equal(got, m(x))
        exact = torch.nn.functional.linear(x, m.weight.__dtq_unwrap__(), m.bias)
        assert torch.equal(got, exact) == (name == "keep")  # only "quant" was quantized


def test_recipe_that_hides_its_name_dependence_is_refused():
    """A recipe whose quantizers depend on names but that does not declare it would run one
    module's GEMMs with another's quantizers in a shared graph: refused with a message."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Sneaky(dtq.recipe.Recipe):
        def qfactory(self, role):
            return dtq.MXFP8Quantizer() if role.name == "b" else dtq.Float8Quantizer()

    r = Sneaky()
    a, b = dtq.nn.Linear(H, H, name="a"), dtq.nn.Linear(H, H, name="b")
    x = torch.randn(32, H)
    with dtq.autocast(r):
        torch.compile(a, backend="aot_eager", fullgraph=True)(x)
        with pytest.raises(RuntimeError, match="name_dependent"):
            torch.compile(b, backend="aot_eager", fullgraph=True)(x)


def test_quantized_weight_without_a_recipe_compiles():
    """A quantized weight used in high precision (no dtq.autocast; FSDP2's gathers without a recipe
    are identity-format QuantizedTensors) dequantizes through a custom op: no graph break, the
    eager bits, and the gradient reaches the quantized parameter."""
    r = dtq.Float8CurrentScaling()
    eager, model = _make("converted_relu_block_quantized_params", r), _make("converted_relu_block_quantized_params", r)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 16, H)

    def step(m):  # outside dtq.autocast: high precision
        xg = x.clone().requires_grad_()
        y = m(xg)
        y.square().sum().backward()
        out = [y.detach(), xg.grad, *(p.grad for p in m.parameters())]
        m.zero_grad(set_to_none=True)
        return out

    got, want = step(compiled), step(eager)
    assert len(got) == len(want) and all(g is not None for g in got)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert isinstance(model.qkv.weight, dtq.QuantizedTensor)


def test_a_recipe_made_anew_each_step_compiles_once():
    """Equal recipes share their key (recipes compare by value): ``dtq.autocast()`` (a new default
    recipe at every entry) or a recipe built inside the loop does not recompile every step."""
    torch._dynamo.utils.counters.clear()
    m = dtq.nn.Linear(H, H)
    c = torch.compile(m, backend="aot_eager", fullgraph=True)  # a recompile past the limit would raise
    x = torch.randn(32, H)
    for _ in range(10):
        with dtq.autocast():
            c(x)
        with dtq.autocast(dtq.MXFP8BlockScaling()):
            c(x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    import pickle

    r = dtq.DelayedScaling(margin=1)
    assert pickle.loads(pickle.dumps(r)).key == r.key != dtq.DelayedScaling().key


def test_compiled_quantized_weight_calls_script_nothing(monkeypatch):
    """A quantized weight reaches the compiled GEMM op as payload fields and continues inside it
    as dtq's internal payload container; the op's alias check once handed that container to
    torch's ``_is_alias_of``, which TorchScript-compiled its class on every call (the FP8
    trainer with train.compile ran 7x slower). Nothing may be scripted at run time."""
    import torch.jit._script as script

    compiled_classes = []
    real = script._recursive_compile_class
    monkeypatch.setattr(
        script, "_recursive_compile_class", lambda obj, loc: compiled_classes.append(obj) or real(obj, loc)
    )
    r = dtq.Float8CurrentScaling()
    m = dtq.convert(Block(torch.relu), recipe=r, quantized_params=True)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        with dtq.autocast(r):
            compiled(torch.randn(2, 16, H)).square().mean().backward()
    assert compiled_classes == []
