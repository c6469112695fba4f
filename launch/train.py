"""The example training job (single process for now; the FSDP2 trainer replaces it).

Trains a small MLP regressor whose linear layers run the three GEMMs on quantized operands:
fprop on rowwise payloads, dgrad on the weight's columnwise payload and the gradient's rowwise
one, wgrad on columnwise payloads of gradient and input, exactly as DESIGN section 1 lays out.
The default recipe is a hybrid: MXFP8 rowwise / NVFP4 columnwise for inputs and weights, NVFP4
with stochastic rounding for gradients. The GEMMs are emulated (dequantize, fp32 matmul).

    python launch/train.py --recipe hybrid --steps 60
"""

from __future__ import annotations

import argparse
import time

import torch

import dtq

RECIPES = {
    "bf16": None,
    "fp8": lambda: (dtq.Float8Quantizer(), dtq.Float8Quantizer(), dtq.Float8Quantizer(torch.float8_e5m2)),
    "mxfp8": lambda: (dtq.MXFP8Quantizer(), dtq.MXFP8Quantizer(), dtq.MXFP8Quantizer(torch.float8_e5m2)),
    "nvfp4": lambda: (dtq.NVFP4Quantizer(), dtq.NVFP4Quantizer((16, 16)), dtq.NVFP4Quantizer(stochastic_rounding=True)),
    "hybrid": lambda: (
        dtq.HybridQuantizer(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer()),
        dtq.HybridQuantizer(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer((16, 16))),
        dtq.NVFP4Quantizer(stochastic_rounding=True),
    ),
}


class _QuantizedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, qx, qw, qg):
        x_q = qx.quantize(x)
        w_q = qw.quantize(weight)
        y = x_q.dequantize(torch.float32, direction="rowwise") @ w_q.dequantize(torch.float32, direction="rowwise").T
        # Backward needs only the columnwise payloads: drop the rowwise ones now.
        ctx.save_for_backward(x_q.update_usage(rowwise=False), w_q.update_usage(rowwise=False))
        ctx.qg = qg
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x_q, w_q = ctx.saved_tensors
        g_q = ctx.qg.quantize(dy)
        g_row = g_q.dequantize(torch.float32, direction="rowwise")
        g_col = g_q.dequantize(torch.float32, direction="columnwise")
        dx = g_row @ w_q.dequantize(torch.float32, direction="columnwise")           # dgrad
        dw = g_col.T @ x_q.dequantize(torch.float32, direction="columnwise")         # wgrad
        return dx.to(dy.dtype), dw.to(dy.dtype), None, None, None


class QLinear(torch.nn.Linear):
    def __init__(self, fan_in: int, fan_out: int, quantizers):
        super().__init__(fan_in, fan_out, bias=False)
        self.quantizers = quantizers

    def forward(self, x):
        if self.quantizers is None:
            return super().forward(x)
        return _QuantizedLinearFn.apply(x, self.weight, *self.quantizers)


def build(recipe: str, width: int) -> torch.nn.Module:
    make = RECIPES[recipe]
    layer = lambda i, o: QLinear(i, o, make() if make else None)  # noqa: E731
    return torch.nn.Sequential(layer(width, 4 * width), torch.nn.GELU(), layer(4 * width, 4 * width),
                               torch.nn.GELU(), layer(4 * width, width))


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="hybrid", choices=sorted(RECIPES))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.Tanh(),
                                  torch.nn.Linear(args.width, args.width))
    model = build(args.recipe, args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    print(f"dtq {dtq.__version__}: training a {sum(p.numel() for p in model.parameters())}-parameter MLP, "
          f"recipe={args.recipe}, {args.steps} steps of {args.batch} samples on CPU", flush=True)
    t0, loss = time.perf_counter(), torch.tensor(float("nan"))
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, args.width)
        with torch.no_grad():
            target = teacher(x)
        loss = torch.nn.functional.mse_loss(model(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % args.log_every == 0 or step == args.steps:
            rate = step * args.batch / (time.perf_counter() - t0)
            print(f"step {step:4d}/{args.steps}  loss {loss.item():.4f}  {rate:,.0f} samples/s", flush=True)
    return loss.item()


if __name__ == "__main__":
    main()
