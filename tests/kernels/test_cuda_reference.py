"""On a GPU, the references give the same bits as on CPU, and payloads move between devices intact.

The references are the format definition; running them through CUDA's torch ops must not change a
single bit (this catches device-dependent rounding in casts, frexp/ldexp, reductions).
"""

import pytest
import torch

import dtq

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

QUANTIZERS = [
    dtq.Float8Quantizer(),
    dtq.Float8Quantizer(torch.float8_e5m2, pow2_scales=True),
    dtq.Float8RowwiseQuantizer(),
    dtq.Float8RowwiseQuantizer(torch.float8_e5m2, pow2_scales=True),
    dtq.Float8BlockQuantizer(),
    dtq.Float8BlockQuantizer((128, 128)),
    dtq.MXFP8Quantizer(),
    dtq.MXFP8Quantizer(torch.float8_e5m2, scale_rounding="floor"),
    dtq.NVFP4Quantizer(),
    dtq.NVFP4Quantizer((16, 16)),
    dtq.NVFP4Quantizer(stochastic_rounding=True, random_hadamard=True),
    dtq.IdentityQuantizer(torch.bfloat16),
    dtq.HybridQuantizer(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer()),
    dtq.HybridQuantizer(
        rowwise=dtq.Float8Quantizer(), columnwise=dtq.NVFP4Quantizer(), columnwise_source="rowwise_dequantized"
    ),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Compare bit patterns (NaN != NaN as floats).
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same_payloads(a: dtq.QuantizedTensor, b: dtq.QuantizedTensor):
    assert a.directions == b.directions
    for d in a.directions:
        for k, v in a.payload(d).items():
            w = b.payload(d)[k]
            assert torch.equal(_bits(v.cpu()), _bits(w.cpu())), (d, k)


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 384, generator=g) * torch.logspace(-3, 3, 384)
    x[3, 5], x[7, 9], x[40, 100] = float("nan"), float("inf"), -float("inf")
    x[64:96, 128:160] = 0.0
    x[100, :32] = 1e-40  # fp32 subnormals
    return [x, torch.randn(128, 256, generator=g).bfloat16()]


@pytest.mark.parametrize("q", QUANTIZERS, ids=lambda q: repr(q)[:60])
def test_reference_bits_equal_on_cpu_and_cuda(q):
    for x in _inputs():
        cpu = q.quantize(x, seed=1234)
        gpu = q.quantize(x.cuda(), seed=1234)
        assert gpu.device.type == "cuda"
        _assert_same_payloads(cpu, gpu)


@pytest.mark.parametrize("q", QUANTIZERS, ids=lambda q: repr(q)[:60])
def test_device_moves_and_pinning(q):
    t = q.quantize(torch.randn(128, 256), seed=7)
    g = t.cuda()
    assert isinstance(g, dtq.QuantizedTensor) and all(v.is_cuda for d in g.directions for v in g.payload(d).values())
    _assert_same_payloads(t, g.cpu())
    p = t.pin_memory()
    assert isinstance(p, dtq.QuantizedTensor) and p.is_pinned()
    _assert_same_payloads(t, p)
    back = g.to("cpu", non_blocking=True)
    torch.cuda.synchronize()
    _assert_same_payloads(t, back)
