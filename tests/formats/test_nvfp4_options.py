"""NVFP4 options (docs/formats.md, "NVFP4 options"): ``row_scaled``, ``four_over_six`` with its
error mode, ``e4m3_max``, and the Hadamard sign-mask seed. Hand-checked golden cases, error-bound
and selection properties, shards as slices of the whole, GEMM factors, FSDP2 and sequence-parallel
gathers bitwise equal to one process (2 gloo ranks), and, on a GPU, the kernels against the
reference bit for bit (every option, alone and with stochastic rounding, the random Hadamard,
16x16 blocks and hybrids)."""

from __future__ import annotations

import hashlib
import itertools
import pickle

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import dtq
from dtq import kernels
from dtq.nn.state_dict import format_tag
from dtq.testing import spawn
from tests._quantizers import E2M1, assert_payload_equal, bits, payload_rows, randn, unpack_e2m1
from tests.formats.test_properties import _elementwise_bound

NV = dtq.NVFP4Quantizer
S1 = torch.tensor(2688.0)  # a global amax giving S_enc = 1: block scales are block_amax / 6 (or / 4)

# Options alone and combined with the existing ones (one per kind of kernel slot).
OPTIONS = {
    "row_scaled": NV(row_scaled=True),
    "fos_mae": NV(four_over_six=True),
    "fos_mse_e4m3_256": NV(four_over_six=True, four_over_six_error="mse", e4m3_max=256),
    "e4m3_320": NV(e4m3_max=320),
    "row_scaled_fos_sr": NV(row_scaled=True, four_over_six=True, stochastic_rounding=True),
    "row_scaled_rht_fos": NV(row_scaled=True, random_hadamard=True, hadamard_seed=7, four_over_six=True),
    "rht_fos_mse_sr": NV(random_hadamard=True, stochastic_rounding=True, four_over_six=True, four_over_six_error="mse"),
    "rht_no_sign_mask": NV(random_hadamard=True, hadamard_seed=None),
    "16x16_fos": NV((16, 16), four_over_six=True, e4m3_max=256),
    "16x16_fos_mse_sr": NV((16, 16), four_over_six=True, four_over_six_error="mse", stochastic_rounding=True),
}
H = dtq.HybridQuantizer
HYBRIDS = {
    "mxfp8/nvfp4_row_scaled_fos": H(rowwise=dtq.MXFP8Quantizer(), columnwise=NV(row_scaled=True, four_over_six=True)),
    "nvfp4_row_scaled/mxfp8": H(rowwise=NV(row_scaled=True, e4m3_max=256), columnwise=dtq.MXFP8Quantizer()),
    "nvfp4_row_scaled/identity": H(rowwise=NV(row_scaled=True), columnwise=dtq.IdentityQuantizer(torch.bfloat16)),
    "mxfp8/nvfp4_16x16_fos": H(rowwise=dtq.MXFP8Quantizer(), columnwise=NV((16, 16), four_over_six=True)),
    "fp8_row/nvfp4_fos": H(rowwise=dtq.Float8RowwiseQuantizer(), columnwise=NV(four_over_six=True)),
}


def _codes(p):
    return unpack_e2m1(p["data"])


def _fp32(*values):
    return torch.tensor(values, dtype=torch.float32)


# =================================================================================================
# settings
# =================================================================================================


