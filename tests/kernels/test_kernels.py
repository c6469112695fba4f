"""CUDA kernels (csrc/, dtq.kernels) against the references, bit for bit.

Every payload tensor (codes, block scales, per-tensor values) produced by the fused kernel must
equal the CPU reference's bits, and the reference run through torch's CUDA ops. Inputs cover
fp32 / bf16 / fp16, partial edge tiles, tiny tensors, zeros, +-inf, NaN, huge and subnormal
values and exact rounding midpoints. The CPU test at the end runs everywhere (CI is CPU-only).
"""

from __future__ import annotations

import pytest
import torch

import dtq
from dtq import kernels

SEED = 1234

PLAIN = {
    "fp8": dtq.Float8Quantizer(),
    "fp8_e5m2_pow2": dtq.Float8Quantizer(torch.float8_e5m2, pow2_scales=True),
    "fp8b_1x128": dtq.Float8BlockQuantizer((1, 128)),
    "fp8b_128x128": dtq.Float8BlockQuantizer((128, 128)),
    "fp8b_1x128_e5m2_nopow2": dtq.Float8BlockQuantizer((1, 128), torch.float8_e5m2, pow2_scales=False),
    "mxfp8": dtq.MXFP8Quantizer(),
    "mxfp8_floor_e5m2": dtq.MXFP8Quantizer(torch.float8_e5m2, scale_rounding="floor"),
    "nvfp4": dtq.NVFP4Quantizer(),
    "nvfp4_16x16": dtq.NVFP4Quantizer((16, 16)),
    "nvfp4_sr": dtq.NVFP4Quantizer(stochastic_rounding=True),
    "nvfp4_16x16_sr": dtq.NVFP4Quantizer((16, 16), stochastic_rounding=True),
    "nvfp4_rht": dtq.NVFP4Quantizer(random_hadamard=True, hadamard_seed=5),
    "nvfp4_rht_sr": dtq.NVFP4Quantizer(stochastic_rounding=True, random_hadamard=True),
    "fp8_row": dtq.Float8RowwiseQuantizer(),
    "fp8_row_e5m2_pow2": dtq.Float8RowwiseQuantizer(torch.float8_e5m2, pow2_scales=True),
    "identity": dtq.IdentityQuantizer(),
    "identity_bf16": dtq.IdentityQuantizer(torch.bfloat16),
    "identity_fp32": dtq.IdentityQuantizer(torch.float32),
}
H = dtq.HybridQuantizer
HYBRID = {
    "mxfp8/nvfp4_rht_sr": H(
        rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer(stochastic_rounding=True, random_hadamard=True)
    ),
    "fp8b_1x128/fp8b_128x128": H(rowwise=dtq.Float8BlockQuantizer(), columnwise=dtq.Float8BlockQuantizer((128, 128))),
    "mxfp8/nvfp4_16x16": H(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer((16, 16))),
    "fp8/mxfp8": H(rowwise=dtq.Float8Quantizer(), columnwise=dtq.MXFP8Quantizer()),
    "fp8b_1x128/nvfp4_16x16": H(rowwise=dtq.Float8BlockQuantizer(), columnwise=dtq.NVFP4Quantizer((16, 16))),
    "identity/nvfp4_sr": H(rowwise=dtq.IdentityQuantizer(), columnwise=dtq.NVFP4Quantizer(stochastic_rounding=True)),
    "nvfp4/identity_bf16": H(rowwise=dtq.NVFP4Quantizer(), columnwise=dtq.IdentityQuantizer(torch.bfloat16)),
    "fp8b_128x128/identity": H(rowwise=dtq.Float8BlockQuantizer((128, 128)), columnwise=dtq.IdentityQuantizer()),
    "nvfp4_sr/mxfp8_floor": H(
        rowwise=dtq.NVFP4Quantizer(stochastic_rounding=True), columnwise=dtq.MXFP8Quantizer(scale_rounding="floor")
    ),
    "mxfp8/fp8b_1x128": H(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.Float8BlockQuantizer()),
    "fp8_row/mxfp8": H(rowwise=dtq.Float8RowwiseQuantizer(), columnwise=dtq.MXFP8Quantizer()),
    "nvfp4_16x16/fp8_row_e5m2": H(
        rowwise=dtq.NVFP4Quantizer((16, 16)), columnwise=dtq.Float8RowwiseQuantizer(torch.float8_e5m2)
    ),
    # weights and inputs of dtq.recipes' factories (the options' hybrids: tests/test_nvfp4_options.py)
    "mxfp8/nvfp4": H(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer()),
    "mxfp8/identity": H(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.IdentityQuantizer()),
    "identity/mxfp8": H(rowwise=dtq.IdentityQuantizer(), columnwise=dtq.MXFP8Quantizer()),
}
ALL = {**PLAIN, **HYBRID}
DIRSETS = [(True, False), (False, True), (True, True)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Shapes tried per quantizer; those a direction cannot represent are skipped (see _valid).
SHAPES = [(256, 384), (96, 160), (288, 416), (130, 200), (1, 7), (5, 300), (257, 129), (16, 16), (32, 32)]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels need a CUDA GPU (CPU-only here)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _valid(q, shape, dirs) -> bool:
    for d, on in zip(dtq.DIRECTIONS, dirs):
        if on:
            try:
                q.codec(d).check_shape(shape)
            except ValueError:
                return False
    return True


def _inputs(shape, dtype, gen):
    m, k = shape
    base = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, k)[torch.randperm(k, generator=gen)]
    out = {"random": base}
    e = torch.randn(m, k, generator=gen)
    flat = e.view(-1)
    n = flat.numel()
    specials = [float("nan"), float("inf"), -float("inf"), 3.0e38, -1e-40, 1e-45, 0.0, -0.0]
    for i, v in enumerate(specials):
        flat[(i * 7919) % n] = v
    if m >= 32 and k >= 32:
        e[:32, :32] = 0.0  # all-zero blocks in every format
    out["specials"] = e
    # Finite: exact midpoints. Global amax 2688 gives S_enc = 1, a block amax of 6 gives s_b = 1,
    # so NVFP4 sees the E2M1 midpoints themselves; 448 * 2**-k rows hit FP8 RNE ties.
    f = torch.randn(m, k, generator=gen) * 1e-3
    mids = torch.tensor(
        [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 1.0625, 1.1875, 2688.0, -448.0, 1e-39, -3e-41]
    )
    fl = f.view(-1)
    reps = (fl.numel() + mids.numel() - 1) // mids.numel()
    fl.copy_(torch.where(torch.rand(fl.numel(), generator=gen) < 0.5, mids.repeat(reps)[: fl.numel()], fl))
    out["midpoints"] = f
    out["zeros"] = torch.zeros(m, k)
    return {name: t.to(dtype) for name, t in out.items()}


