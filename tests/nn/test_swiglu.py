"""Fused SwiGLU (dtq.nn.functional.swiglu, csrc/swiglu.cu) and the emulated GEMMs' fused epilogue
(csrc/epilogue.cu).

CPU: the fp32 reference against float64 math (its error is a few fp32 ulps before the final
rounding, so it must agree with float64 rounded to the dtype up to one ulp of that dtype), the
gate/up block layouts, autograd, errors. GPU: the kernels against the same reference run through
torch's CUDA ops, bit for bit, vectorized and scalar paths, edge values included.
"""

from __future__ import annotations

import operator

import pytest
import torch

import dtq
from dtq import kernels
from dtq.nn import _ops
from dtq.nn.functional import swiglu, swiglu_backward_reference, swiglu_reference

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="needs the CUDA kernels (an sm_90+ GPU)")


def _split(x: torch.Tensor, block: int):
    pairs = x.unflatten(-1, (-1, 2, block))
    return pairs.select(-2, 0).flatten(-2), pairs.select(-2, 1).flatten(-2)


def _f64_grads(x: torch.Tensor, dh: torch.Tensor, block: int):
    x64 = x.double().requires_grad_(True)
    a, b = _split(x64, block)
    h = torch.nn.functional.silu(a) * b
    h.backward(dh.double())
    return h.detach(), x64.grad


