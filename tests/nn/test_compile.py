"""torch.compile on models with dtq modules. dtq's GEMMs (quantize, scaled or emulated GEMM, their
backward, TP communication) run eagerly as graph breaks; compile fuses what lies between them.
Between bitwise-exact ops (ReLU) the compiled model gives the eager model's bits; compiled norms
differ from eager ones only by fp32 rounding. Also FSDP2 over compiled blocks (real gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dtq
from dtq.testing import spawn

H = 64
RECIPES = {
    "fp8": dtq.Float8CurrentScaling,
    "fp8_delayed": dtq.DelayedScaling,
    "fp8_row": dtq.Float8RowwiseScaling,
    "hybrid": lambda: dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling()),  # SR gradients
}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


class ReLUMLP(torch.nn.Module):
    """Straight-line forward: dynamo resumes after each dtq GEMM's graph break and compiles the
    ReLU (inside an nn.Sequential's loop a graph break makes dynamo run the whole frame eagerly)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(H, 2 * H), torch.nn.Linear(2 * H, H)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * 0.5)


def _mlp(quantized_params: bool, recipe):
    torch.manual_seed(0)
    return dtq.convert(ReLUMLP(), recipe=recipe if quantized_params else None, quantized_params=quantized_params)


def _compiled_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _step(model, x, recipe, seed=5):
    """Output, input grad and parameter grads of one step (SR seeds drawn from the same RNG state)."""
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    with dtq.autocast(recipe):
        y = model(x)
    y.float().square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [y.detach(), x.grad, *grads]


def _local(t):
    t = t._local_tensor if hasattr(t, "_local_tensor") else t
    return t.__dtq_unwrap__() if hasattr(t, "__dtq_unwrap__") else t


MODULES = {
    "linear_relu_linear": None,  # _mlp
    "layernorm_mlp_swiglu": lambda: dtq.nn.LayerNormMLP(H, 2 * H, activation="swiglu"),
    "layernorm_linear": lambda: dtq.nn.LayerNormLinear(H, H),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("module", list(MODULES))
def test_compiled_model_gives_the_eager_bits(recipe, module):
    """aot_eager (dynamo + AOTAutograd, aten ops run as they are): bitwise the eager model's outputs
    and gradients, twice (the second call runs the cached graphs); quantized parameters too."""
    r = RECIPES[recipe]()
    x = torch.randn(32, H, generator=torch.Generator().manual_seed(1))
    variants = [False, True] if MODULES[module] is None else [False]
    torch._dynamo.utils.counters.clear()
    for quantized_params in variants:

        def make(quantized_params=quantized_params):
            if MODULES[module] is None:
                return _mlp(quantized_params, r)
            torch.manual_seed(0)
            return MODULES[module]()

        eager_model, compiled_model = make(), make()
        compiled = torch.compile(compiled_model, backend="aot_eager")
        for _ in range(2):
            eager = _step(eager_model, x, r)  # the same step count on both (delayed scaling histories)
            got = _step(compiled, x, r)
            for a, b in zip(got, eager):
                assert torch.equal(_local(a), _local(b)), (module, recipe, quantized_params)
    assert _compiled_graphs() > 0  # something was compiled (a later variant may reuse the graphs)


def test_inductor_compiles_around_dtq_gemms():
    """The default backend (inductor's generated code between the GEMMs: ReLU, bitwise exact)."""
    r = RECIPES["hybrid"]()
    x = torch.randn(32, H, generator=torch.Generator().manual_seed(2))
    eager = _step(_mlp(False, r), x, r)
    torch._dynamo.utils.counters.clear()
    with dtq.gemm.record_paths() as paths:
        got = _step(torch.compile(_mlp(False, r)), x, r)
    assert len(paths) == 6  # three GEMMs per dtq Linear ran (eagerly)
    assert _compiled_graphs() > 0  # and inductor compiled the rest
    for a, b in zip(got, eager):
        assert torch.equal(_local(a), _local(b))


def test_inductor_caches_dtq_graphs_across_compiles():
    """Inductor's FX graph cache keys a graph by pickling it with its inputs; a dtq module's handle
    (an opaque graph input holding a weak reference) could not be pickled, so every dtq graph
    bypassed the cache and was compiled again in every process. Now the second compile of the
    same structure is a cache hit, and the cached graph still reaches the module it is called
    with: a second model with other weights gets its own eager bits."""
    import warnings

    from torch._inductor.utils import fresh_cache

    r = RECIPES["fp8"]()
    x = torch.randn(32, H, generator=torch.Generator().manual_seed(3))
    counters = torch._dynamo.utils.counters
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*_stable_hash_for_caching")  # dtq's subclasses key themselves
        for seed in (0, 1):
            torch._dynamo.reset()
            counters.clear()
            model = _mlp(False, r)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 + seed)  # other weights: a graph that reached the first model fails
            eager = _step(model, x, r)
            got = _step(torch.compile(model), x, r)
            for a, b in zip(got, eager):
                assert torch.equal(_local(a), _local(b)), seed
            assert counters["inductor"]["fxgraph_cache_bypass"] == 0, dict(counters["inductor"])
        assert counters["inductor"]["fxgraph_cache_hit"] > 0, dict(counters["inductor"])


def test_subclasses_key_caches_by_layout_not_values():
    """AOTAutograd's cache key of a dtq tensor subclass: equal for the same layout with other
    values, different for another format or shape."""
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    fp8, mx = dtq.Float8Quantizer(), dtq.MXFP8Quantizer()
    assert fp8.quantize(a)._stable_hash_for_caching() == fp8.quantize(b)._stable_hash_for_caching()
    assert fp8.quantize(a)._stable_hash_for_caching() != mx.quantize(a)._stable_hash_for_caching()
    assert fp8.quantize(a)._stable_hash_for_caching() != fp8.quantize(a[:32])._stable_hash_for_caching()
    w = dtq.HighPrecisionWeight
    assert w(a)._stable_hash_for_caching() == w(b)._stable_hash_for_caching() != w(a.T)._stable_hash_for_caching()


def _fsdp_compiled_blocks(rank, world, quantized_params):
    r = RECIPES["hybrid"]()
    mesh = init_device_mesh("cpu", (world,))

    def sharded(compile_blocks: bool):
        torch.manual_seed(0)
        blocks = [_mlp(quantized_params, r) for _ in range(2)]
        if compile_blocks:  # torchtitan's order: compile each block, then shard it
            blocks = [torch.compile(b, backend="aot_eager", fullgraph=True) for b in blocks]
        model = torch.nn.Sequential(*blocks)
        for b in model:
            fully_shard(b, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    x = torch.randn(16, H, generator=torch.Generator().manual_seed(10 + rank))
    eager = _step(sharded(False), x, r)
    dtq.parallel.comm_stats(reset=True)
    got = _step(sharded(True), x, r)
    stats = dtq.parallel.comm_stats(reset=True)
    assert stats and all(k in ("mxfp8/rowwise", "nvfp4/columnwise") for k in stats), stats  # still quantized gathers
    for a, b in zip(got, eager):
        assert torch.equal(_local(a), _local(b))
    dist.barrier()


@pytest.mark.parametrize("quantized_params", [False, True])
def test_fsdp2_over_compiled_blocks(quantized_params):
    spawn(_fsdp_compiled_blocks, 2, quantized_params, backend="gloo")  # CPU blocks, whatever GPUs there are


def _no_pairwise(*args):
    raise AssertionError("real tensors take the storage-address comparison, not the pairwise one (fake tensors')")


@pytest.mark.parametrize("wrapped", [False, True])
def test_op_outputs_alias_no_input_and_no_other_output(wrapped, monkeypatch):
    """The GEMM ops' outputs (``_ops._unaliased``): one sharing a storage with an input or with an
    earlier output is copied, a fresh contiguous one passes as it is, all come out contiguous;
    dtq's weight wrapper counts as the tensor it wraps."""
    from dtq.nn import _ops
    from dtq.weights import HighPrecisionWeight

    monkeypatch.setattr(_ops, "_unaliased_pairwise", _no_pairwise)

    x, w, fresh = torch.randn(8, 4), torch.randn(4, 4), torch.randn(4, 8)
    inputs = (x, HighPrecisionWeight.wrap(w) if wrapped else w, None)
    flat = [x[:2], fresh, fresh.t(), x.t(), w]
    out = _ops._unaliased(flat, inputs)
    assert out[1] is fresh
    assert all(a.is_contiguous() and torch.equal(a, b) for a, b in zip(out, flat))
    views = [x, w, *out]
    assert not any(torch._C._is_alias_of(a, b) for i, a in enumerate(views) for b in views[i + 1 :])


def test_op_outputs_alias_no_payload_of_a_quantized_input(monkeypatch):
    """A quantized input (a weight parameter) counts as its payload tensors."""
    from dtq.nn import _ops

    monkeypatch.setattr(_ops, "_unaliased_pairwise", _no_pairwise)

    qw = dtq.Float8Quantizer().quantize(torch.randn(16, 16))
    codes = qw.payload("rowwise")["data"]
    fresh = torch.randn(3)
    out = _ops._unaliased([codes, fresh], (torch.randn(2), qw, None))
    assert out[1] is fresh and out[0] is not codes and torch.equal(out[0].view(torch.uint8), codes.view(torch.uint8))
    assert not torch._C._is_alias_of(out[0], codes)


class GatedMLP(torch.nn.Module):
    """fc2's input and fc1's output gradient come from pointwise ops (relu * mul and its backward),
    which inductor fuses the FP8 casts into, computing them in fp32: the casts must read the BF16
    values eager rounds them to."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(H, 2 * H, bias=False), torch.nn.Linear(H, H, bias=False)

    def forward(self, x):
        a, b = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(torch.relu(a) * b)


def test_inductor_fuses_the_fp8_input_quantization():
    """Under inductor a per-tensor FP8 input quantization is plain ops (``dtq.nn._fused_input``), no
    ``dtq::quantize_input`` call: bitwise the eager model where inductor runs eager's kernels around
    the GEMMs (ReLU), also where it fuses the casts of x and dy into relu * mul and its backward,
    as with the ops kept (the decompositions taken out). A recipe it does not cover (row-wise
    scales) keeps the op."""
    from torch._inductor.utils import fresh_cache, run_and_get_code

    from dtq.nn import _fused_input

    r = RECIPES["fp8"]()
    x = torch.randn(32, H, generator=torch.Generator().manual_seed(4))
    eager = _step(_mlp(False, r), x, r)
    got, code = run_and_get_code(_step, torch.compile(_mlp(False, r)), x, r)
    assert all(torch.equal(_local(a), _local(b)) for a, b in zip(got, eager))
    assert "float8_e4m3fn" in "".join(code)  # inductor's own cast
    assert not any("torch.ops.dtq.quantize_input" in c for c in code)

    def gated_step(compiled: bool):
        torch.manual_seed(0)
        model = dtq.convert(GatedMLP().to(torch.bfloat16))
        return _step(torch.compile(model) if compiled else model, x.bfloat16(), r)

    eager = gated_step(False)
    fused, code = run_and_get_code(gated_step, True)
    assert not any("torch.ops.dtq.quantize_input" in c or "torch.ops.dtq.quantize_grad" in c for c in code)
    _fused_input.set_decomposed(False)
    try:
        torch._dynamo.reset()
        with fresh_cache():  # (the caches key a graph by what dynamo traced, which is the same)
            kept, code = run_and_get_code(gated_step, True)
    finally:
        _fused_input.set_decomposed(True)
    ops = "".join(code)
    assert "torch.ops.dtq.quantize_input" in ops and "torch.ops.dtq.quantize_grad" in ops
    for got in (fused, kept):
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, eager))

    torch._dynamo.reset()
    row = RECIPES["fp8_row"]()
    _, code = run_and_get_code(_step, torch.compile(_mlp(False, row)), x, row)
    assert any("torch.ops.dtq.quantize_input" in c for c in code)


def test_fp8_quantization_fuses_after_other_compiles(tmp_path):
    """Inductor copies its decomposition table at its first compile in a process; dtq's entries,
    added when a dtq module is first traced, must reach compiles after that one too (they did
    not: a process that compiled anything before its dtq model ran dtq's quantize ops unfused)."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent(
        """
        import torch, dtq
        from torch._inductor.utils import run_and_get_code
        torch.compile(lambda t: t.sin() + 1)(torch.randn(8))  # an inductor compile before dtq's
        torch.manual_seed(0)
        mlp = dtq.convert(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)))
        x = torch.randn(32, 64, requires_grad=True)

        def step():
            with dtq.autocast(dtq.Float8CurrentScaling()):
                y = torch.compile(mlp)(x)
            y.square().sum().backward()

        _, code = run_and_get_code(step)
        print(sum("torch.ops.dtq.quantize_" in c for c in code))
        """
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "0", proc.stdout