def test_defaults_keep_their_bits_and_checkpoint_tags():
    """The options are off by default: existing settings keep their repr, so their checkpoint
    format tags (the layout-1 digests below were those before the options existed)."""
    assert format_tag(NV(), layout=1) == "nvfp4-f9b3df"
    assert format_tag(NV((16, 16)), layout=1) == "nvfp4-9a4fc6"
    assert format_tag(NV(stochastic_rounding=True, random_hadamard=True), layout=1) == "nvfp4-6a76a7"
    explicit = NV(row_scaled=False, four_over_six=False, four_over_six_error="mae", e4m3_max=448)
    assert explicit == NV() and format_tag(explicit) == format_tag(NV())
    tags = {format_tag(q) for q in OPTIONS.values()} | {format_tag(NV()), format_tag(NV(hadamard_seed=None))}
    assert len(tags) == len(OPTIONS) + 2  # every option is part of the tag
    assert NV(e4m3_max=256) == NV(e4m3_max=256.0) and repr(NV(e4m3_max=256)) == repr(NV(e4m3_max=256.0))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block=(16, 16), row_scaled=True), "row_scaled=True .* block=\\(1, 16\\)"),
        (dict(row_scaled=1), "row_scaled must be True or False"),
        (dict(four_over_six="mse"), "four_over_six must be True or False"),
        (dict(four_over_six=True, four_over_six_error="max"), "four_over_six_error='max' is not one of"),
        (dict(four_over_six_error="mse"), "only applies with four_over_six=True"),
        (dict(e4m3_max=500), "e4m3_max=500 must be an E4M3 value in \\[1, 448\\]"),
        (dict(e4m3_max=0.5), "e4m3_max=0.5"),
        (dict(e4m3_max=300), "e4m3_max=300"),  # between the E4M3 values 288 and 320
        (dict(e4m3_max=True), "e4m3_max=True"),
        (dict(hadamard_seed=-1), "hadamard_seed=-1 must be an int in \\[0, 2\\*\\*32\\)"),
        (dict(hadamard_seed=2**32), "hadamard_seed=4294967296"),
        (dict(hadamard_seed=1.5), "hadamard_seed=1.5"),
        (dict(hadamard_seed=True), "hadamard_seed=True"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_invalid_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NV(**kwargs)


# =================================================================================================
# golden cases (hand-checked)
# =================================================================================================


def test_e4m3_max_golden():
    # Global amax 1536: S_enc = 256 * 6 / 1536 = 1 with e4m3_max=256 (448 * 6 / 1536 = 1.75 by default).
    # Block 0 (amax 1536): s_b = e4m3(256 * S_enc) = 256 (448); block 1 (amax 6): s_b = 1 (1.75).
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16:20] = 1536.0, _fp32(6.0, 4.0, -3.0, 0.5)
    for q, s_enc, scales in ((NV(e4m3_max=256), 1.0, (256.0, 1.0)), (NV(), 1.75, (448.0, 1.75))):
        p = q.quantize(x, columnwise=False).payload("rowwise")
        assert torch.equal(p["scale"].float(), _fp32(*scales).view(1, 2)) and p["amax"].item() == 1536.0
        assert _codes(p)[0, 16:20].tolist() == [7, 6, 0x8 | 5, 1]  # 6, 4, -3, 0.5 in both
        assert torch.equal(q.quantize(x, columnwise=False).dequantize(), x)
        assert p["scale"].float()[0, 0] / s_enc == 1536.0 / 6  # s_b / S_enc: the block amax over 6


def test_row_scaled_rowwise_golden():
    # Row 0 amax 6: S_enc = 448; row 1 amax 6 * 2^-20: S_enc = 448 * 2^20. Every block scale is
    # e4m3(6 / 6 * S_enc) = 448 and every value is exact. One tensor amax instead (6): row 1's block
    # scale would be e4m3(2^-20 * 448) = 0 (below E4M3's 2^-9): all its codes 0.
    vals = _fp32(6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0, -6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, -0.0)
    x = torch.stack((vals, vals * 2.0**-20))
    t = NV(row_scaled=True).quantize(x, columnwise=False)
    p = t.payload("rowwise")
    assert p["amax"].shape == (2, 1) and p["amax"].flatten().tolist() == [6.0, 6.0 * 2.0**-20]
    assert p["scale"].float().flatten().tolist() == [448.0, 448.0]
    assert _codes(p)[0].tolist() == _codes(p)[1].tolist() == [7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8]
    assert torch.equal(bits(t.dequantize()), bits(x))
    plain = NV().quantize(x, columnwise=False)
    assert plain.payload("rowwise")["scale"].float()[1].item() == 0.0 and (plain.dequantize()[1] == 0).all()