def _ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at |t| (its smallest normal spacing below)."""
    fi = torch.finfo(dtype)
    e = torch.floor(torch.log2(t.abs().clamp_min(fi.tiny)))
    return torch.exp2(e - (fi.bits - 1 - {torch.float32: 8, torch.bfloat16: 8, torch.float16: 5}[dtype]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [None, 4])
def test_reference_matches_float64_within_one_ulp(dtype, block):
    torch.manual_seed(0)
    x = (torch.randn(64, 2 * 48) * 3).to(dtype)
    dh = torch.randn(64, 48).to(dtype)
    blk = 48 if block is None else block
    h64, dx64 = _f64_grads(x, dh, blk)
    h = swiglu_reference(x, blk)
    dx = swiglu_backward_reference(dh, x, blk)
    assert h.dtype == dtype and dx.dtype == dtype and dx.shape == x.shape
    # fp32 math is ~1e-6 relative before the final rounding: within one ulp of the dtype (fp32: a
    # few); silu's derivative 1 + a (1 - s) cancels near a = -1.28, hence an absolute term of fp32
    # rounding on the magnitudes involved
    slack = 4 if dtype == torch.float32 else 1
    cancel = 2**-22 * float(dh.abs().max()) * (1 + float(x.abs().max())) ** 2
    assert ((h.double() - h64).abs() <= slack * _ulp(h64, dtype)).all()
    assert ((dx.double() - dx64).abs() <= slack * _ulp(dx64, dtype) + cancel).all()


def test_block_layouts_are_a_column_permutation():
    torch.manual_seed(1)
    F, B = 24, 4
    x = torch.randn(10, 2 * F)
    # the interleaved layout of the same gate/up columns
    a, b = x[:, :F], x[:, F:]
    inter = torch.stack((a.unflatten(-1, (-1, B)), b.unflatten(-1, (-1, B))), dim=-2).flatten(-3)
    assert torch.equal(swiglu(x), swiglu(inter, B))
    dh = torch.randn(10, F)
    xa = x.clone().requires_grad_(True)
    xi = inter.clone().requires_grad_(True)
    swiglu(xa).backward(dh)
    swiglu(xi, B).backward(dh)
    ga, gb = _split(xi.grad, B)
    assert torch.equal(xa.grad, torch.cat((ga, gb), dim=-1))


def test_autograd_matches_eager_silu_mul_in_fp32():
    torch.manual_seed(2)
    x = torch.randn(3, 5, 16, requires_grad=True)
    dh = torch.randn(3, 5, 8)
    swiglu(x).backward(dh)
    xr = x.detach().clone().requires_grad_(True)
    a, b = xr.chunk(2, dim=-1)
    (torch.nn.functional.silu(a) * b).backward(dh)
    torch.testing.assert_close(x.grad, xr.grad, rtol=2e-6, atol=1e-7)  # both fp32: a few ulps


def test_layernorm_mlp_uses_it():
    torch.manual_seed(3)
    mlp = dtq.nn.LayerNormMLP(16, 24, activation="swiglu", normalization="RMSNorm", swiglu_interleave=8)
    x = torch.randn(6, 16)
    h = torch.nn.functional.linear(mlp.norm(x), mlp.fc1_weight, mlp.fc1_bias)
    ref = torch.nn.functional.linear(swiglu_reference(h, 8), mlp.fc2_weight, mlp.fc2_bias)
    assert torch.equal(mlp(x), ref)


def _linear_run(recipe, x_amax_scale=None, grad_amax_scale=None, offer=lambda dy: dy, then=lambda dy: None):
    """One dtq.nn.Linear forward + backward; with scales, given max|x| and max|dy| times them
    (max|dy| offered for the tensor ``offer(dy)``, by default dy itself; ``then(dy)`` runs after
    the offer)."""
    from dtq.nn.functional import AmaxLink

    torch.manual_seed(4)
    lin = dtq.nn.Linear(32, 64, name="lin")
    x = torch.randn(64, 32, requires_grad=True)
    dy = torch.randn(64, 64)
    link = AmaxLink() if grad_amax_scale is not None else None
    x_amax = None if x_amax_scale is None else x.detach().abs().amax() * x_amax_scale
    with dtq.autocast(recipe):
        y = lin._linear(x, lin.weight, lin.bias, x_amax=x_amax, link=link)
    if link is not None:
        link.offer_grad_amax(offer(dy), dy.abs().amax() * grad_amax_scale)
    then(dy)
    y.backward(dy)
    if link is not None:
        assert link.grad_amax is None  # read (and cleared) by the backward
    return y.detach(), x.grad, lin.weight.grad


@pytest.mark.parametrize(
    "recipe, used",
    [
        (dtq.Float8CurrentScaling(), True),
        (dtq.NVFP4BlockScaling(), True),
        (dtq.MXFP8BlockScaling(), False),
        (dtq.DelayedScaling(), False),
    ],
)
def test_known_amax_reaches_current_scaling_only(recipe, used):
    """A GEMM given max|x| (x_amax) and max|dy| (through an AmaxLink) quantizes exactly as it would
    have computed them; a wrong value changes the result only where current scaling reads it."""
    plain = _linear_run(recipe)
    exact = _linear_run(recipe, 1.0, 1.0)
    for a, b in zip(plain, exact):
        assert torch.equal(a, b)
    wrong_x = _linear_run(recipe, 3.0, 1.0)
    wrong_g = _linear_run(recipe, 1.0, 3.0)
    assert torch.equal(exact[0], wrong_g[0])  # the forward never sees the gradient's amax
    assert torch.equal(exact[0], wrong_x[0]) != used
    assert torch.equal(exact[1], wrong_g[1]) != used


def test_an_offered_grad_amax_holds_only_for_its_own_gradient():
    """max|dx| offered through an AmaxLink is read only by a backward that receives that very dx,
    unchanged. Where the up projection's output also feeds another op, autograd hands its
    backward the sum of two gradients (another tensor, or dx added to in place), whose max|.| is
    not dx's: the link's amax used to be read anyway, quantizing that sum with a wrong scale. The
    GEMM now runs its own amax pass and gives the plain run's bits."""
    recipe = dtq.Float8CurrentScaling()
    plain = _linear_run(recipe)
    assert not torch.equal(plain[1], _linear_run(recipe, None, 3.0)[1])  # a wrong amax is read
    other = _linear_run(recipe, None, 3.0, offer=torch.clone)
    changed = _linear_run(recipe, None, 3.0, then=lambda dy: dy.mul_(1.0))  # same values, a new version
    for got in (other, changed):
        for a, b in zip(plain, got):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "shape, block, match",
    [
        ((4, 7), None, "must be even"),
        ((4, 12), 4, "block=4 must divide half the last dim"),
        ((4, 12), 0, "block=0"),
    ],
)
def test_bad_input_errors(shape, block, match):
    with pytest.raises(ValueError, match=match):
        swiglu(torch.randn(shape), block)
    with pytest.raises(ValueError, match="floating point"):
        swiglu(torch.ones(4, 8, dtype=torch.int32))