def _compare(a: dtq.QuantizedTensor, b: dtq.QuantizedTensor, what: str):
    assert a.directions == b.directions, what
    for d in a.directions:
        pa, pb = a.payload(d), b.payload(d)
        assert pa.keys() == pb.keys(), (what, d)
        for k in pa:
            assert pa[k].shape == pb[k].shape and pa[k].dtype == pb[k].dtype, (what, d, k)
            x, y = _bits(pa[k]), _bits(pb[k])
            if not torch.equal(x, y):
                bad = (x != y).nonzero()[:5].tolist()
                raise AssertionError(f"{what}: {d}.{k} differs at {bad} ({int((x != y).sum())} of {x.numel()})")


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = kernels.quantize_alloc

    def wrapped(*a, **k):
        calls.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(kernels, "quantize_alloc", wrapped)
    return calls


def _reference_on_cuda(q, x, **kw):
    import os

    old = os.environ.get("DTQ_DISABLE_KERNELS")
    os.environ["DTQ_DISABLE_KERNELS"] = "1"
    try:
        return q.quantize(x, **kw)
    finally:
        if old is None:
            del os.environ["DTQ_DISABLE_KERNELS"]
        else:
            os.environ["DTQ_DISABLE_KERNELS"] = old


@needs_cuda
def test_kernels_build_and_are_available():
    assert kernels.available("cuda"), f"kernels did not build: {kernels.build_error()}"