def test_row_scaled_columnwise_golden():
    # Columnwise blocks run along M: one amax (and S_enc) per column, a [1, K] field.
    col = _fp32(6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0, -6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0)
    x = torch.zeros(16, 16)
    x[:, 0], x[:, 1], x[:, 2] = col, col * 2.0**-20, col * 2.0**20
    p = NV(row_scaled=True).quantize(x, rowwise=False).payload("columnwise")
    assert p["amax"].shape == (1, 16)
    assert p["amax"][0, :4].tolist() == [6.0, 6.0 * 2.0**-20, 6.0 * 2.0**20, 0.0]
    assert p["scale"].float()[0, :3].tolist() == [448.0] * 3 and p["scale"].float()[0, 3].item() == 0.0
    assert torch.equal(NV(row_scaled=True).quantize(x, rowwise=False).dequantize(), x)


def test_four_over_six_golden():
    # S_enc = 1 (amax 2688), one 1x16 block per row, the rest zeros. Candidates: s6 = e4m3(amax / 6),
    # s4 = e4m3(amax / 4); errors of the E2M1 values times s_b against x.
    rows = [
        # amax 4: s6 = e4m3(0.667) = 0.6875 -> 4.125, 2.75, 2.0625, 1.03125 (|e| sum 0.46875);
        # s4 = 1: 4, 3, 2, 1 exact. Both modes take 4.
        ((4.0, 3.0, 2.0, 1.0), 1.0, 1.0),
        # amax 6: s6 = 1 exact; s4 = 1.5: 0.5 -> 0.75. Both take 6.
        ((6.0, 0.5), 1.0, 1.0),
        # s6 = 1: 2.5 -> 2 (tie to even): |e| 0.5, e^2 0.25; s4 = 1.5: 1 -> 0.75, 0.5 -> 0.75,
        # 2.5 -> 2.25: |e| 0.75, e^2 0.1875. "mae" takes 6, "mse" takes 4.
        ((6.0, 1.0, 0.5, 2.5), 1.0, 1.5),
        # both exact (6 / 1.5 = 4): a tie keeps 6
        ((6.0,), 1.0, 1.0),
    ]
    x = torch.zeros(len(rows), 16)
    for i, (vals, _, _) in enumerate(rows):
        x[i, : len(vals)] = _fp32(*vals)
    for mode, col in (("mae", 1), ("mse", 2)):
        q = NV(four_over_six=True, four_over_six_error=mode)
        p = q.quantize(x, columnwise=False, amax=S1).payload("rowwise")
        assert p["scale"].float().flatten().tolist() == [r[col] for r in rows], mode
    p = NV(four_over_six=True).quantize(x, columnwise=False, amax=S1).payload("rowwise")
    assert _codes(p)[0, :4].tolist() == [6, 5, 4, 2]  # 4, 3, 2, 1 at s_b = 1
    assert torch.equal(NV(four_over_six=True).quantize(x[:1], columnwise=False, amax=S1).dequantize(), x[:1])
    # 16x16 blocks and columnwise blocks choose the same way: the block [4, 3, 2, 1] as a column
    for q in (NV((16, 16), four_over_six=True), NV(four_over_six=True)):
        xt = torch.zeros(16, 16)
        xt[:4, 0] = _fp32(4.0, 3.0, 2.0, 1.0)
        t = q.quantize(xt, rowwise=False, amax=S1)
        assert t.payload("columnwise")["scale"].float()[0, 0].item() == 1.0 and torch.equal(t.dequantize(), xt)