# -- GPU: bits of the kernels ------------------------------------------------------------------


def _edge_values(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    fi = torch.finfo(dtype)
    special = torch.tensor(
        [
            0.0,
            -0.0,
            1.0,
            -1.0,
            88.0,
            -88.0,
            104.0,
            -104.0,
            fi.max,
            -fi.max,
            fi.tiny,
            float("inf"),
            float("-inf"),
            float("nan"),
            1e-3,
            -20.0,
        ],
        dtype=torch.float32,
    )
    return special.repeat(n // special.numel() + 1)[:n].to(dtype).to(device)


def _assert_bits(a: torch.Tensor, b: torch.Tensor):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "rows, F, block, offset",
    [
        (512, 1024, None, 0),  # halves, vectorized
        (300, 96, 32, 0),  # interleaved, vectorized
        (33, 12, None, 0),  # F not a multiple of the 16-bit dtypes' vector width: scalar (fp32: 4-wide)
        (64, 64, 64, 1),  # misaligned base pointer: scalar
        (7, 40, 8, 0),
    ],
)
def test_kernel_bits_match_reference_on_cuda(dtype, rows, F, block, offset):
    torch.manual_seed(4)
    blk = F if block is None else block
    n = rows * 2 * F
    flat = (torch.randn(n + offset, device="cuda") * 4).to(dtype)
    flat[offset : offset + 64] = _edge_values(64, dtype, "cuda")
    x = flat[offset:].view(rows, 2 * F)
    dh = (torch.randn(rows, F, device="cuda") * 2).to(dtype)
    dh.view(-1)[:32] = _edge_values(32, dtype, "cuda")
    h_ref, dx_ref = swiglu_reference(x, blk), swiglu_backward_reference(dh, x, blk)
    h, no_amax = kernels.swiglu(x, blk)
    assert no_amax is None
    _assert_bits(h, h_ref)
    _assert_bits(kernels.swiglu_backward(dh, x, blk)[0], dx_ref)
    # max|out| handed to the next quantization: the amax kernel's bits of the same values
    for (out, amax), ref in (
        (kernels.swiglu(x, blk, want_amax=True), h_ref),
        (kernels.swiglu_backward(dh, x, blk, want_amax=True), dx_ref),
    ):
        _assert_bits(out, ref)
        assert torch.equal(amax.view(torch.int32), kernels.amax(ref, True, None)[0].view(torch.int32))
    # through autograd, with a leading batch dim and a non-contiguous (expanded) gradient
    xa = x.view(1, rows, 2 * F).clone().requires_grad_(True)
    h = swiglu(xa, block)
    _assert_bits(h[0], swiglu_reference(x, blk))
    h.sum().backward()
    _assert_bits(xa.grad[0], swiglu_backward_reference(torch.ones_like(dh), x, blk))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_amax_is_the_max_over_every_block(dtype):
    """Finite inputs, the largest output in the last rows (the last CTA's share of a strided grid):
    the handed-over amax must equal the amax kernel's over the whole output."""
    torch.manual_seed(9)
    rows, F = 4096, 512
    x = torch.randn(rows, 2 * F, device="cuda").to(dtype)
    x[-1, F - 1], x[-1, -1] = 8.0, 50.0  # h[-1, -1] = silu(8) * 50, the largest by far
    dh = torch.randn(rows, F, device="cuda").to(dtype)
    dh[-1, -1] = 100.0
    for out, amax in (kernels.swiglu(x, F, want_amax=True), kernels.swiglu_backward(dh, x, F, want_amax=True)):
        expect = kernels.amax(out, True, None)[0]
        assert torch.isfinite(expect) and expect > 0
        assert torch.equal(amax.view(torch.int32), expect.view(torch.int32))
        assert amax == out.abs().max().float()


_OPS = ("swiglu_fw", "swiglu_amax_fw", "swiglu_backward", "swiglu_backward_amax")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("disabled", ["", "1"])
def test_the_swiglu_ops_run_cpp_kernels_on_cuda(dtype, disabled, monkeypatch):
    """The SwiGLU ops compiled graphs call (two per ``LayerNormMLP`` and step) have C++ CUDA
    kernels (csrc/ops.cpp: no Python kernel per call) with their Python kernels' results: dtq's
    kernel's bits and amaxes, fresh outputs, and where the kernel does not apply (float64,
    ``DTQ_DISABLE_KERNELS``) the Python kernel itself, so the reference's bits; the profiler sees
    which ran."""
    from dtq.nn import functional as fn

    assert all(torch._C._dispatch_has_kernel_for_dispatch_key(f"dtq::{op}", "CUDA") for op in _OPS)
    monkeypatch.setenv("DTQ_DISABLE_KERNELS", disabled)
    torch.manual_seed(11)
    x = (torch.randn(2, 40, 2 * 96, device="cuda") * 3).to(dtype)[:, :33]  # strided: the op copies
    dh = torch.randn(2, 33, 96, device="cuda").to(dtype)
    ops = torch.ops.dtq
    python = {
        "swiglu_fw": lambda: fn._swiglu_impl(x, 32),
        "swiglu_amax_fw": lambda: fn._swiglu_amax_impl(x, 32),
        "swiglu_backward": lambda: fn._swiglu_backward_impl(dh, x, 32),
        "swiglu_backward_amax": lambda: fn._swiglu_backward_amax_impl(dh, x, 32),
    }
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = {
            "swiglu_fw": ops.swiglu_fw(x, 32),
            "swiglu_amax_fw": ops.swiglu_amax_fw(x, 32),
            "swiglu_backward": ops.swiglu_backward(dh, x, 32),
            "swiglu_backward_amax": ops.swiglu_backward_amax(dh, x, 32),
        }
        torch.cuda.synchronize()
    kernel_ran = any("swiglu_" in e.name and "kernel" in e.name for e in prof.events())
    assert kernel_ran == (not disabled and dtype != torch.float64), prof.key_averages().table()
    h_ref, dx_ref = swiglu_reference(x, 32), swiglu_backward_reference(dh, x, 32)
    for name, out in got.items():
        want = python[name]()
        outs, wants = (out, want) if isinstance(out, list) else ([out], [want])
        assert len(outs) == len(wants) == (2 if name.endswith("amax_fw") or name.endswith("_amax") else 1)
        for o, w in zip(outs, wants):
            assert o.shape == w.shape and o.dtype == w.dtype and o.is_contiguous()
            _assert_bits(o, w)
            assert not any(o.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in (x, dh))
        _assert_bits(outs[0], h_ref if "backward" not in name else dx_ref)


def test_double_backward_and_float64():
    """create_graph takes the reference's differentiable ops; float64 is computed in float64."""
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (x,))
    assert torch.autograd.gradgradcheck(swiglu, (x,))
    a, b = x.detach().chunk(2, dim=-1)
    torch.testing.assert_close(swiglu(x), torch.nn.functional.silu(a) * b, rtol=1e-14, atol=1e-15)