@needs_cuda
@pytest.mark.parametrize("name", list(ALL))
def test_quantize_bits_match_reference(name, spy):
    q = ALL[name]
    gen = torch.Generator().manual_seed(hash(name) % 2**31)
    cases = 0
    for shape in SHAPES:
        for dtype in DTYPES:
            for iname, x in _inputs(shape, dtype, gen).items():
                if iname != "random" and shape not in ((256, 384), (130, 200), (1, 7)):
                    continue
                xg = x.cuda()
                for dirs in DIRSETS:
                    if not _valid(q, shape, dirs):
                        continue
                    kw = dict(rowwise=dirs[0], columnwise=dirs[1], seed=SEED)
                    what = f"{name} {shape} {dtype} {iname} dirs={dirs}"
                    n0 = len(spy)
                    got = q.quantize(xg, **kw)
                    assert len(spy) == n0 + 1, f"{what}: the kernel path was not taken"
                    _compare(got, q.quantize(x, **kw), what + " vs CPU reference")
                    _compare(got, _reference_on_cuda(q, xg, **kw), what + " vs CUDA reference")
                    cases += 1
    assert cases > 0


# columnwise_source="rowwise_dequantized": the rowwise kernel, its dequantize kernel, then the
# columnwise kernel on those fp32 values (docs/formats.md, "Hybrids: columnwise_source")
DERIVED = {
    "mxfp8->nvfp4": H(
        rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer(), columnwise_source="rowwise_dequantized"
    ),
    "fp8->nvfp4_rht": H(
        rowwise=dtq.Float8Quantizer(),
        columnwise=dtq.NVFP4Quantizer(random_hadamard=True),
        columnwise_source="rowwise_dequantized",
    ),
    "nvfp4->mxfp8": H(
        rowwise=dtq.NVFP4Quantizer(), columnwise=dtq.MXFP8Quantizer(), columnwise_source="rowwise_dequantized"
    ),
    "fp8b_1x128->fp8_row": H(
        rowwise=dtq.Float8BlockQuantizer(),
        columnwise=dtq.Float8RowwiseQuantizer(),
        columnwise_source="rowwise_dequantized",
    ),
}


@needs_cuda
@pytest.mark.parametrize("name", list(DERIVED))
def test_rowwise_dequantized_kernel_bits_match_reference(name, spy):
    q = DERIVED[name]
    gen = torch.Generator().manual_seed(5)
    cases = 0
    for shape in [(256, 384), (96, 160), (130, 208)]:
        for dtype in DTYPES:
            x = _inputs(shape, dtype, gen)["random"]
            for dirs in DIRSETS:
                if not _valid(q, shape, (True, True)):
                    continue
                kw = dict(rowwise=dirs[0], columnwise=dirs[1])
                n0 = len(spy)
                got = q.quantize(x.cuda(), **kw)
                assert len(spy) > n0, f"{name} {shape} {dtype}: no kernel ran"
                _compare(got, q.quantize(x, **kw), f"{name} {shape} {dtype} dirs={dirs} vs CPU reference")
                cases += 1
    assert cases > 0


@needs_cuda
@pytest.mark.parametrize(
    "name", ["fp8", "nvfp4", "nvfp4_rht", "fp8/mxfp8", "mxfp8/nvfp4_rht_sr", "fp8_row", "nvfp4_16x16/fp8_row_e5m2"]
)
def test_given_amax_and_seed_tensor(name):
    q = ALL[name]
    x = torch.randn(128, 256) * 3
    codecs = {d: q.codec(d) for d in dtq.DIRECTIONS}
    shapes = {d: c.amax_shape(tuple(x.shape)) for d, c in codecs.items() if c.needs_amax()}
    amax = {d: torch.full(shape, 50.0) for d, shape in shapes.items()}
    if "fp8_row" in name:  # per-column amaxes: some columns given below, some above their true amax
        amax = {d: torch.rand(shape, generator=torch.Generator().manual_seed(3)) * 20 for d, shape in shapes.items()}
    amax_nan = {d: torch.full(shape, float("nan")) for d, shape in shapes.items()}
    for a in (amax, amax_nan):
        got = q.quantize(x.cuda(), amax={d: v.cuda() for d, v in a.items()}, seed=torch.tensor(77, device="cuda"))
        _compare(got, q.quantize(x, amax=a, seed=77), f"{name} amax={a}")


