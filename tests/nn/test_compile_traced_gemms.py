"""Inductor runs a planned call's GEMMs in the compiled graph itself (``dtq.nn._fused_input``'s
decomposition of ``dtq::linear`` / ``dtq::linear_backward``): one small ``dtq::planned_weight`` op
per forward call (the call's bookkeeping and its weight's quantization) and torch's scaled GEMMs
where the two ops ran dtq's Python. On a GPU that is FP8 per-tensor's ``torch._scaled_mm``
(tests/kernels/test_gpu_compile.py). The CPU has no traceable path of its own (its emulated GEMM
holds torch's fp32-matmul flag while it runs, which a graph cannot): here that path is let
through (``traced_emulation``, with inductor rounding as eager does), and the checks are what
the decomposition itself must keep: eager's bits, the bookkeeping a recompute and FSDP2's
gathers read, and the ops kept where the decomposition does not apply (a bias gradient)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dtq
from dtq import gemm

H = 64

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def _let_emulation_trace() -> None:
    """The CPU's emulated GEMM marked traceable (safe here: torch's default fp32 matmul precision
    is the one that path holds)."""
    gemm.PATHS[:] = [dataclasses.replace(p, traceable=True) if p.name == "emulated" else p for p in gemm.PATHS]
    gemm._chosen.clear()


@pytest.fixture
def traced_emulation(monkeypatch):
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import fresh_cache

    # (the emulation's cast to the output dtype is inductor's code here, fused into what reads it)
    monkeypatch.setattr(inductor_config, "emulate_precision_casts", True)
    monkeypatch.setattr(gemm, "PATHS", list(gemm.PATHS))
    monkeypatch.setattr(gemm, "_chosen", {})
    _let_emulation_trace()
    with fresh_cache():  # (a cached graph of the same trace would skip the decomposition)
        yield


class Block(torch.nn.Module):
    def __init__(self, up_bias: bool = False):
        super().__init__()
        self.qkv = torch.nn.Linear(H, 3 * H, bias=False)
        self.up = torch.nn.Linear(H, 2 * H, bias=up_bias)
        self.down = torch.nn.Linear(H, H, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + torch.relu(q) * k + v
        g, u = self.up(x).chunk(2, dim=-1)
        return x + self.down(torch.relu(g) * u)


def _model(up_bias: bool = False):
    torch.manual_seed(0)
    return dtq.convert(Block(up_bias))


def _x():
    return torch.randn(2, 16, H, generator=torch.Generator().manual_seed(1))


def _step(model, x, recipe, seed, wrap=None):
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    with dtq.autocast(recipe):
        y = wrap(model, x) if wrap is not None else model(x)
    y.float().square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [y.detach(), x.grad, *grads]


def _dtq_ops(code: list[str]) -> list[str]:
    import re

    return re.findall(r"torch\.ops\.dtq\.(\w+)\.default\(", "".join(code))


@pytest.mark.usefixtures("traced_emulation")
def test_inductor_runs_the_gemms_of_planned_calls_in_the_graph():
    """No ``dtq::linear_fw`` / ``linear_backward`` call: one ``planned_weight`` per GEMM, the
    eager bits over two steps, and the bookkeeping done (each GEMM's state names the recipe, as
    FSDP2's gathers and a recompute read it). A call with a bias gradient keeps its backward op
    (inductor's reduction would sum db in another order than eager)."""
    from torch._inductor.utils import run_and_get_code

    r = dtq.Float8CurrentScaling()
    for up_bias in (False, True):
        torch._dynamo.reset()
        eager, model = _model(up_bias), _model(up_bias)
        compiled = torch.compile(model, fullgraph=True)
        for step in range(2):
            want = _step(eager, _x(), r, 10 + step)
            got, code = run_and_get_code(_step, compiled, _x(), r, 10 + step)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (up_bias, step)
            if step == 0:
                ops = _dtq_ops(code)
                assert ops.count("planned_weight") == 3, ops
                assert "linear_fw" not in ops, ops
                assert ops.count("linear_backward") == (1 if up_bias else 0), ops
        assert all(m.gemm_state.recipe == r for m in (model.qkv, model.up, model.down))


class _TwoOfOneShape(torch.nn.Module):
    """Two GEMMs of one shape and template, one with a bias: they share one plan."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(H, H, bias=False)
        self.b = torch.nn.Linear(H, H, bias=True)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.usefixtures("traced_emulation")
def test_gemms_of_one_shape_with_and_without_a_bias_keep_their_own_output_dtype():
    """In BF16 a GEMM with a bias writes fp32 (the bias added before the one rounding), one
    without writes BF16; sharing the slots template's plan, the one traced second ran the
    first one's GEMM (the biased output rounded twice)."""
    r = dtq.Float8CurrentScaling()

    def make():
        torch.manual_seed(0)
        return dtq.convert(_TwoOfOneShape().to(torch.bfloat16))

    eager, compiled = make(), torch.compile(make(), fullgraph=True)
    x = _x().to(torch.bfloat16)
    got, want = _step(compiled, x, r, 5), _step(eager, x, r, 5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _checkpoint(m, x):
    return torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False)


def _checkpoint_reentrant(m, x):
    return torch.utils.checkpoint.checkpoint(m, x, use_reentrant=True)


def _save_on_cpu(m, x):
    with torch.autograd.graph.save_on_cpu():
        return m(x)


@pytest.mark.usefixtures("traced_emulation")
@pytest.mark.parametrize("wrap", [_checkpoint, _checkpoint_reentrant, _save_on_cpu], ids=lambda f: f.__name__[1:])
def test_recompute_and_offload_around_blocks_with_traced_gemms(wrap):
    """Checkpoint (both kinds) and save_on_cpu around the compiled block: the eager bits. The
    recompute runs outside dtq.autocast and takes the forward's recipe from the bookkeeping
    ``planned_weight`` did (without it the recompute would run in high precision)."""
    from torch._inductor.utils import run_and_get_code

    r = dtq.Float8CurrentScaling()
    eager, model = _model(), _model()
    compiled = torch.compile(model, fullgraph=True)
    for step in range(2):
        want = _step(eager, _x(), r, 20 + step, wrap)
        got, code = run_and_get_code(_step, compiled, _x(), r, 20 + step, wrap)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
        if step == 0:  # (the recompute's own trace included)
            ops = _dtq_ops(code)
            assert "planned_weight" in ops and "linear_fw" not in ops and "linear_backward" not in ops, ops


@pytest.mark.usefixtures("traced_emulation")
def test_a_forward_outside_autocast_with_a_recompute_pending_is_refused_by_planned_weight():
    """The refusal of the op-based path holds where ``planned_weight`` does the bookkeeping."""
    from torch._inductor.utils import run_and_get_code

    r = dtq.Float8CurrentScaling()
    compiled = torch.compile(_model(), fullgraph=True)
    x = _x().requires_grad_()
    with dtq.autocast(r):
        _, code = run_and_get_code(_checkpoint, compiled, x)
    assert "planned_weight" in _dtq_ops(code) and "linear_fw" not in _dtq_ops(code)
    with pytest.raises(RuntimeError, match="recompute has not run yet"):
        compiled(x)


def _fsdp(rank, world):
    import torch.distributed as dist
    from torch._inductor.utils import fresh_cache, run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _let_emulation_trace()
    import torch._inductor.config

    torch._inductor.config.emulate_precision_casts = True  # (see traced_emulation)
    mesh = init_device_mesh("cpu", (world,))
    r = dtq.Float8CurrentScaling()
    x = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(30 + rank))

    def step(model, opt):
        with dtq.autocast(r):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    for plain_gather in (True, False):
        # one cache per gather mode: the blocks' graphs do not depend on reshard_after_forward,
        # so the second setting runs the first one's (CI time: inductor's CPU compiles)
        with fresh_cache():
            for reshard in (True, False):
                losses = {}
                for compiled in (False, True):
                    torch._dynamo.reset()
                    torch.manual_seed(0)
                    blocks = [dtq.convert(Block()) for _ in range(2)]
                    if plain_gather:  # the GEMMs get plain weights: the graphs run them
                        for b in blocks:
                            dtq.parallel.gather_high_precision(b)
                    if compiled:  # torchtitan's order: compile each block, then shard it
                        blocks = [torch.compile(b, fullgraph=True) for b in blocks]
                    model = torch.nn.Sequential(*blocks)
                    for b in model:
                        fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
                    fully_shard(model, mesh=mesh)
                    opt = torch.optim.SGD(model.parameters(), lr=0.1)
                    first, code = run_and_get_code(step, model, opt)
                    losses[compiled] = [first, step(model, opt)]
                    if compiled and reshard:  # a quantized gather hands the GEMMs quantized weights: the ops run them
                        ops = _dtq_ops(code)
                        assert ("linear_fw" not in ops) == plain_gather, (plain_gather, ops)
                same = all(torch.equal(a, b) for a, b in zip(losses[True], losses[False]))
                assert same, (plain_gather, reshard, losses)
    dist.barrier()


def test_fsdp2_over_blocks_with_traced_gemms_equals_eager():
    """FSDP2 (2 gloo ranks, both reshard_after_forward settings) over blocks compiled, then
    sharded: two steps' losses bitwise the eager sharded model's, with plain gathers (the graphs
    run the GEMMs) and with quantized ones (the weight arrives quantized: the ops run them)."""
    from dtq.testing import spawn

    spawn(_fsdp, 2, backend="gloo", timeout=600)


def test_call_flags_pack_every_combination_into_distinct_codes():
    """The planned ops' constants travel as one int (``CallFlags.code``, to spare per-argument
    dispatch time): every combination decodes to itself, no two share a code, and a dtype the
    table lacks is refused by name."""
    import itertools

    from dtq.nn._ops import _FLAG_DTYPES, CallFlags, call_flags

    dtypes = [d for d in _FLAG_DTYPES if d is not None]
    codes = set()
    for bools in itertools.product((False, True), repeat=5):
        for pair in itertools.product(dtypes, repeat=2):
            flags = CallFlags(*bools, *pair)
            code = flags.code()
            assert call_flags(code) == flags and 0 <= code < 2**63
            codes.add(code)
    assert len(codes) == 2**5 * len(dtypes) ** 2
    with pytest.raises(ValueError, match="compiled GEMM call on torch.uint4 tensors"):
        CallFlags(True, True, x_dtype=torch.uint4).code()


def test_a_compiled_call_on_an_integer_input_runs_as_eagerly():
    """A dtype beside the GEMMs' own (an int32 input, which eager dtq.nn.Linear takes) still
    compiles: the flags name every dtype a caller may hand a module (it was refused while their
    table held the four float dtypes only)."""
    m = dtq.nn.Linear(H, H, params_dtype=torch.bfloat16)
    x = torch.arange(4 * H, dtype=torch.int32).reshape(4, H) % 7 - 3
    r = dtq.Float8CurrentScaling()
    with dtq.autocast(r):
        want = m(x)
        got = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
    assert got.dtype == want.dtype and torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_traced_quantization_casts_twin_directions_once(dtype):
    """Per-tensor FP8's columnwise payload is bitwise its rowwise one (``Quantizer.aliases``): the
    traced quantization (``_fused_input._traced_payloads``, for a GPU plan whose columnwise reads
    ``data_t``) casts x once and transposes those codes. Traced one direction at a time, inductor's
    kernel stored the codes twice, the second copy only to be transposed. Bits: eager's."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dtq.codec import COLUMNWISE, ROWWISE
    from dtq.nn import _fused_input

    q = dtq.Float8Quantizer(dtype=dtype)
    layout = ((ROWWISE, "data", 0), (ROWWISE, "scale_inv", 1), (COLUMNWISE, "data_t", 2), (COLUMNWISE, "scale_inv", 1))
    x = torch.randn(24, 40, dtype=torch.bfloat16) * 100
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -1e30])
    gm = make_fx(lambda x: _fused_input._traced_payloads(q, layout, x, None))(x)
    casts = [
        n
        for n in gm.graph.nodes
        if n.target in (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
        and n.meta["val"].dtype == dtype
    ]
    assert len(casts) == 1, gm.code
    data, scale_inv, data_t = gm(x)
    want = q.quantize(x).payload(ROWWISE)
    assert data.view(torch.uint8).equal(want["data"].view(torch.uint8))
    assert scale_inv.view(torch.int32).equal(want["scale_inv"].view(torch.int32))
    assert data_t.view(torch.uint8).equal(want["data"].t().contiguous().view(torch.uint8))