@needs_kernels
def test_kernel_path_empty_and_double_backward_on_cuda():
    assert swiglu(torch.empty(0, 16, device="cuda", dtype=torch.bfloat16)).shape == (0, 8)
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    (g,) = torch.autograd.grad(swiglu(x).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    xr = x.detach().clone().requires_grad_(True)
    a, b = xr.chunk(2, dim=-1)
    (gr,) = torch.autograd.grad((torch.nn.functional.silu(a) * b).sum(), xr, create_graph=True)
    (ggr,) = torch.autograd.grad(gr.sum(), xr)
    torch.testing.assert_close(gg, ggr, rtol=1e-4, atol=1e-5)  # fp32, different op orders


@needs_kernels
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which", ["a", "b", "ab"])
@pytest.mark.parametrize("n, offset", [(4096 * 3, 0), (1001, 0), (4096, 1)])
def test_scale_cast_bits_match_torch(out_dtype, which, n, offset):
    torch.manual_seed(5)
    src = torch.randn(n + offset, device="cuda") * 1e3
    src[offset : offset + 4] = torch.tensor([float("inf"), float("nan"), 3e38, -0.0])
    src = src[offset:]
    fa = torch.tensor(0.37, device="cuda") if "a" in which else None
    fb = torch.tensor(1.7e-3, device="cuda") if "b" in which else None
    ref = src.clone()
    for f in (fa, fb):
        if f is not None:
            ref = ref * f
    ref = ref.to(out_dtype)
    got = kernels.scale_cast(src.clone(), fa, fb, out_dtype)
    assert got is not None and got.dtype == out_dtype
    _assert_bits(got, ref)


@needs_kernels
def test_scale_cast_declines_what_it_cannot_do():
    src = torch.randn(64, device="cuda")
    assert kernels.scale_cast(src, torch.tensor(2.0), None, torch.bfloat16) is None  # CPU factor
    assert kernels.scale_cast(src, torch.tensor(2.0, device="cuda", dtype=torch.float64), None, torch.bfloat16) is None
    assert kernels.scale_cast(src.half(), torch.tensor(2.0, device="cuda"), None, torch.bfloat16) is None
    assert kernels.scale_cast(src.view(8, 8).t(), torch.tensor(2.0, device="cuda"), None, torch.bfloat16) is None


@needs_kernels
@pytest.mark.parametrize(
    "recipe",
    [dtq.Float8CurrentScaling(), dtq.NVFP4BlockScaling(), dtq.MXFP8BlockScaling()],
    ids=["fp8", "nvfp4", "mxfp8"],
)
def test_layernorm_mlp_link_is_bitwise_the_unlinked_composition(recipe):
    """LayerNormMLP hands the SwiGLU kernels' amaxes to its GEMMs; the result must be bitwise what
    the same GEMMs compute with their own amax passes."""
    torch.manual_seed(6)
    mlp = dtq.nn.LayerNormMLP(
        256,
        512,
        bias=False,
        normalization="RMSNorm",
        activation="swiglu",
        swiglu_interleave=64,
        params_dtype=torch.bfloat16,
        device="cuda",
        name="mlp",
    )
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)

    def run(linked: bool):
        torch.manual_seed(8)  # NVFP4's stochastic rounding draws its seeds from the generator
        xi = x.clone().requires_grad_(True)
        for p in mlp.parameters():
            p.grad = None
        with dtq.autocast(recipe):
            if linked:
                y = mlp(xi)
            else:
                h = mlp._linear(mlp.norm(xi), mlp.fc1_weight, None, gemm=0)
                y = mlp._linear(swiglu(h, 64), mlp.fc2_weight, None, gemm=1)
        y.backward(dy)
        return {"y": y.detach(), "dx": xi.grad, **{n: p.grad.clone() for n, p in mlp.named_parameters()}}

    got, ref = run(True), run(False)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0, equal_nan=True, msg=name)


