"""GPU only (skipped elsewhere): ``dtq.kernels.chunk_cat``, FSDP2's gradient packing in one launch,
writes ``torch._chunk_cat``'s bits (its reference: the op FSDP2 calls) for every world size,
dtype pair it takes, odd shapes, zero padding, more gradients than one launch holds and
unaligned views; and declines (False, nothing written) every call it does not take. Then
FSDP2's copy-in as ``dtq.parallel.kernel_gradient_packing`` installs it: the same buffer as
FSDP2's own, and the kernel is what it runs on a GPU. (The trainer on GPUs runs it end to end:
docs/benchmarks.md, "FSDP2's gradient packing in one kernel".)"""

from __future__ import annotations

import math

import pytest
import torch

import dtq
from dtq import kernels

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels.available("cuda")),
    reason="needs a CUDA GPU with dtq's kernels (sm_90+)",
)

SHAPES = [(7, 5), (4,), (6, 2, 3), (1, 9), (2048, 64), (33, 16), (64,), (3, 8), (129, 24)]


def _grads(dtype, shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, shape in enumerate(shapes):
        t = torch.randn(shape, generator=g).mul(4.0 ** (k % 5 - 2))
        if t.numel():
            t.view(-1)[0] = float("nan") if k % 3 == 0 else -0.0  # NaN bits and signed zeros travel as they are
        out.append(t.to("cuda", dtype))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _padded(tensors, chunks):
    return sum(-(-t.shape[0] // chunks) * chunks * math.prod(t.shape[1:]) for t in tensors)


def _check(tensors, out_dtype, chunks):
    want = torch.full((chunks, _padded(tensors, chunks) // chunks), 7.0, dtype=out_dtype, device="cuda")
    got = torch.full_like(want, 5.0)
    torch._chunk_cat(tensors, dim=0, num_chunks=chunks, out=want)
    assert kernels.chunk_cat(tensors, got.view(-1), chunks)
    assert torch.equal(_bits(got), _bits(want)), (out_dtype, chunks, [tuple(t.shape) for t in tensors])


@pytest.mark.parametrize(
    "in_dtype,out_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 8])
def test_chunk_cat_writes_torchs_bits(in_dtype, out_dtype, chunks):
    _check(_grads(in_dtype, SHAPES), out_dtype, chunks)
    # aligned sizes only (every gradient on the 16-byte path), and a gradient that starts off a
    # 16-byte boundary (a view into a larger buffer: the one-element path for it alone)
    _check(_grads(in_dtype, [(256, 64), (64,), (512, 32)]), out_dtype, chunks)
    base = torch.randn(4 * 257, device="cuda").to(in_dtype)
    _check([*_grads(in_dtype, [(64, 8)]), base[1:1025].view(128, 8), *_grads(in_dtype, [(16,)])], out_dtype, chunks)


def test_chunk_cat_takes_more_gradients_than_one_launch():
    tensors = _grads(torch.bfloat16, [(k % 7 + 1, 8 * (k % 3 + 1)) for k in range(150)], seed=1)
    for chunks in (1, 2, 4):
        _check(tensors, torch.float32, chunks)


def test_chunk_cat_declines_what_it_does_not_copy_exactly():
    """False and nothing written: narrowing casts, mixed dtypes, a non-contiguous gradient, a CPU
    gradient, an output of the wrong size, a 0-dim or empty tensor. FSDP2's own packing runs those."""
    a, b = _grads(torch.float32, [(8, 4), (4,)])
    cases = [
        ([a, b], torch.bfloat16, 1),  # fp32 -> bf16 rounds
        ([a.bfloat16(), b], torch.float32, 1),
        ([a.t(), b], torch.float32, 1),
        ([a.cpu(), b], torch.float32, 1),
        ([a, torch.ones((), device="cuda")], torch.float32, 1),
        ([a, torch.ones((0, 4), device="cuda")], torch.float32, 1),  # (torch's _chunk_cat refuses it)
    ]
    for tensors, out_dtype, chunks in cases:
        out = torch.full((sum(max(t.numel(), 1) for t in tensors),), 3.0, dtype=out_dtype, device="cuda")
        assert not kernels.chunk_cat(tensors, out, chunks)
        assert bool((out == 3.0).all()), "a declined call wrote into the buffer"
    wrong = torch.full((a.numel() + b.numel() + 1,), 3.0, device="cuda")
    assert not kernels.chunk_cat([a, b], wrong, 1)
    assert bool((wrong == 3.0).all())


def test_fsdp2s_packing_through_the_kernel_keeps_its_bits():
    """With ``kernel_gradient_packing`` FSDP2's copy-in (the function ``foreach_reduce`` calls)
    fills the reduce-scatter buffer as FSDP2's own does, for one rank and several."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    dtq.parallel.kernel_gradient_packing()
    ours = collectives.foreach_reduce_scatter_copy_in
    assert ours._dtq_pack is not None, "kernel_gradient_packing installed no packing"
    fsdp2s = ours._dtq_fsdp2s
    grads = _grads(torch.bfloat16, SHAPES)
    for world in (1, 2, 4):
        want, got = (torch.full((_padded(grads, world),), float("nan"), device="cuda") for _ in range(2))
        fsdp2s([t.clone() for t in grads], want, world)
        ours([t.clone() for t in grads], got, world)
        assert torch.equal(_bits(got), _bits(want)), world


def test_kernel_packing_is_what_fsdp2s_copy_in_runs_on_a_gpu(monkeypatch):
    """The installed copy-in reaches the kernel for CUDA gradients (not torch.cat or _chunk_cat)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    dtq.parallel.kernel_gradient_packing()
    calls = []
    real = kernels.chunk_cat
    monkeypatch.setattr(kernels, "chunk_cat", lambda *a: calls.append(a[2]) or real(*a))
    grads = _grads(torch.bfloat16, [(8, 8), (16,)])
    for world in (1, 2):
        collectives.foreach_reduce_scatter_copy_in(grads, torch.empty(_padded(grads, world), device="cuda"), world)
    assert calls == [1, 2]
