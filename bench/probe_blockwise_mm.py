"""Probe torch's blockwise FP8 scaled_mm on this GPU: which scale layouts it accepts for dtq's
FP8 block payloads, and whether the result matches dtq's emulated GEMM."""

import itertools

import torch
import torch.nn.functional as F

import dtq
from dtq.gemm import Operand, _emulated

print(torch.__version__, torch.cuda.get_device_name(), torch.version.cuda)
print([n for n in dir(F) if "scaled" in n.lower()], [n for n in dir(F.ScalingType) if not n.startswith("_")])
torch.manual_seed(0)
M, K, N = 256, 512, 384
x, w, dy = (torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda"), torch.randn(M, N, device="cuda"))
q1, q2 = dtq.Float8BlockQuantizer((1, 128)), dtq.Float8BlockQuantizer((128, 128))
xq, wq, gq, wq1 = q1.quantize(x), q2.quantize(w), q1.quantize(dy), q1.quantize(w)
ST = F.ScalingType


def colmajor(t):
    return t.t().contiguous().t()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


cases = {
    "fprop 1x128*128x128": (Operand(xq), Operand(wq, transpose=True), ST.BlockWise128x128),
    "fprop 1x128*1x128": (Operand(xq), Operand(wq1, transpose=True), ST.BlockWise1x128),
    "dgrad 1x128*128x128": (Operand(gq), Operand(wq, "columnwise"), ST.BlockWise128x128),
    "dgrad 1x128*1x128": (Operand(gq), Operand(wq1, "columnwise"), ST.BlockWise1x128),
    "wgrad 1x128*1x128": (Operand(gq, "columnwise", transpose=True), Operand(xq, "columnwise"), ST.BlockWise1x128),
}
for name, (a, b, rb) in cases.items():
    ref = _emulated(a, b, torch.float32)
    da = a.payload["data"]
    da = (da.t() if a.transpose else da).contiguous()
    sa = a.payload["scale_inv"]
    sa = sa.t() if a.transpose else sa
    db = colmajor(b.payload["data"].t() if b.transpose else b.payload["data"])
    sb = b.payload["scale_inv"]
    sb = sb.t() if b.transpose else sb
    for va, vb in itertools.product(
        ["colmajor", "contig"], ["asis", "contig", "colmajor", "T_asis", "T_contig", "T_colmajor"]
    ):
        A = {"colmajor": colmajor(sa), "contig": sa.contiguous()}[va]
        base = sb.t() if vb.startswith("T_") else sb
        B = {"asis": base, "contig": base.contiguous(), "colmajor": colmajor(base)}[vb.replace("T_", "")]
        try:
            out = F.scaled_mm(da, db, A, ST.BlockWise1x128, B, rb, output_dtype=torch.float32)
            print(
                f"{name:22s} a={va:9s} b={vb:11s} {tuple(A.shape)} {A.stride()} {tuple(B.shape)} {B.stride()} "
                f"rel={rel(out, ref):.2e}"
            )
        except Exception as e:  # noqa: BLE001
            print(f"{name:22s} a={va:9s} b={vb:11s} ERR {str(e).splitlines()[0][:160]}")
