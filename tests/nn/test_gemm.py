"""GEMM dispatch: every pairing of formats runs for all three GEMMs; native paths, where the device
has them, are taken and agree with emulation."""

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dtq
from dtq.gemm import Operand, mm, record_paths
from tests._quantizers import ALL, IDS

M, K, N = 64, 128, 96
torch.manual_seed(0)
X, W, DY = torch.randn(M, K), torch.randn(N, K), torch.randn(M, N)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _gemms(qa, qb):
    """(name, A operand, B operand, exact fp64 product of the dequantized operands) per GEMM."""
    xq, wq = qa.quantize(X, seed=1), qb.quantize(W, seed=2)
    gq = qa.quantize(DY, seed=3)
    d = lambda t, dirn: t.dequantize(torch.float64, direction=dirn)  # noqa: E731
    return [
        (
            "fprop",
            Operand(xq, "rowwise"),
            Operand(wq, "rowwise", transpose=True),
            d(xq, "rowwise") @ d(wq, "rowwise").T,
        ),
        ("dgrad", Operand(gq, "rowwise"), Operand(wq, "columnwise"), d(gq, "rowwise") @ d(wq, "columnwise")),
        (
            "wgrad",
            Operand(gq, "columnwise", transpose=True),
            Operand(xq, "columnwise"),
            d(gq, "columnwise").T @ d(xq, "columnwise"),
        ),
    ]


@pytest.mark.parametrize("qa", ALL, ids=IDS)
@pytest.mark.parametrize("qb", ALL, ids=IDS)
def test_every_pairing_runs_on_cpu(qa, qb):
    for name, a, b, ref in _gemms(qa, qb):
        with record_paths() as paths:
            out = mm(a, b, torch.float32)
        assert paths == ["emulated"]
        # fp32 accumulation over at most 128 products of exactly representable values:
        # relative error far below 1e-5 (float32 epsilon is 1.2e-7).
        assert _rel(out, ref) < 1e-5, (name, _rel(out, ref))


def test_plain_high_precision_operand_and_shape_error():
    q = dtq.MXFP8Quantizer()
    out = mm(Operand(q.quantize(X), "rowwise"), Operand(W, transpose=True))
    assert _rel(out, q.quantize(X).dequantize(torch.float64) @ W.double().T) < 1e-5
    with pytest.raises(ValueError, match=r"op\(A\) is \[64, 128\].*op\(B\) is \[96, 128\]"):
        mm(Operand(q.quantize(X)), Operand(W))


def _linear_gemms(xq, wq, gq) -> list[tuple[Operand, Operand]]:
    """(A, B) of fprop, dgrad and wgrad as dtq's Linear runs them."""
    return [
        (Operand(xq), Operand(wq, transpose=True)),
        (Operand(gq), Operand(wq, "columnwise")),
        (Operand(gq, "columnwise", transpose=True), Operand(xq, "columnwise")),
    ]


cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="needs an FP8-capable GPU (sm_89+)",
)


@cuda
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_tensorwise_native_path_agrees_with_emulation(out_dtype, grad_dtype):
    fwd, bwd = dtq.Float8Quantizer(), dtq.Float8Quantizer(grad_dtype)
    x, w, dy = X.cuda() * 3, W.cuda(), DY.cuda() * 1e-3
    xq, wq, gq = fwd.quantize(x), fwd.quantize(w), bwd.quantize(dy)
    for a, b in _linear_gemms(xq, wq, gq):
        with record_paths() as paths:
            native = mm(a, b, out_dtype)
        assert paths == ["fp8_tensorwise_scaled_mm"]
        emulated = dtq.gemm._emulated(a, b, torch.float32)
        # Same exact products, but Hopper's FP8 tensor cores accumulate a 128-deep chunk with about
        # 14 mantissa bits before promoting to fp32 (2**-13 ~ 1.2e-4 relative; measured 1.3e-4 on an
        # H200); a bf16 output adds its own rounding (2**-9).
        tol = 5e-4 if out_dtype == torch.float32 else 4e-3
        assert _rel(native, emulated) < tol


hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
    reason="needs a Hopper GPU (sm_90) for cuBLAS blockwise FP8",
)


@hopper
@pytest.mark.parametrize("shape", [(256, 512, 384), (128, 384, 256), (384, 256, 640)], ids=str)
@pytest.mark.parametrize("w_block", [(128, 128), (1, 128)])
def test_fp8_blockwise_native_path_agrees_with_emulation(shape, w_block):
    m, k, n = shape
    a_q, w_qz = dtq.Float8BlockQuantizer((1, 128)), dtq.Float8BlockQuantizer(w_block)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g) * torch.logspace(-2, 2, k, device="cuda")
    w, dy = torch.randn(n, k, device="cuda", generator=g), torch.randn(m, n, device="cuda", generator=g)
    xq, wq, gq = a_q.quantize(x), w_qz.quantize(w), a_q.quantize(dy)
    for a, b in _linear_gemms(xq, wq, gq):
        with record_paths() as paths:
            native = mm(a, b, torch.float32)
        assert paths == ["fp8_blockwise_scaled_mm"], paths
        # Per-block scales are applied exactly (powers of two); the difference is the FP8 tensor
        # cores' ~14-bit accumulation within each 128-deep block (see the tensorwise test).
        assert _rel(native, dtq.gemm._emulated(a, b, torch.float32)) < 5e-4


