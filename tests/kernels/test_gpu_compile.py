"""GPU only (skipped elsewhere): a compiled dtq block on CUDA, where the GEMMs run the CUDA kernels
and torch's scaled GEMMs. fullgraph inductor equals eager bitwise; a training step makes no host
synchronisation (``torch.cuda.set_sync_debug_mode("error")``); and the recipes docs/compile.md
lists as CUDA-graph safe run under ``mode="reduce-overhead"`` with eager's losses."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import dtq
from dtq import kernels
from tests._recipe_matrix import RECIPES

pytestmark = [
    pytest.mark.skipif(
        not (torch.cuda.is_available() and kernels.available("cuda")),
        reason="needs a CUDA GPU with dtq's kernels (sm_90+)",
    ),
    pytest.mark.usefixtures("fresh_dynamo", "eager_rounding"),
]  # tests/conftest.py


@pytest.fixture
def eager_rounding(monkeypatch):
    """Inductor rounds every BF16 intermediate as eager does (``emulate_precision_casts``). Where
    inductor runs a GEMM itself (per-tensor FP8, ``dtq.nn._fused_input``), no op call forces the
    tensors around it into memory, and inductor then keeps a residual sum or a gradient sum that
    a later add reads again in fp32 where eager rounds it to BF16: any compiled model's
    difference, not dtq's (dtq's quantizations read stored values either way)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "emulate_precision_casts", True)


H = 256
ALL = {**RECIPES, "fp8_high_precision_bwd": lambda: dtq.Float8CurrentScaling(backward_override="high_precision")}
# Recipes whose step is a fixed sequence of kernels on fixed buffers: no host-side state that a
# CUDA-graph replay would skip (delayed scaling's Python-side scale records, stochastic rounding's
# per-call seeds are drawn outside what a replay repeats).
CUDA_GRAPH_SAFE = ("fp8", "fp8_block", "fp8_row", "mxfp8", "fp8_dequantized_bwd", "fp8_high_precision_bwd")


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        kw = {"dtype": torch.bfloat16, "device": "cuda"}
        self.qkv = torch.nn.Linear(H, 3 * H, bias=False, **kw)
        self.o = torch.nn.Linear(H, H, bias=False, **kw)
        self.up = torch.nn.Linear(H, 2 * H, bias=False, **kw)
        self.down = torch.nn.Linear(H, H, bias=False, **kw)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, H // 2).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, H)
        x = x + self.o(a)
        g, u = self.up(x).chunk(2, dim=-1)
        return x + self.down(torch.relu(g) * u)  # relu and mul: compiled bits equal eager's


def _model():
    torch.manual_seed(0)
    return dtq.convert(Block())


def _x():
    return torch.randn(2, 128, H, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(1))


def _step(model, x, recipe, seed):
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    with dtq.autocast(recipe):
        y = model(x)
    y.float().square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [y.detach(), x.grad, *grads]


@pytest.mark.parametrize("recipe", list(ALL))
def test_fullgraph_inductor_on_cuda_equals_eager(recipe):
    r = ALL[recipe]()
    eager, model = _model(), _model()
    compiled = torch.compile(model, fullgraph=True)
    x = _x()
    for step in range(2):
        want = _step(eager, x, r, 10 + step)
        got = _step(compiled, x, r, 10 + step)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (recipe, step, i)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("recipe", list(ALL))
