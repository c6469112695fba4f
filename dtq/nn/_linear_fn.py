"""The autograd function behind every dtq GEMM module: fprop, dgrad and wgrad on the payloads the
recipe asks for, with the backward override applied (DESIGN section 4)."""

from __future__ import annotations

import dataclasses

import torch

from dtq.formats import COLUMNWISE, ROWWISE, Quantizer
from dtq.gemm import Operand, mm
from dtq.tensor import QuantizedTensor


@dataclasses.dataclass
class Slot:
    """One quantized tensor of one GEMM: its quantizer (None: high precision) and, under delayed
    scaling, the module's amax history buffer for it."""

    quantizer: Quantizer | None
    history: torch.Tensor | None = None
    margin: int = 0
    most_recent: bool = False

    def quantize(self, x: torch.Tensor, rowwise: bool, columnwise: bool) -> torch.Tensor:
        if self.quantizer is None or not (rowwise or columnwise):
            return x
        amax = None
        if self.history is not None:
            cur = x.detach().abs().amax().float()
            past = self.history[0] if self.most_recent else self.history.amax()
            amax = torch.where(past > 0, past, cur) * (2.0 ** self.margin)  # first step: current amax
            self.history.copy_(torch.roll(self.history, 1))
            self.history[0] = cur
        return self.quantizer.quantize(x, rowwise=rowwise, columnwise=columnwise, amax=amax)


def _keep(t: torch.Tensor, direction: str) -> torch.Tensor:
    return t.with_directions(direction) if isinstance(t, QuantizedTensor) else t


class LinearFn(torch.autograd.Function):
    """``y = x @ W.T + b`` with x quantized by ``sx``, W by ``sw`` (unless it is already a
    QuantizedTensor parameter) and dy by ``sg``."""

    @staticmethod
    def forward(ctx, x, weight, bias, sx: Slot, sw: Slot, sg: Slot, override: str | None):
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x2 = x.reshape(-1, x.shape[-1])
        bwd_cols = override is None
        xq = sx.quantize(x2, rowwise=True, columnwise=bwd_cols and need_wgrad)
        if isinstance(weight, QuantizedTensor):
            wq = weight
        else:
            wq = sw.quantize(weight, rowwise=True, columnwise=bwd_cols and need_dgrad)
        y = mm(Operand(xq, ROWWISE), Operand(wq, ROWWISE, transpose=True), torch.float32)
        if bias is not None:
            y = y + bias.to(torch.float32)
        if override is None:
            saved_x = _keep(xq, COLUMNWISE) if need_wgrad else None
            saved_w = _keep(wq, COLUMNWISE) if need_dgrad else None
        elif override == "high_precision":
            saved_x = x2 if need_wgrad else None
            w_hp = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
            saved_w = w_hp if need_dgrad else None
        else:  # "dequantized": exactly the forward operands
            saved_x = _keep(xq, ROWWISE) if need_wgrad else None
            saved_w = _keep(wq, ROWWISE) if need_dgrad else None
        ctx.save_for_backward(saved_x, saved_w)
        ctx.sg, ctx.override, ctx.has_bias = sg, override, bias is not None
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        saved_x, saved_w = ctx.saved_tensors
        need_dgrad, need_wgrad, need_bgrad = ctx.needs_input_grad[:3]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.override is None:
            gq = ctx.sg.quantize(dy2, rowwise=need_dgrad, columnwise=need_wgrad)
            if need_dgrad:
                dx = mm(Operand(gq, ROWWISE), Operand(saved_w, COLUMNWISE), torch.float32).to(ctx.x_dtype)
            if need_wgrad:
                dw = mm(Operand(gq, COLUMNWISE, transpose=True), Operand(saved_x, COLUMNWISE), torch.float32)
                dw = dw.to(ctx.w_dtype)
        else:
            # Same products, in the same order, as torch's own linear backward, so that
            # "high_precision" reproduces an unquantized module's gradients bit for bit.
            def hp(t):
                return t.dequantize(dy.dtype, direction=ROWWISE) if isinstance(t, QuantizedTensor) else t.to(dy.dtype)

            if need_dgrad:
                dx = dy2.mm(hp(saved_w)).to(ctx.x_dtype)
            if need_wgrad:
                dw = hp(saved_x).t().mm(dy2).t().to(ctx.w_dtype)
        if need_bgrad:
            db = dy2.sum(0)
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        return dx, dw, db, None, None, None, None