def _mlp(device: str) -> dtq.nn.LayerNormMLP:
    torch.manual_seed(3)
    kw = {"params_dtype": torch.bfloat16, "device": device, "name": "mlp", "bias": False}
    return dtq.nn.LayerNormMLP(256, 512, normalization="RMSNorm", activation="swiglu", **kw)


def _mlp_step(model, recipe, device: str) -> list[torch.Tensor]:
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    x.requires_grad_(True)
    with dtq.autocast(recipe):
        y = model(x)
    y.float().square().sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in model.parameters())]


def _compiled_mlp_equals_eager(recipe, device: str, backend) -> None:
    """Two steps of a SwiGLU ``LayerNormMLP`` compiled with ``backend`` (fullgraph) give the eager
    model's bits (twice: delayed scaling's histories advance alike)."""
    eager, compiled = _mlp(device), _mlp(device)
    compiled_fn = torch.compile(compiled, backend=backend, fullgraph=True)
    for _ in range(2):
        for a, b in zip(_mlp_step(compiled_fn, recipe, device), _mlp_step(eager, recipe, device)):
            assert torch.equal(a, b)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_kernels)])
@pytest.mark.parametrize("recipe", ["fp8", "fp8_delayed"])
def test_compiled_layernorm_mlp_takes_max_h_from_the_swiglu_op(recipe, device):
    """Compiled under current scaling, the down projection's max|h| is an output of the SwiGLU op
    (``dtq::swiglu_amax``: on CUDA the kernel's, which eager's AmaxLink hands over too), not a
    reduction of h of its own (inductor cannot fuse one into the opaque op: on an H200 it read
    the [8192, 8192] h again, 0.5 ms a 1.07 B step). Delayed scaling reads no amax of h: the plain
    op. The compiled model keeps eager's bits (aot_eager: the norm runs eager's kernel too)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    from tests._recipe_matrix import RECIPES

    backend = AotEagerAndRecordGraphs()
    _compiled_mlp_equals_eager(RECIPES[recipe](), device, backend)
    forward = "\n".join(g.code for g in backend.fw_graphs)
    assert ("dtq.swiglu_amax" in forward) == (recipe == "fp8"), forward
    if recipe == "fp8":  # the graph reduces fc1's input only (a row stage, then the rows): h is not reduced
        assert forward.count("torch.ops.aten.amax.default(") == 2, forward
    assert ("dtq.swiglu_fw" in forward) == (recipe != "fp8"), forward


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_kernels)])
def test_compiled_layernorm_mlp_quantizes_the_swiglu_tensors_with_dtq_kernels(device):
    """Compiled under FP8 current scaling, h (fc2's input) and dx (fc1's output gradient) come out
    of the opaque SwiGLU ops, which inductor cannot fuse their quantization into: both keep dtq's
    quantize ops (``fuse`` False; dtq's one-pass kernel writes both layouts of the codes, where the
    decomposition casts and then transposes), and fc1's backward takes max|dx| from the SwiGLU
    backward kernel (``dtq::swiglu_backward_amax``, handed over by ``dtq.nn._handoff``) instead
    of reducing dx again (0.06 ms a layer at 8192 x 16384 on an H200). Bits: eager's."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    r = dtq.Float8CurrentScaling()
    backend = AotEagerAndRecordGraphs()
    _compiled_mlp_equals_eager(r, device, backend)
    (fw,), (bw,) = backend.fw_graphs, backend.bw_graphs

    def calls(graph, op):
        return [n for n in graph.graph.nodes if n.target is op]

    def fuses(node):  # (the op's flags argument: CallFlags.code)
        return _ops.call_flags(node.args[3]).fuse

    (h_quant,) = [n for n in calls(fw, torch.ops.dtq.quantize_input.default) if not fuses(n)]
    assert h_quant.args[0].args[0].args[0].target is torch.ops.dtq.swiglu_amax_fw.default  # detach(h)
    (handed,) = calls(bw, torch.ops.dtq.swiglu_backward_amax.default)
    grad_quants = calls(bw, torch.ops.dtq.quantize_grad.default)
    assert [fuses(n) for n in grad_quants].count(False) == 1, bw.code
    (dx_quant,) = [n for n in grad_quants if not fuses(n)]
    amax = dx_quant.args[1]
    assert amax.target is operator.getitem and amax.args == (handed, 1), bw.code
    # the one reduction left in backward is fc2's dy (the loss's gradient)
    assert sum(n.target is torch.ops.aten.amax.default for n in bw.graph.nodes) == 2, bw.code
    if device == "cuda":  # inductor keeps both ops (the decomposition declines them)
        from torch._inductor.utils import run_and_get_code

        torch._dynamo.reset()
        _, code = run_and_get_code(_mlp_step, torch.compile(_mlp(device), fullgraph=True), r, device)
        text = "".join(code)
        assert text.count("torch.ops.dtq.quantize_input.default(") == 1, text
        assert text.count("torch.ops.dtq.quantize_grad.default(") == 1, text
        assert "torch.ops.dtq.swiglu_backward_amax.default(" in text