def test_training_step_makes_no_host_sync(recipe, compiled):
    r = ALL[recipe]()
    model = _model()
    if compiled:
        model = torch.compile(model, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = _x()

    def step():
        with dtq.autocast(r):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up: compilation, kernel build, first-use allocations
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("recipe", CUDA_GRAPH_SAFE)
def test_cuda_graphs_reduce_overhead_equals_eager(recipe):
    r = ALL[recipe]()
    eager, model = _model(), _model()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    x = _x()
    for step in range(4):  # cudagraph trees record on the second call and replay after
        want = _step(eager, x, r, 30 + step)
        got = _step(compiled, x, r, 30 + step)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (recipe, step, i)


def _recorded_cuda_graphs(device_index: int) -> int:
    """How many CUDA graphs inductor's cudagraph trees recorded on the device (0: none, or no tree)."""
    from torch._inductor.cudagraph_trees import get_manager

    manager = get_manager(device_index, create_if_none_exists=False)
    return 0 if manager is None else len(manager.ids_to_funcs)


# torch 2.11's inductor counts an opaque graph input (the GemmHandle dtq's GEMM ops take) as a
# "non-Tensor input" and, with graph partitions, skips CUDA graphs without a word; torch 2.13 takes
# opaque inputs. Strict: the day 2.11-style runs record graphs, this says so.
_OPAQUE_INPUTS_REFUSED = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


@pytest.mark.xfail(
    _OPAQUE_INPUTS_REFUSED, strict=True, reason="torch < 2.13: cudagraph trees refuse opaque graph inputs"
)
def test_reduce_overhead_records_cuda_graphs():
    """mode="reduce-overhead" really runs dtq's compiled step under CUDA graphs: inductor skips them
    silently for a graph it cannot capture (equal losses do not show it: the step then just runs
    without graphs)."""
    r = dtq.Float8CurrentScaling()
    model = torch.compile(_model(), mode="reduce-overhead", fullgraph=True)
    x = _x()
    before = _recorded_cuda_graphs(torch.cuda.current_device())
    for step in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        _step(model, x, r, 40 + step)
    assert _recorded_cuda_graphs(torch.cuda.current_device()) > before


def test_inductor_fuses_the_fp8_input_quantization_on_cuda():
    """Per-tensor FP8 inputs are quantized by inductor's own kernels (``dtq.nn._fused_input``), fused
    into their producers (SDPA's output copy, relu * mul), with eager's bits: the division in fp64
    and x's stored bf16 values (not inductor's fp32 intermediates) make them so."""
    from torch._inductor.utils import run_and_get_code

    r = ALL["fp8"]()
    want = _step(_model(), _x(), r, 3)
    got, code = run_and_get_code(_step, torch.compile(_model(), fullgraph=True), _x(), r, 3)
    assert not any("torch.ops.dtq.quantize_input" in c for c in code)
    # The transposed codes dgrad and wgrad read come from the tiled kernel, not inductor's copy.
    assert any("torch.ops.dtq.transposed_codes" in c for c in code)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("wrap", [None, "checkpoint"])
def test_inductor_runs_the_fp8_gemms_in_the_graph_on_cuda(wrap, monkeypatch):
    """FP8 per-tensor calls on high-precision weights run torch's scaled GEMMs from the compiled
    graph (``dtq.nn._fused_input``): no ``dtq::linear_fw`` / ``linear_backward`` call, one
    ``dtq::planned_weight`` per GEMM, which quantizes the weight with the kernel library's one
    launch, and eager's bits, also when a checkpoint around the compiled block recomputes it."""
    from torch._inductor.utils import run_and_get_code

    from dtq.nn import linear_native

    launched = []  # per planned_weight call: whether the library's launch ran it
    payloads = linear_native.payloads

    def spy(plan, which, t, known=None):
        out = payloads(plan, which, t, known)
        if which == linear_native.WEIGHT:
            launched.append((type(t).__name__, out is not None))
        return out

    monkeypatch.setattr(linear_native, "payloads", spy)
    r = ALL["fp8"]()
    ckpt = (lambda m, x: torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False)) if wrap else None

    def step(model, seed):
        torch.manual_seed(seed)
        x = _x().requires_grad_()
        with dtq.autocast(r):
            y = ckpt(model, x) if ckpt else model(x)
        y.float().square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return [y.detach(), x.grad, *grads]

    eager, compiled = _model(), torch.compile(_model(), fullgraph=True)
    for s in range(2):
        want = step(eager, s)
        got, code = run_and_get_code(step, compiled, s)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (s, i)
        if s == 0:
            text = "".join(code)
            assert "torch.ops.dtq.linear_fw" not in text and "torch.ops.dtq.linear_backward" not in text
            # one per GEMM in each forward graph (a checkpoint's recompute traces a second one)
            calls = text.count("torch.ops.dtq.planned_weight.default(")
            assert calls == (8 if wrap else 4), calls
            assert "_scaled_mm" in text
    assert launched and all(ran for _, ran in launched), launched


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_tritons_fp8_conversion_is_the_reference_cast_for_every_fp32(dtype):
    """What inductor's traced quantization compiles on CUDA (``_bits.cast_fp8(triton=True)``: the
    plain conversion, no clamp, no NaN fix-up) against the reference cast, over all 2^32 fp32 bit
    patterns: Triton's conversion saturates and turns every NaN (either sign) into 0x7F."""
    from dtq import _bits

    convert = torch.compile(lambda v: _bits.cast_fp8(v, dtype, triton=True), backend="inductor", fullgraph=True)
    chunk = 1 << 26
    for start in range(0, 1 << 32, chunk):
        bits = torch.arange(start, start + chunk, device="cuda", dtype=torch.int64)
        v = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
        want = _bits.cast_fp8(v, dtype).view(torch.uint8)
        got = convert(v).view(torch.uint8)
        if not torch.equal(got, want):
            i = int((got != want).nonzero()[0, 0])
            raise AssertionError(f"{dtype} 0x{start + i:08x}: want 0x{int(want[i]):02x}, got 0x{int(got[i]):02x}")


