"""Probe torch's row-wise scaled FP8 GEMM on this GPU: which output dtypes and element-type pairs
it accepts for dtq's FP8 row-wise payloads (``torch._scaled_mm`` with [m, 1] / [1, n] fp32
scales), and how far each result is from dtq's emulated GEMM. ``dtq.gemm._fp8_rowwise_ok`` takes
the native path only for what this prints as working."""

import torch

import dtq
from dtq.gemm import Operand, _col_major, _emulated, _row_major

print(torch.__version__, torch.cuda.get_device_name(), "CUDA", torch.version.cuda)
torch.manual_seed(0)
M, K, N = 256, 512, 384
x, w = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


for da, db in [
    (torch.float8_e4m3fn, torch.float8_e4m3fn),
    (torch.float8_e5m2, torch.float8_e4m3fn),
    (torch.float8_e4m3fn, torch.float8_e5m2),
]:
    a = Operand(dtq.Float8RowwiseQuantizer(da).quantize(x))
    b = Operand(dtq.Float8RowwiseQuantizer(db).quantize(w), transpose=True)
    ref = _emulated(a, b, torch.float32)
    sa, sb = a.payload["scale_inv"].reshape(M, 1), b.payload["scale_inv"].reshape(1, N)
    for out in (torch.bfloat16, torch.float32, torch.float16):
        try:
            da, db = _row_major(a.payload, a.transpose), _col_major(b.payload, b.transpose)
            got = torch._scaled_mm(da, db, scale_a=sa, scale_b=sb, out_dtype=out)
            print(f"{str(da):22s} x {str(db):22s} -> {str(out):15s} ok  rel={rel(got, ref):.2e}")
        except Exception as e:  # noqa: BLE001
            print(f"{str(da):22s} x {str(db):22s} -> {str(out):15s} ERR {str(e).splitlines()[0][:120]}")