def _pinned_input():
    """[64, 128] values exact on every platform (integer mantissas times powers of two; rows span
    2^-6..2^6), so payload digests mean the same bits everywhere."""
    i = torch.arange(64 * 128, dtype=torch.int64)
    mant = ((i * 2654435761) % 2**24) - 2**23
    exp = ((i // 128) * 7 % 13) - 6
    return torch.ldexp(mant.to(torch.float32), (exp - 23).to(torch.float32)).reshape(64, 128)


def _digest(t) -> str:
    h = hashlib.sha1()
    for d in t.directions:
        for k, v in sorted(t.payload(d).items()):
            h.update(d.encode() + k.encode() + v.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


# sha1 of every payload field's bytes (both directions, seed 77) of _pinned_input(): the bits of
# docs/formats.md's definitions as the reference computes them on this commit. A change here is a
# change of the format (and of checkpoints written with it), never an incidental refactor.
PINNED = {
    "row_scaled": "25cd39282ea8",
    "fos_mae": "cf6c786f089f",
    "fos_mse_e4m3_256": "6e978564b87a",
    "e4m3_320": "dae34bcde303",
    "row_scaled_fos_sr": "2e20dcbe82fd",
    "row_scaled_rht_fos": "36b9126a1aeb",
    "rht_fos_mse_sr": "d6bbeebc28cc",
    "rht_no_sign_mask": "c7b12c28fb37",
    "16x16_fos": "7d9ed2480fb8",
    "16x16_fos_mse_sr": "31a92a3e4426",
    "mxfp8/nvfp4_row_scaled_fos": "3316e92f1dfa",
    "nvfp4_row_scaled/mxfp8": "9c65a2076a3a",
    "nvfp4_row_scaled/identity": "d0362f0a0539",
    "mxfp8/nvfp4_16x16_fos": "fbce384a6955",
    "fp8_row/nvfp4_fos": "c6b6625848b6",
}


def test_payload_digests_pin_the_bits():
    x = _pinned_input()
    got = {name: _digest(q.quantize(x, seed=77)) for name, q in {**OPTIONS, **HYBRIDS}.items()}
    assert got == PINNED
    assert len(set(got.values()) | {_digest(NV().quantize(x)), _digest(NV((16, 16)).quantize(x))}) == len(got) + 2


def test_hadamard_sign_mask_seed():
    """The sign mask is a pure function of the seed (the same in every process: these masks are
    literals); None is no mask (all +1). The seed names the rotation, so wgrad operands with
    different seeds are each un-rotated before their product instead of multiplied rotated."""
    masks = {0: 0xAE5C, 7: 0x8678, 12345: 0x0151, None: 0}
    for seed, mask in masks.items():
        q = NV(random_hadamard=True, hadamard_seed=seed)
        assert q.codec("columnwise").kernel_spec((16, 16), torch.float32).hadamard_signs == mask
        assert q.codec("columnwise").rotation() == ("hadamard16", seed)
    # no mask: T e_0 = H16[:, 0] / 4 = 0.25 everywhere
    x = torch.zeros(16, 16)
    x[0, 0] = 1.0
    q = NV(random_hadamard=True, hadamard_seed=None)
    t = q.quantize(x, rowwise=False, amax=torch.tensor(0.25))
    vals, _ = q.codec("columnwise").dequantize(t.payload("columnwise"), (16, 16), rotated=True)
    assert torch.equal(vals[:, 0], torch.full((16,), 6.0 * 448.0))  # S_enc = 2688 / 0.25; s_b = 448; code 6
    assert torch.equal(t.dequantize(), x)
    # wgrad dW = dY^T X with rotated operands: same seed -> multiplied rotated; different -> not
    dy, xin = randn(32, 16, seed=3), randn(32, 48, seed=4)
    ref = dy.double().T @ xin.double()
    for sa, sb, shared in ((7, 7, True), (7, 8, False), (None, 7, False)):
        a = NV(random_hadamard=True, hadamard_seed=sa).quantize(dy, rowwise=False)
        b = NV(random_hadamard=True, hadamard_seed=sb).quantize(xin, rowwise=False)
        oa, ob = dtq.gemm.Operand(a, "columnwise", transpose=True), dtq.gemm.Operand(b, "columnwise")
        assert dtq.gemm._shared_rotation(oa, ob) == shared
        got = dtq.gemm.mm(oa, ob).double()
        deq = a.dequantize(torch.float64, direction="columnwise").T @ b.dequantize(
            torch.float64, direction="columnwise"
        )
        assert (got - deq).abs().max() <= 1e-5 * deq.abs().max() and (got - ref).norm() < 0.3 * ref.norm()


# =================================================================================================
# properties
# =================================================================================================


def _data(m, k, seed):
    """Rows spanning six decades (what row scaling is for), a few outliers."""
    x = randn(m, k, seed=seed) * 10.0 ** (torch.rand(m, 1, generator=torch.Generator().manual_seed(seed)) * 6 - 3)
    x[3, 5] *= 50
    return x


@pytest.mark.parametrize("name", list(OPTIONS))
def test_dequantize_error_bound(name):
    """Every element within the E2M1 rounding bound of its stored block scale (random Hadamard
    columnwise lives in another space: skipped), and row scaling never flushes a small row."""
    q = OPTIONS[name]
    x = _data(64, 128, seed=1)
    t = q.quantize(x, seed=5)
    for d in t.directions:
        eb = _elementwise_bound(q, d, t.payload(d), x)
        if eb is not None:
            assert ((t.dequantize(direction=d) - x).abs() <= eb).all(), d
    if q.row_scaled and not q.random_hadamard:
        rel = (t.dequantize() - x).norm(dim=1) / x.norm(dim=1)
        assert (rel < 0.2).all(), rel.max()


def _block_errors(q, x, tile, mode):
    """Per-block error of q's quantization by ``mode`` in float64 (x space), and the block scales."""
    d = "rowwise" if tile[0] == 1 or q.block == (16, 16) else "columnwise"
    t = q.quantize(x, rowwise=d == "rowwise", columnwise=d == "columnwise")
    e = (t.dequantize(torch.float64, direction=d) - x.double()).abs()
    e = e if mode == "mae" else e * e
    m, k = x.shape
    return e.reshape(m // tile[0], tile[0], k // tile[1], tile[1]).sum(dim=(1, 3)), t.payload(d)["scale"].float()


@pytest.mark.parametrize("mode", ["mae", "mse"])
@pytest.mark.parametrize(
    "tile, kw",
    [((1, 16), {}), ((16, 1), {}), ((16, 16), dict(block=(16, 16))), ((1, 16), dict(row_scaled=True))],
    ids=["1x16", "16x1", "16x16", "row_scaled"],
)
def test_four_over_six_is_never_worse_per_block(tile, kw, mode):
    """Per block, by its own error measure, 4/6 is at most the plain (divisor 6) error (up to the
    fp32 rounding of the measure), better on some blocks, and its scale is one of the candidates."""
    x = _data(64, 128, seed=2)
    fos, s_fos = _block_errors(NV(four_over_six=True, four_over_six_error=mode, **kw), x, tile, mode)
    plain, s6 = _block_errors(NV(**kw), x, tile, mode)
    assert (fos <= plain * (1 + 1e-5) + 1e-30).all()
    assert (fos < plain * (1 - 1e-3)).any() and fos.sum() < plain.sum()
    changed = s_fos != s6
    assert changed.any() and (s_fos[changed] > s6[changed]).all()  # divisor 4: the larger scale


@pytest.mark.parametrize("name", [n for n, q in OPTIONS.items() if q.block == (1, 16)])
def test_shard_is_slice_of_whole(name):
    """Dim-0 shards quantized with the whole tensor's reduced amaxes (per-column ones for
    row-scaled columnwise) hold the rows of the whole payloads; so do slices of the whole."""
    q = OPTIONS[name]
    x = _data(64, 128, seed=3)
    whole = q.quantize(x, seed=9)
    amax = q.local_amax(x)
    if q.row_scaled:
        assert "rowwise" not in amax and amax["columnwise"].shape == (1, 128)
    for a, b in ((0, 32), (32, 64), (16, 48)):
        part = q.quantize(x[a:b], amax=amax, seed=9)
        for d in whole.directions:
            want = payload_rows(q, d, whole.payload(d), a, b)
            if not q.stochastic_rounding:  # the random bits are counted from the shard's first element
                assert_payload_equal(part.payload(d), want, f"{name} {d} rows {a}:{b}")
            assert_payload_equal(whole[a:b].payload(d), want, f"{name} {d} slice {a}:{b}")


def test_row_scaled_update_usage_takes_the_columnwise_amax_from_the_source():
    q = NV(row_scaled=True)
    x = _data(32, 64, seed=4)
    t = q.quantize(x, columnwise=False)
    t.update_usage(columnwise=True, source=x)
    assert_payload_equal(t.payload("columnwise"), q.quantize(x, rowwise=False).payload("columnwise"))


def test_gemms_apply_row_scaled_factors():
    """fprop, dgrad and wgrad of row-scaled operands: the per-row / per-column factors lie along
    the output dims, so the emulated GEMM is the product of the dequantized operands."""
    g = torch.Generator().manual_seed(6)
    x, w, dy = (
        torch.randn(*s, generator=g) * 10.0 ** (torch.rand(s[0], 1, generator=g) * 4 - 2)
        for s in ((32, 64), (48, 64), (32, 48))
    )
    qx = NV(row_scaled=True, four_over_six=True).quantize(x)
    qw = NV(row_scaled=True, e4m3_max=256).quantize(w)
    qdy = NV(row_scaled=True, random_hadamard=True, hadamard_seed=3).quantize(dy)
    qx_rht = NV(row_scaled=True, random_hadamard=True, hadamard_seed=3).quantize(x)
    op = dtq.gemm.Operand
    cases = [
        (op(qx), op(qw, transpose=True)),
        (op(qdy), op(qw, "columnwise")),
        (op(qdy, "columnwise", transpose=True), op(qx_rht, "columnwise")),
    ]
    for a, b in cases:
        da = a.tensor.dequantize(torch.float64, direction=a.direction)
        db = b.tensor.dequantize(torch.float64, direction=b.direction)
        want = (da.T if a.transpose else da) @ (db.T if b.transpose else db)
        got = dtq.gemm.mm(a, b).double()
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (a.direction, b.direction)


def test_flat_slice_master_cast_refuses_four_over_six():
    w = torch.nn.Parameter(NV(four_over_six=True).quantize(randn(32, 64, seed=7)), requires_grad=False)
    master = randn(32, 64, seed=8).reshape(-1)
    with pytest.raises(ValueError, match="chooses each rowwise block scale from all the block's values"):
        dtq.parallel.quantize_master_weights([w], [dtq.parallel.FlatSlice(master[:1024], 0)])
    dtq.parallel.quantize_master_weights([w], [master.view(32, 64)])  # dim-0 shards (here: whole) work
    assert_payload_equal(w.payload("rowwise"), NV(four_over_six=True).quantize(master.view(32, 64)).payload("rowwise"))


# =================================================================================================
# distributed: FSDP2 and sequence parallel, 2 gloo ranks
# =================================================================================================


def _options_recipe(role):
    """Row-scaled 4/6 NVFP4 weights (columnwise amaxes per column, reduced over FSDP2's shards),
    row-scaled inputs with e4m3_max and a seeded RHT, which the gradients share."""
    if role.tensor_type == "weight":
        return NV(row_scaled=True, four_over_six=True)
    if role.tensor_type == "input":
        return NV(row_scaled=True, random_hadamard=True, hadamard_seed=11, e4m3_max=256)
    return NV(stochastic_rounding=True, random_hadamard=True, hadamard_seed=11)


def _check_distributed(rank, world):
    import tests.parallel.test_sharded_equals_single as ses

    recipe = dtq.CustomRecipe(_options_recipe)
    mesh = init_device_mesh("cpu", (world,))
    for qp in (False, True):  # high-precision shards with precomputed amaxes; quantized parameters
        ref = ses._model(recipe, qp, recompute=False)
        ref_losses = ses._train(ref, recipe, qp, precompute=False)
        model = ses._model(recipe, qp, recompute=True)
        ses._shard(model, mesh, "linear", True)
        losses = ses._train(model, recipe, qp, precompute=not qp)
        ses._compare("nvfp4 options", dict(quantized_params=qp, recompute=True), losses, ref_losses, model, ref)
    # sequence-parallel gathers: the whole tensor's payloads (row amaxes gathered, column ones reduced)
    whole = (torch.randn(world * 32, 128, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    whole[5] *= 1e-4
    local = whole[rank * 32 : (rank + 1) * 32]
    for q in (NV(row_scaled=True, four_over_six=True), NV(row_scaled=True, random_hadamard=True, hadamard_seed=5)):
        dtq.parallel.comm_stats(reset=True)
        got = dtq.parallel.gather_along_first_dim(local, quantizer=q, rowwise=True, columnwise=True)
        stats = dtq.parallel.comm_stats(reset=True)
        ref = q.quantize(whole)
        for d in ref.directions:
            assert_payload_equal(got.payload(d), ref.payload(d), f"{q} {d}")
        n, m = whole.numel(), whole.shape[0]
        assert stats == {"nvfp4/rowwise": n * 9 // 16 + 4 * m, "nvfp4/columnwise": n * 9 // 16}, stats


def test_fsdp2_and_sequence_parallel_equal_single_process():
    spawn(_check_distributed, 2, backend="gloo")


@pytest.mark.parametrize("name", list(OPTIONS))
def test_quantizer_and_tensor_serialization_round_trip(name, tmp_path):
    """Quantizers travel by pickle (torch.save, FSDP2 / DCP helpers) and by repr (DCP's extra-state
    check and key tags): each option survives both with its equality and checkpoint tag, and a
    QuantizedTensor through torch.save / torch.load (weights_only=True, dtq's safe globals) keeps
    its payload bits."""
    q = OPTIONS[name]
    back = pickle.loads(pickle.dumps(q))
    assert back == q and hash(back) == hash(q) and format_tag(back) == format_tag(q)
    assert eval(repr(q), {"NVFP4Quantizer": NV}) == q  # repr names every setting that differs
    t = q.quantize(_data(32, 64, seed=13), seed=3)
    torch.save(t, tmp_path / "t.pt")
    u = torch.load(tmp_path / "t.pt", weights_only=True)
    assert u.quantizer == q and u.directions == t.directions
    for d in t.directions:
        assert_payload_equal(u.payload(d), t.payload(d), f"{name} {d}")


def test_dcp_round_trip_of_quantized_parameters(tmp_path):
    """dcp.save / dcp.load of a model whose quantized parameters carry the options (row-scaled
    [M, 1] / [1, K] amax fields, 4/6 scales): a fresh model loads them bit for bit."""
    import torch.distributed.checkpoint as dcp

    import tests.checkpoint.test_checkpoint as tc

    recipe = dtq.CustomRecipe(_options_recipe)
    a = tc._model(0, True, recipe=recipe)
    assert any(".amax" in k for k in a.state_dict())
    dcp.save(a.state_dict(), checkpoint_id=str(tmp_path / "dcp"))
    b = tc._model(1, True, recipe=recipe)
    sd = b.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"))
    b.load_state_dict(sd)
    tc._same_weights(a, b)


# =================================================================================================
# CUDA kernels against the reference (the lead runs these on the device)
# =================================================================================================

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels need a CUDA GPU (CPU-only here)")
SHAPES = [(256, 384), (288, 416), (130, 208), (16, 16), (1, 32)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(shape, dtype, seed):
    m, k = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 10.0 ** (torch.rand(m, 1, generator=g) * 6 - 3)
    x = x * torch.logspace(-2, 2, k)[torch.randperm(k, generator=g)]
    flat = x.view(-1)
    for i, v in enumerate((float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, 3e38)):
        flat[(i * 7919 + 13) % flat.numel()] = v
    mids = torch.randn(m, k, generator=g).sign() * E2M1[torch.randint(0, 8, (m, k), generator=g)]
    zeros = torch.zeros(m, k)
    if m >= 32:
        x[16:32] = 0.0  # all-zero blocks and rows
    return {"random": x.to(dtype), "grid": mids.to(dtype), "zeros": zeros.to(dtype)}


def _valid(q, shape, dirs):
    try:
        for d, on in zip(dtq.DIRECTIONS, dirs):
            if on:
                q.codec(d).check_shape(shape)
    except ValueError:
        return False
    return True


def _kernel_cases(names, generic, monkeypatch):
    spy = []
    real = kernels.quantize_alloc

    def wrapped(*a, **k):
        out = real(*a, **k)
        spy.append(len(out) > 0)  # empty: nothing launched, the reference ran
        return out

    monkeypatch.setattr(kernels, "quantize_alloc", wrapped)
    n = 0
    for name in names:
        q = {**OPTIONS, **HYBRIDS}[name]
        for shape, dtype in itertools.product(SHAPES, DTYPES):
            for iname, x in _inputs(shape, dtype, seed=len(name) + shape[0]).items():
                for dirs in ((True, False), (False, True), (True, True)):
                    if not _valid(q, shape, dirs):
                        continue
                    kw = dict(rowwise=dirs[0], columnwise=dirs[1], seed=1234)
                    del spy[:]
                    got = q.quantize(x.cuda(), **kw)
                    ran = bool(spy) and spy[-1]
                    falls_back = generic and any(
                        getattr(q.for_direction(d), "block", None) == (16, 16) and q.for_direction(d).four_over_six
                        for d, on in zip(dtq.DIRECTIONS, dirs)
                        if on
                    )
                    assert ran != falls_back, f"{name} {shape} {dtype} {dirs}: kernel ran={ran}"
                    want = q.quantize(x, **kw)
                    for d in want.directions:
                        assert_payload_equal(
                            {k: v.cpu() for k, v in got.payload(d).items()},
                            want.payload(d),
                            f"{name} {shape} {dtype} {iname} {dirs} {d}",
                        )
                    n += 1
    assert n > 0


@needs_cuda
@pytest.mark.parametrize("name", list(OPTIONS) + list(HYBRIDS))
def test_kernel_bits_match_reference(name, monkeypatch):
    _kernel_cases([name], generic=False, monkeypatch=monkeypatch)


@needs_cuda
@pytest.mark.parametrize(
    "name",
    [
        "row_scaled_fos_sr",
        "row_scaled_rht_fos",
        "rht_fos_mse_sr",
        "16x16_fos",
        "fos_mse_e4m3_256",
        "mxfp8/nvfp4_row_scaled_fos",
    ],
)
def test_generic_kernel_bits_match_reference(name, monkeypatch):
    """The generic kernel (DTQ_GENERIC_QUANTIZE=1) on the same cases; for 4/6 16x16 blocks it has no
    code: the reference runs (one warning), never a wrong kernel."""
    monkeypatch.setenv("DTQ_GENERIC_QUANTIZE", "1")
    _kernel_cases([name], generic=True, monkeypatch=monkeypatch)


@needs_cuda
@pytest.mark.parametrize("name", [n for n, q in OPTIONS.items()])
def test_given_amax_vectors_and_dequantize_kernels(name):
    """Given (reduced) amaxes, including per-column ones above or below the true value, and the
    dequantize kernels (fp32, factored, bf16) against the reference."""
    q = OPTIONS[name]
    x = _data(128, 256, seed=12)
    amax = {
        d: a * torch.rand(a.shape, generator=torch.Generator().manual_seed(1)) * 2 for d, a in q.local_amax(x).items()
    }
    got = q.quantize(x.cuda(), amax={d: a.cuda() for d, a in amax.items()}, seed=torch.tensor(5, device="cuda"))
    want = q.quantize(x, amax=amax, seed=5)
    for d in want.directions:
        assert_payload_equal({k: v.cpu() for k, v in got.payload(d).items()}, want.payload(d), f"{name} {d}")
        codec = q.codec(d)
        assert codec.dequantize(got.payload(d), (128, 256), kernel_only=True) is not None
        ref = codec.dequantize(want.payload(d), (128, 256))
        torch.testing.assert_close(
            codec.dequantize(got.payload(d), (128, 256)).cpu(), ref, rtol=0, atol=0, equal_nan=True
        )
        rv, rf = codec.dequantize(want.payload(d), (128, 256), factored=True)
        gv, gf = codec.dequantize(got.payload(d), (128, 256), torch.bfloat16, factored=True)
        assert torch.equal(gv.cpu(), rv.to(torch.bfloat16)) and torch.equal(bits(gf.cpu()), bits(rf))