def _fp8_linear_code(seed: int) -> str:
    """Inductor's generated code for an FP8 step of a converted Linear, after checking that the
    compiled step's output and gradients are eager's, bit for bit."""
    from torch._inductor.utils import run_and_get_code

    model = dtq.convert(torch.nn.Sequential(torch.nn.Linear(H, H, bias=False, device="cuda", dtype=torch.bfloat16)))
    want = _step(model, _x(), ALL["fp8"](), seed)
    got, code = run_and_get_code(_step, torch.compile(model, fullgraph=True), _x(), ALL["fp8"](), seed)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i
    return "".join(code)


def test_inductor_stores_each_fp8_quantization_once_on_cuda():
    """Per-tensor FP8's two directions hold the same codes: the compiled graph casts and stores x
    (and dy) once, for the GEMM and for the transposed copy dgrad and wgrad read. Traced one
    direction at a time, inductor's cast kernel stored the codes twice (two FP8 buffers where one
    does)."""
    text = _fp8_linear_code(seed=3)
    assert "torch.ops.dtq.transposed_codes" in text  # (dgrad's and wgrad's [K, M] codes)
    # inductor's own FP8 buffers (the transposed copies and the weight's codes come from dtq's ops)
    buffers = re.findall(r"= empty_strided_cuda\(.*(float8_e4m3fn|float8_e5m2)\)", text)
    assert sorted(buffers) == ["float8_e4m3fn", "float8_e5m2"], buffers  # x's codes; dy's


def test_inductors_fp8_casts_take_the_scale_computed_once_on_cuda():
    """The per-tensor scale (``fmax / amax``, divided in fp64 for exact fp32 bits) is a 0-dim value
    inductor would inline into every element of the cast kernel: a float64 division per element
    (about 7 us more on an [8192, 6144] gradient on an H200). ``Float8Codec.traced_quantize``
    stores it first, so no kernel that writes FP8 codes computes in float64, and the bits stay
    eager's."""
    kernels_src = [k.split("'''")[1] for k in _fp8_linear_code(seed=4).split("async_compile.triton(")[1:]]
    casts = [k for k in kernels_src if re.search(r"\.to\(tl\.float8", k)]
    assert casts, "no Triton kernel writes FP8 codes"
    assert not [k for k in casts if "tl.float64" in k], [k[:200] for k in casts if "tl.float64" in k]