@needs_cuda
@pytest.mark.parametrize("shape", [(256, 384), (96, 392), (130, 196)], ids=str)  # 16-, 8- and 1-wide kernels
@pytest.mark.parametrize("name", [n for n in ALL if not n.startswith("identity")])
def test_dequantize_matches_reference(name, shape):
    q = ALL[name]
    if not _valid(q, shape, (True, True)):
        pytest.skip(f"{name} cannot hold {shape}")
    x = torch.randn(*shape) * torch.logspace(-2, 2, shape[1])
    x[3, 5], x[7, 9] = float("nan"), float("inf")
    cpu = q.quantize(x, seed=SEED)
    gpu = cpu.cuda()
    for d in cpu.directions:
        codec = q.codec(d)
        if codec.kernel_spec(shape, torch.float32) is None or codec.name == "identity":
            continue
        assert codec.dequantize(gpu.payload(d), shape, kernel_only=True) is not None, (name, d)
        ref = codec.dequantize(cpu.payload(d), shape)
        got = codec.dequantize(gpu.payload(d), shape)
        assert _same_bits(got.cpu(), ref), f"{name} {d}"
        rv, rf = codec.dequantize(cpu.payload(d), shape, factored=True)
        gv, gf = codec.dequantize(gpu.payload(d), shape, factored=True)
        assert _same_bits(gv.cpu(), rv), f"{name} {d} factored"
        # bf16 output: the RNE rounding of the fp32 values
        g16 = codec.dequantize(gpu.payload(d), shape, torch.bfloat16, kernel_only=True)
        assert _same_bits(g16.cpu(), ref.to(torch.bfloat16)), f"{name} {d} bf16"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (the sign of zero included), NaN where the other is NaN (payloads aside)."""
    nan = torch.isnan(a).cpu()
    if not torch.equal(nan, torch.isnan(b).cpu()):
        return False
    return torch.equal(_bits(a)[~nan], _bits(b)[~nan])


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (130, 200), (257, 1040), (640, 384)])
def test_axis_amax_matches_torch(shape, dtype):
    """The FP8 row-wise pre-pass: max|x| of every row and column, NaN winning, one read."""
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(5)) * 100).to(dtype)
    x[0, -1] = float("nan")
    x = x.cuda()
    rows, cols = kernels.axis_amax(x, True, True)
    torch.testing.assert_close(rows, x.abs().amax(dim=1).float(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(cols, x.abs().amax(dim=0).float(), rtol=0, atol=0, equal_nan=True)
    assert kernels.axis_amax(x, False, True)[0] is None and kernels.axis_amax(x, True, False)[1] is None


@needs_cuda
@pytest.mark.parametrize("name", ["mxfp8/nvfp4_rht_sr", "fp8_row/mxfp8", "fp8_row"])
def test_large_tensor_many_tiles(name):
    """More tiles than the generic kernel's persistent CTAs (the hybrids), and many tiles of the
    specialised one."""
    q = ALL[name]
    x = (torch.randn(2048, 1536) * torch.logspace(-2, 2, 1536)).bfloat16()
    _compare(q.quantize(x.cuda(), seed=3), q.quantize(x, seed=3), f"large {name}")


@needs_cuda
@pytest.mark.parametrize("shape", [(130, 203), (7, 1), (1, 9)], ids=str)
def test_fp8_row_dequantize_odd_shapes(shape):
    """FP8 row-wise dequantize through the FP8 block kernel with (1, K) / (M, 1) blocks, on shapes
    that take its element-wise path (K % 8 != 0), to fp32 and bf16 (exact with pow2 scales)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(9)) * 30
    for q in (PLAIN["fp8_row"], PLAIN["fp8_row_e5m2_pow2"]):
        cpu = q.quantize(x)
        gpu = cpu.cuda()
        for d in cpu.directions:
            codec = q.codec(d)
            assert codec.dequantize(gpu.payload(d), shape, kernel_only=True) is not None
            ref = codec.dequantize(cpu.payload(d), shape)
            assert torch.equal(codec.dequantize(gpu.payload(d), shape).cpu(), ref), (q, d)
            got16, _ = codec.dequantize(gpu.payload(d), shape, torch.bfloat16, factored=True)
            assert torch.equal(got16.cpu(), ref.to(torch.bfloat16)), (q, d)


