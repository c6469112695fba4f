"""QuantizedTensor's op table (dtq/tensor_ops.py): an op without a handler raises, naming it; the
allowed fallbacks (pointwise ops, reductions, matrix products, in-place optimizer updates) warn
once per op and are counted; handled ops neither warn nor count."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

import dtq
import dtq.tensor
from dtq import tensor_ops

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(dtq._warn, "_warned", set())  # one-time warnings: once per test here
    tensor_ops.reset_fallback_counts()


def _qt(q=None, shape=(64, 128), seed=0):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return (q or dtq.MXFP8Quantizer()).quantize(x), x


def _payload_bits(t):
    return {(d, k): v.clone() for d in t.directions for k, v in t.payload(d).items()}


@pytest.mark.parametrize("op", ["cat", "unsqueeze", "embedding", "index_put_"])
def test_unhandled_op_raises_naming_op_format_and_shape(op):
    t, _ = _qt()
    before = _payload_bits(t)
    calls = {
        "cat": (lambda: torch.cat([t, t]), "aten.cat.default"),
        "unsqueeze": (lambda: t.unsqueeze(0), "aten.unsqueeze.default"),
        "embedding": (lambda: torch.nn.functional.embedding(torch.tensor([0, 3]), t), "aten.embedding.default"),
        "index_put_": (lambda: t.index_put_((torch.tensor([1]),), torch.zeros(128)), "aten.index_put_.default"),
    }
    fn, name = calls[op]
    with pytest.raises(NotImplementedError) as err:
        fn()
    msg = str(err.value)
    assert name in msg and "mxfp8 QuantizedTensor of shape [64, 128]" in msg
    assert "t.dequantize()" in msg and "view" in msg and "copy_" in msg  # what works
    assert tensor_ops.fallback_counts() == {}
    after = _payload_bits(t)
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused op changed the payloads"


def test_allowed_fallback_warns_once_per_op_and_counts_every_call():
    t, _ = _qt()
    hp = t.dequantize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [t + 1, t + 2, t.sum(), torch.equal(t, t)]
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 3, msgs  # add (twice: one warning), sum, equal
    assert "aten.add.Tensor ran on the dequantized values of a mxfp8 QuantizedTensor of shape [64, 128]" in msgs[0]
    assert "requantized" not in msgs[0]
    assert tensor_ops.fallback_counts() == {"aten.add.Tensor": 2, "aten.sum.default": 1, "aten.equal.default": 1}
    assert torch.equal(outs[0], hp + 1) and torch.equal(outs[1], hp + 2) and outs[3] is True


def test_inplace_fallback_requantizes_warns_once_and_counts():
    q = dtq.Float8BlockQuantizer()
    t, x = _qt(q)
    hp = t.dequantize()
    with pytest.warns(UserWarning, match="aten.mul_.Tensor ran on the dequantized values.*requantized") as rec:
        t.mul_(2)
        t.mul_(0.5)
    assert len([w for w in rec if "mul_" in str(w.message)]) == 1
    assert tensor_ops.fallback_counts() == {"aten.mul_.Tensor": 2}
    want = q.quantize((q.quantize(hp * 2).dequantize()) * 0.5)
    for d in t.directions:
        for k, v in t.payload(d).items():
            assert torch.equal(
                v.view(torch.uint8) if v.element_size() == 1 else v,
                want.payload(d)[k].view(torch.uint8) if v.element_size() == 1 else want.payload(d)[k],
            )


def test_plain_optimizer_step_is_counted():
    """torch.optim's single-tensor and foreach updates are allowed in-place fallbacks."""
    q = dtq.MXFP8Quantizer()
    for foreach in (False, True):
        tensor_ops.reset_fallback_counts()
        p = torch.nn.Parameter(_qt(q)[0])
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.0, foreach=foreach)
        p.grad = torch.ones(64, 128)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        assert type(p.data) is dtq.QuantizedTensor
        assert sum(tensor_ops.fallback_counts().values()) >= 1, foreach


def test_declined_handler_falls_back_counted():
    """A slice along dim 1 is not a payload view: dequantized, warned, counted."""
    t, _ = _qt()
    with pytest.warns(UserWarning, match="aten.slice.Tensor ran on the dequantized values"):
        piece = t[:, :64]
    assert type(piece) is torch.Tensor and torch.equal(piece, t.dequantize()[:, :64])
    assert tensor_ops.fallback_counts() == {"aten.slice.Tensor": 1}


def test_handled_ops_neither_warn_nor_count():
    t, _ = _qt()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for out in (t.detach(), t.clone(), t.view(-1), t[:32], torch.zeros_like(t), t.to(torch.bfloat16)):
            assert type(out) is dtq.QuantizedTensor
        t.copy_(t.clone())
        t.zero_()
    assert tensor_ops.fallback_counts() == {}


def test_importing_the_class_module_installs_the_op_table():
    """``import dtq.tensor`` alone (a fresh interpreter) runs ``dtq/__init__``, which imports
    dtq.tensor_ops: the table is there at the first dispatch (no import inside the class module:
    tests/package/test_layering.py)."""
    code = (
        "import torch, dtq.tensor as t, dtq.tensor_ops\n"
        "q = dtq.Float8Quantizer().quantize(torch.randn(32, 32))\n"
        "assert t._HANDLERS and type(q.detach()) is t.QuantizedTensor\n"
        "assert t._unhandled is not t._no_op_table\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