@needs_kernels
@pytest.mark.parametrize("summed", [False, True])
def test_eager_up_projection_takes_the_swiglu_kernels_max_dx_for_its_own_gradient_only(summed):
    """Eager, with an AmaxLink between fc1 and the SwiGLU kernel (``LayerNormMLP``'s wiring):
    fc1's backward quantizes dy with the kernel's max|dx| and no amax pass of its own, and
    where fc1's output feeds another op too (``summed``: autograd adds a second gradient into
    the kernel's dx) it reduces the summed dy itself. Bits: those of a run without the link."""
    from dtq.nn.functional import AmaxLink

    r = dtq.Float8CurrentScaling()
    runs, passes = {}, {}
    for linked in (False, True):
        torch.manual_seed(3)
        fc1 = dtq.nn.Linear(64, 256, bias=False, params_dtype=torch.bfloat16, name="fc1").cuda()
        x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
        link = AmaxLink() if linked else None
        with dtq.autocast(r):
            h = fc1._linear(x, fc1.weight, None, link=link)
            out = swiglu(h, link=link).float().square().sum()
            if summed:
                out = out + 100 * h.float().sum()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out.backward()
            torch.cuda.synchronize()
        passes[linked] = sum("amax" in e.name and "kernel" in e.name for e in prof.events())
        runs[linked] = [x.grad, fc1.weight.grad]
    for a, b in zip(runs[True], runs[False]):
        assert torch.equal(a, b)
    # the link saves fc1's dy pass, except where dy is a sum
    assert passes[True] == passes[False] - (0 if summed else 1), passes


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_gradient_summed_into_the_swiglu_gradient_is_not_handed_its_amax(backend):
    """fc1's output also feeds another op, so autograd sums two gradients for it (the eager backend
    adds the second into the SwiGLU's gradient in place: the same tensor, a new version). The
    amax the SwiGLU kernel offered is then not dy's: fc1's backward reduces dy itself, and the
    compiled gradients are eager's (an earlier handoff matched on the tensor alone and was off by
    hundreds)."""
    from dtq.nn.functional import AmaxLink

    r = dtq.Float8CurrentScaling()

    def make():
        torch.manual_seed(3)
        return dtq.nn.Linear(64, 128, bias=False, params_dtype=torch.bfloat16, name="fc1")

    def loss(model, x):
        h = model(x)
        aux = 100 * h.float().sum()  # (first: its gradient reaches h second)
        return aux + swiglu(h, link=AmaxLink()).float().sum()

    def step(model, fn):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).requires_grad_()
        with dtq.autocast(r):
            fn(model, x).backward()
        return [x.grad, model.weight.grad]

    eager, compiled = make(), make()
    want = step(eager, loss)
    got = step(compiled, torch.compile(loss, backend=backend, fullgraph=True))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
