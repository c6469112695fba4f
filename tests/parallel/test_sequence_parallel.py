"""Sequence-parallel gathers in quantized form (gloo on CPU, NCCL on GPUs)."""

import pytest
import torch
import torch.distributed as dist

import dtq
from dtq.testing import spawn

S, K = 64, 256  # rows per rank, hidden


def _dev():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _check(rank, world):
    cases = [
        ("fp8 rowwise", dtq.Float8Quantizer(), True, False),
        ("mxfp8 rowwise", dtq.MXFP8Quantizer(), True, False),
        ("nvfp4 both", dtq.NVFP4Quantizer(), True, True),
        ("hybrid both", dtq.HybridQuantizer(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer()), True, True),
        ("mxfp8 both", dtq.MXFP8Quantizer(), True, True),  # 2.06 B/elem > bf16's 2: gathers bf16
        ("fp8 both", dtq.Float8Quantizer(), True, True),  # one payload serves both directions
        ("fp8 row rowwise", dtq.Float8RowwiseQuantizer(), True, False),  # row scales: local rows
        ("fp8 row columnwise", dtq.Float8RowwiseQuantizer(), False, True),  # column amaxes reduced first
    ]
    g = torch.Generator().manual_seed(0)
    whole = (torch.randn(world * S, K, generator=g) * 3).bfloat16().to(_dev())
    local = whole[rank * S : (rank + 1) * S]
    for name, q, rw, cw in cases:
        dtq.parallel.comm_stats(reset=True)
        got = dtq.parallel.gather_along_first_dim(local, quantizer=q, rowwise=rw, columnwise=cw)
        stats = dtq.parallel.comm_stats(reset=True)
        ref = q.quantize(whole, rowwise=rw, columnwise=cw)
        assert got.directions == ref.directions, name
        for d in ref.directions:
            for k, v in ref.payload(d).items():
                assert torch.equal(_bits(got.payload(d)[k]), _bits(v)), (name, d, k)
        hp = whole.numel() * whole.element_size()
        assert sum(stats.values()) <= hp, (name, stats)
        if name == "mxfp8 both":
            assert stats == {"bfloat16/high_precision": hp}
        if name == "hybrid both":
            assert stats == {"mxfp8/rowwise": whole.numel() * 33 // 32, "nvfp4/columnwise": whole.numel() * 9 // 16}
        if name == "fp8 both":
            assert stats == {"fp8/rowwise": whole.numel()}
        if name == "fp8 row rowwise":  # 1 code byte per element + one fp32 scale per row
            assert stats == {"fp8_row/rowwise": whole.numel() + 4 * whole.shape[0]}
        if name == "fp8 row columnwise":  # the [1, K] scales are reduced, not gathered
            assert stats == {"fp8_row/columnwise": whole.numel()}
    with pytest.raises(ValueError, match="each rank holds 48 rows.*mxfp8 columnwise blocks span 32 rows"):
        dtq.parallel.gather_along_first_dim(local[:48], quantizer=dtq.MXFP8Quantizer(), columnwise=True)


def test_sequence_parallel_gather_2_ranks():
    spawn(_check, 2)