@hopper
@pytest.mark.parametrize("shape", [(256, 512, 384), (128, 384, 256)], ids=str)
@pytest.mark.parametrize("weight", ["rowwise_scaled", "per_tensor"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grad_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3_grad", "e5m2_grad"])
def test_fp8_rowwise_native_path_agrees_with_emulation(shape, weight, out_dtype, grad_dtype):
    m, k, n = shape
    a_q, g_q = dtq.Float8RowwiseQuantizer(), dtq.Float8RowwiseQuantizer(grad_dtype)
    w_q = dtq.Float8RowwiseQuantizer() if weight == "rowwise_scaled" else dtq.Float8Quantizer()
    g = torch.Generator(device="cuda").manual_seed(0)
    # rows and columns over 4 decades: a per-tensor scale would flush the small ones to subnormals
    x = torch.randn(m, k, device="cuda", generator=g) * torch.logspace(-2, 2, m, device="cuda")[:, None]
    x = x * torch.logspace(-2, 2, k, device="cuda")
    w, dy = torch.randn(n, k, device="cuda", generator=g), torch.randn(m, n, device="cuda", generator=g)
    xq, wq, gq = a_q.quantize(x), w_q.quantize(w), g_q.quantize(dy)
    for a, b in _linear_gemms(xq, wq, gq):
        with record_paths() as paths:
            native = mm(a, b, out_dtype)
        if out_dtype not in dtq.gemm._rowwise_out_dtypes():
            assert paths == ["emulated"], paths
            continue
        assert paths == ["fp8_rowwise_scaled_mm"], paths
        assert native.dtype == out_dtype
        # The scales are applied to the exact FP8 products (one per output row and column); the
        # difference is the tensor cores' ~14-bit accumulation (see the tensorwise test), plus
        # the bf16 output's rounding (2**-9).
        tol = 5e-4 if out_dtype == torch.float32 else 4e-3
        assert _rel(native, dtq.gemm._emulated(a, b, torch.float32)) < tol
    # scales along the contraction dim cannot be applied after the product: emulated
    wrong = (
        Operand(xq, "columnwise"),
        Operand(wq if weight == "rowwise_scaled" else a_q.quantize(w), "rowwise", transpose=True),
    )
    assert not dtq.gemm._fp8_rowwise_ok(*wrong, torch.bfloat16)
    # two E5M2 operands are emulated (torch's row-wise GEMM takes at most one)
    g5, w5 = (dtq.Float8RowwiseQuantizer(torch.float8_e5m2).quantize(t) for t in (dy, w))
    assert not dtq.gemm._fp8_rowwise_ok(Operand(g5), Operand(w5, "columnwise"), torch.bfloat16)


@cuda
def test_modules_take_native_path_on_gpu():
    lin = dtq.nn.Linear(K, N).cuda()
    with record_paths() as paths, dtq.autocast(dtq.Float8CurrentScaling()):
        lin(torch.randn(M, K, device="cuda", requires_grad=True)).sum().backward()
    # fprop with fast accumulation (the FP8 recipes' default), then dgrad and wgrad without
    assert paths == ["fp8_tensorwise_scaled_mm fast_accum"] + ["fp8_tensorwise_scaled_mm"] * 2
    with record_paths() as paths, dtq.autocast(dtq.Float8CurrentScaling(fprop_fast_accumulation=False)):
        lin(torch.randn(M, K, device="cuda", requires_grad=True)).sum().backward()
    assert paths == ["fp8_tensorwise_scaled_mm"] * 3
    if torch.cuda.get_device_capability()[0] == 9:
        lin = dtq.nn.Linear(256, 384).cuda()
        with record_paths() as paths, dtq.autocast(dtq.Float8BlockScaling()):
            lin(torch.randn(128, 256, device="cuda", requires_grad=True)).sum().backward()
        assert paths == ["fp8_blockwise_scaled_mm"] * 3
        lin = dtq.nn.Linear(256, 384, params_dtype=torch.bfloat16).cuda()
        for fmt in ("E4M3", "HYBRID"):  # HYBRID: E5M2 gradients against E4M3 operands
            with record_paths() as paths, dtq.autocast(dtq.Float8RowwiseScaling(fp8_format=fmt)):
                lin(torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)).sum().backward()
            assert paths == ["fp8_rowwise_scaled_mm fast_accum"] + ["fp8_rowwise_scaled_mm"] * 2, fmt


@cuda
@pytest.mark.parametrize("grad", [False, True])
def test_fprop_fast_accumulation_is_scaled_mm_with_fast_accum(grad):
    """An FP8 recipe's forward GEMM is ``torch._scaled_mm`` with ``use_fast_accum=True`` by default
    (TransformerEngine's and torchao's choice), bit for bit, planned (grad) or not; with
    ``fprop_fast_accumulation=False`` the accurate one. K = 4096 so that Hopper's fast accumulation
    (partial sums in reduced precision) gives different bits from the accurate one: the test tells
    the two modes apart instead of passing with either."""
    k = 4096
    lin = dtq.nn.Linear(k, N, bias=False, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    q = dtq.Float8Quantizer()
    px, pw = q.quantize(x.detach()).payload("rowwise"), q.quantize(lin.weight.detach()).payload("rowwise")
    outs = {}
    for fast in (True, False):
        with torch.set_grad_enabled(grad), dtq.autocast(dtq.Float8CurrentScaling(fprop_fast_accumulation=fast)):
            y = lin(x)
        want = torch._scaled_mm(
            px["data"],
            pw["data"].t(),
            scale_a=px["scale_inv"],
            scale_b=pw["scale_inv"],
            out_dtype=torch.bfloat16,
            use_fast_accum=fast,
        )
        assert torch.equal(y.detach(), want), fast
        outs[fast] = y.detach()
    assert not torch.equal(outs[True], outs[False])


@pytest.mark.parametrize("q", ALL, ids=IDS)
def test_exact_dtype_claims_hold(q):
    """A format that says its GEMM values fit bf16 exactly must mean it: the bf16 tensor-core path
    rests on it. Inputs span 2^-40..2^40 so scales of every size occur."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-40, 40, (M, 1), generator=g).float())
    t = q.quantize(x, seed=5)
    for d in t.directions:
        codec = q.codec(d)
        for rotated in (False, True):
            if codec.exact_dtype(t.payload(d), rotated) != torch.bfloat16:
                continue
            vals, _ = codec.dequantize(t.payload(d), t.shape2d, factored=True, rotated=rotated)
            assert torch.equal(vals.to(torch.bfloat16).float(), vals), (d, rotated)


def test_shared_rotation_is_skipped_only_where_the_product_allows():
    q = dtq.NVFP4Quantizer(random_hadamard=True)
    gq, xq = q.quantize(DY, seed=1), q.quantize(X, seed=2)
    wgrad = (Operand(gq, "columnwise", transpose=True), Operand(xq, "columnwise"))
    assert dtq.gemm._shared_rotation(*wgrad)
    ref = gq.dequantize(torch.float64, direction="columnwise").T @ xq.dequantize(torch.float64, direction="columnwise")
    assert _rel(mm(*wgrad), ref) < 1e-5  # (T a)^T (T b) = a^T b
    other = dtq.NVFP4Quantizer(random_hadamard=True, hadamard_seed=7).quantize(X, seed=2)
    assert not dtq.gemm._shared_rotation(wgrad[0], Operand(other, "columnwise"))  # other signs: undo both


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_tensor_core_emulation_on_gpu():
    """MXFP8 / NVFP4 (also rotated wgrad) / power-of-two FP8 block operands run as a BF16 GEMM with
    fp32 accumulation; it computes the fp32 emulation's sum of the same exact products, in
    another order (relative difference at fp32 rounding level)."""
    cases = [
        (dtq.MXFP8Quantizer(), dtq.MXFP8Quantizer()),
        (
            dtq.HybridQuantizer(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer(random_hadamard=True)),
            dtq.NVFP4Quantizer((16, 16)),
        ),
        (dtq.Float8BlockQuantizer((1, 128)), dtq.Float8BlockQuantizer((128, 128))),
    ]
    for qa, qb in cases:
        xq, wq, gq = qa.quantize(X.cuda(), seed=1), qb.quantize(W.cuda(), seed=2), qa.quantize(DY.cuda(), seed=3)
        for a, b in _linear_gemms(xq, wq, gq):
            if dtq.gemm._fp8_blockwise_ok(a, b, torch.float32):
                continue  # Hopper takes the native FP8 path for these
            with record_paths() as paths:
                out = mm(a, b, torch.float32)
            assert paths == ["emulated_bf16"], (qa, qb, paths)
            assert _rel(out, dtq.gemm._emulated(a, b, torch.float32)) < 1e-5
            # A bf16 output (written by the GEMM where no per-tensor factor follows) is that sum
            # rounded once: within bf16's rounding (2^-9 relative per element) of the fp32 result.
            assert _rel(mm(a, b, torch.bfloat16).float(), out) < 2**-8
            rotated = dtq.gemm._shared_rotation(a, b)
            for op in (a, b):  # the bf16 operands (kernel-written) are the CPU reference's values
                cpu = Operand(op.tensor.to("cpu"), op.direction, op.transpose)
                assert torch.equal(
                    op.values(rotated, torch.bfloat16)[0].cpu(),
                    cpu.values(rotated, torch.float32)[0].to(torch.bfloat16),
                )


_PRECISION_KEYS = [("generic", "all"), ("cuda", "all"), ("cuda", "matmul"), ("mkldnn", "all"), ("mkldnn", "matmul")]


def _precisions() -> dict:
    """The fp32 matmul settings a user can read (resolved as torch reads them), and the legacy one."""
    seen = {k: torch._C._get_fp32_precision_getter(*k) for k in _PRECISION_KEYS}
    try:
        seen["legacy"] = torch.get_float32_matmul_precision()
    except RuntimeError as e:  # torch refuses to read it once the new and legacy settings disagree
        seen["legacy"] = str(e)
    return {**seen, "bf16_reduction": torch._C._get_cublas_allow_bf16_reduced_precision_reduction()}


def _torch_defaults() -> None:
    torch.set_float32_matmul_precision("highest")
    for k in _PRECISION_KEYS:
        torch._C._set_fp32_precision_setter(*k, "none")
    torch._C._set_cublas_allow_bf16_reduced_precision_reduction(True, True)


@pytest.fixture
def user_flags():
    """A test sets process-wide matmul flags as a user would; they go back to torch's defaults after."""
    before = _precisions()
    yield
    _torch_defaults()
    assert _precisions() == before


class _MatmulPrecision(TorchDispatchMode):
    """Records the oneDNN fp32 matmul precision every aten.mm runs under (what its CPU kernel reads)."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.seen.append(torch._C._get_fp32_precision_getter("mkldnn", "matmul"))
        return func(*args, **(kwargs or {}))


_USER_SETTINGS = {
    "legacy_medium": lambda: torch.set_float32_matmul_precision("medium"),  # oneDNN BF16, cuBLAS TF32
    "generic_bf16": lambda: setattr(torch.backends, "fp32_precision", "bf16"),
    "mkldnn_matmul_tf32": lambda: setattr(torch.backends.mkldnn.matmul, "fp32_precision", "tf32"),
}


@pytest.mark.parametrize("setting", list(_USER_SETTINGS))
def test_emulated_gemm_multiplies_in_fp32_and_leaves_the_users_flags(user_flags, setting):
    """A user's fp32 matmul precision (BF16 / TF32 in oneDNN: rounded operands on CPUs that have
    them) changes neither dtq's GEMM arithmetic nor, after the GEMM, the user's setting."""
    q = dtq.Float8BlockQuantizer((1, 128))  # values with non-power-of-two scales: not bf16-exact
    a, b = Operand(q.quantize(X, seed=1)), Operand(q.quantize(W, seed=2), transpose=True)
    expected = mm(a, b)
    _USER_SETTINGS[setting]()
    before = _precisions()
    assert before[("mkldnn", "matmul")] in ("bf16", "tf32")
    with _MatmulPrecision() as inside:
        out = mm(a, b)
    assert inside.seen == ["ieee"]
    assert _precisions() == before
    assert torch.equal(out, expected)
    with _MatmulPrecision() as user:  # the user's own matmuls still run as the user asked
        X @ W.T
    assert user.seen == [before[("mkldnn", "matmul")]]


def test_cuda_flag_holds_give_back_exactly_what_the_user_set(user_flags):
    """On CUDA, emulated fp32 GEMMs hold cuBLAS at true fp32 (no TF32) and BF16 GEMMs at fp32
    split-K reductions. The holds (run here without a GPU: the flags are process-wide) give back
    the user's setting exactly, new fp32_precision API and legacy "medium" included, and GEMMs in
    flight together (autograd's threads) keep the flag held until the last one ends."""
    tf32_off, full_reduction = dtq.gemm._IEEE_FP32["cuda"], dtq.gemm._FULL_BF16_REDUCTION
    cuda_mm = functools.partial(torch._C._get_fp32_precision_getter, "cuda", "matmul")
    reduction = torch._C._get_cublas_allow_bf16_reduced_precision_reduction
    set_reduction = torch._C._set_cublas_allow_bf16_reduced_precision_reduction

    with tf32_off:  # torch's default (no TF32): nothing to change
        assert cuda_mm() == "none"
    for user in (
        lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
        lambda: torch.set_float32_matmul_precision("medium"),  # stays "medium", not "high"
        lambda: setattr(torch.backends, "fp32_precision", "tf32"),
    ):  # inherited by cuda.matmul
        _torch_defaults()
        user()
        before = _precisions()
        with tf32_off:
            assert cuda_mm() == "ieee"
        assert _precisions() == before
    torch.backends.fp32_precision = "ieee"
    assert cuda_mm() == "ieee"  # cuda.matmul still inherits the generic setting

    for user in ((True, True), (False, False), (False, True)):
        set_reduction(*user)
        with full_reduction:
            assert reduction() == (False, True)
        assert reduction() == user

    set_reduction(True, True)
    full_reduction.__enter__()  # two GEMMs in flight; the first to start ends first
    full_reduction.__enter__()
    full_reduction.__exit__(None, None, None)
    assert reduction() == (False, True)
    full_reduction.__exit__(None, None, None)
    assert reduction() == (True, True)
    with full_reduction:
        set_reduction(False, False)  # set by the user meanwhile: kept
    assert reduction() == (False, False)