def test_cpu_loader_reports_unavailable_and_quantize_works(monkeypatch):
    def no_build(*a, **k):
        raise AssertionError("nothing may compile for CPU tensors")

    monkeypatch.setattr(kernels, "_load", no_build)
    assert not kernels.available("cpu")
    monkeypatch.setenv("DTQ_DISABLE_KERNELS", "1")
    assert kernels.disabled() and not kernels.available()
    monkeypatch.delenv("DTQ_DISABLE_KERNELS")
    if not torch.cuda.is_available():
        assert not kernels.available()
    x = torch.randn(64, 128)
    for name, q in ALL.items():
        t = q.quantize(x, seed=SEED)
        assert t.dequantize().shape == x.shape, name
    codes = torch.randint(0, 256, (32, 48), dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert torch.equal(kernels.transposed(codes).view(torch.uint8), codes.view(torch.uint8).t().contiguous())


def test_a_prebuilt_library_is_imported_without_a_build(monkeypatch, tmp_path):
    """DTQ_KERNEL_LIBRARY names the library to import: nothing compiles (torch's loader is never
    reached), a missing file is an error naming the variable, and unset the build runs as before."""
    import torch.utils.cpp_extension as cpp

    def no_build(*a, **k):
        raise AssertionError("a prebuilt library must not be built")

    monkeypatch.setattr(cpp, "load", no_build)
    lib = tmp_path / "dtq_kernels.py"  # any importable file stands in for the .so
    lib.write_text("MARK = 'prebuilt'\n")
    monkeypatch.setenv("DTQ_KERNEL_LIBRARY", str(lib))
    assert not kernels._needs_build()
    assert kernels._load().MARK == "prebuilt"
    monkeypatch.setenv("DTQ_KERNEL_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(RuntimeError, match=r"DTQ_KERNEL_LIBRARY=.*missing\.so: no such file"):
        kernels._load()
    monkeypatch.delenv("DTQ_KERNEL_LIBRARY")
    if torch.version.cuda is not None:  # a CUDA torch: unset, the loader builds (here: refused)
        with pytest.raises(AssertionError, match="must not be built"):
            kernels._load()


def test_kernel_specs_describe_reference_payloads():
    """Each codec's kernel spec names the reference payload's fields, shapes and dtypes, in order."""
    x = torch.randn(64, 128)
    for name, q in PLAIN.items():
        t = q.quantize(x, seed=SEED)
        for d in t.directions:
            spec = q.codec(d).kernel_spec((64, 128), x.dtype)
            assert spec is not None, name
            assert [(n, tuple(s), dt) for n, s, dt in spec.fields] == [
                (k, tuple(v.shape), v.dtype) for k, v in t.payload(d).items()
            ], (name, d)


@needs_cuda
@pytest.mark.parametrize(
    "name",
    [
        "fp8",
        "fp8b_1x128/fp8b_128x128",
        "mxfp8/nvfp4_rht_sr",
        "nvfp4/identity_bf16",
        "identity_fp32",
        "mxfp8/nvfp4_16x16",
        "fp8_row_e5m2_pow2",
    ],
)
def test_generic_kernel_bits_match_reference(name, monkeypatch):
    """The generic fused kernel (the fall-back for slot pairs without a specialised kernel, and for
    unaligned inputs) on aligned shapes, which otherwise take the specialised kernels."""
    monkeypatch.setenv("DTQ_GENERIC_QUANTIZE", "1")
    q = ALL[name]
    gen = torch.Generator().manual_seed(7)
    for shape in ((256, 384), (288, 416)):
        for dtype in DTYPES:
            for iname, x in _inputs(shape, dtype, gen).items():
                for dirs in DIRSETS:
                    if not _valid(q, shape, dirs):
                        continue
                    kw = dict(rowwise=dirs[0], columnwise=dirs[1], seed=SEED)
                    _compare(
                        q.quantize(x.cuda(), **kw),
                        q.quantize(x, **kw),
                        f"generic {name} {shape} {dtype} {iname} {dirs}",
                    )


@needs_cuda
@pytest.mark.parametrize(
    "name", ["fp8b_1x128", "mxfp8", "nvfp4_rht_sr", "fp8b_1x128/fp8b_128x128", "mxfp8/nvfp4_16x16", "fp8_row"]
)
def test_specialised_kernels_partial_tiles(name):
    """Specialised kernels on shapes with partial 128 x 128 tiles in both dimensions and several tiles."""
    q = ALL[name]
    gen = torch.Generator().manual_seed(11)
    for shape in ((416, 272), (160, 1040)):
        x = (torch.randn(*shape, generator=gen) * 5).bfloat16()
        x[7, 3] = float("nan")
        for dirs in DIRSETS:
            if _valid(q, shape, dirs):
                kw = dict(rowwise=dirs[0], columnwise=dirs[1], seed=SEED)
                _compare(q.quantize(x.cuda(), **kw), q.quantize(x, **kw), f"{name} {shape} {dirs}")


@needs_cuda
@pytest.mark.parametrize("shape", [(16, 16), (128, 128), (144, 272), (4096, 48), (48, 4112), (1040, 2064)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
def test_byte_transpose_matches_torch(shape, dtype):
    """The FP8 code transpose (GEMM layouts) is a byte-exact copy, partial edge tiles included."""
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=g).view(dtype)
    out = kernels.transposed(x)
    assert out.dtype == dtype and out.is_contiguous() and out.shape == (shape[1], shape[0])
    assert torch.equal(out.view(torch.uint8), x.view(torch.uint8).t().contiguous())


@needs_cuda
def test_byte_transpose_falls_back_where_the_kernel_does_not_apply():
    base = torch.arange(0, 40 * 33, dtype=torch.int32, device="cuda").to(torch.uint8)
    for x in (base.view(40, 33), base[1 : 1 + 32 * 32].view(32, 32), base[: 32 * 40].view(32, 40).float()):
        assert torch.equal(kernels.transposed(x), x.t().contiguous())


@needs_cuda
def test_the_transposed_codes_op_runs_a_cpp_kernel_on_cuda(monkeypatch):
    """``dtq::transposed_codes`` on CUDA tensors is the C++ kernel of csrc/ops.cpp (a compiled step
    calls it about a hundred times: no Python kernel per call), with :func:`kernels.transposed`'s
    results: the tiled kernel where it applies (and not under ``DTQ_DISABLE_KERNELS``: the
    profiler sees which kernel ran), torch's copy elsewhere, a fresh output for a [1, K] or empty
    input."""
    assert kernels.available("cuda")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dtq::transposed_codes", "CUDA")
    op = torch.ops.dtq.transposed_codes.default
    g = torch.Generator(device="cuda").manual_seed(5)
    codes = torch.randint(0, 256, (1040, 2064), dtype=torch.uint8, device="cuda", generator=g)
    unaligned = codes.view(-1)[1 : 1 + 32 * 32].view(32, 32)
    cases = [codes.view(torch.float8_e4m3fn), codes[:, 16:48], unaligned, codes[:40, :33], codes[:1, :64]]
    cases += [codes[:32, :40].float(), codes[:0, :32], codes[:0, :33]]
    for disabled in ("", "1"):
        monkeypatch.setenv("DTQ_DISABLE_KERNELS", disabled)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            op(cases[0])
            torch.cuda.synchronize()
        ran = any("transpose_u8_kernel" in e.name for e in prof.events())
        assert ran == (not disabled), prof.key_averages().table()
        for x in cases:
            out = op(x)
            assert out.dtype == x.dtype and out.is_contiguous() and out.shape == (x.shape[1], x.shape[0])
            assert torch.equal(
                out.view(torch.uint8) if out.element_size() == 1 else out,
                (x.view(torch.uint8) if x.element_size() == 1 else x).t().contiguous(),
            )
            assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, offset", [(1, 0), (7, 0), (4096, 0), (4096, 1), (2**20 + 12, 0), (65537, 3)])
def test_cast_amax_is_torchs_cast_and_the_amax_of_its_result(n, offset, dtype):
    """The one-rank gather's cast: the bits of ``y.copy_(x)`` and of :func:`kernels.amax` of ``y``
    (NaN winning), from fp32 values that round at midpoints, overflow the 16-bit type, are
    subnormal there, and from unaligned tensors (``offset``: the scalar loop)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n + offset, generator=g) * torch.logspace(-30, 30, n + offset)
    x[::97] = torch.tensor(1.0 + 2.0**-8)  # a bf16 midpoint (rounds to even)
    x[1::89] = torch.tensor(1e-41)  # fp32 subnormal
    x[2::101] = float("inf")
    x = x.cuda()[offset:]
    for nan in (False, True):
        if nan and n > 3:
            x[3] = float("nan")
        y = torch.empty(n, dtype=dtype, device="cuda")
        amax = kernels.cast_amax(x, y)
        assert _same_bits(y, x.to(dtype)), (n, offset, dtype)  # (a NaN's payload aside)
        want = kernels.amax(y.reshape(1, -1), True, None)[0]
        assert amax.shape == () and amax.dtype == torch.float32
        assert torch.equal(_bits(amax.reshape(1)), _bits(want.reshape(1))), (amax, want)
