"""CPU offload of saved activations: bitwise identical to the plain run, at payload size."""

import pytest
import torch

import dtq

K, N, TOKENS = 128, 256, 64

RECIPES = {
    "fp8": dtq.Float8CurrentScaling,
    "fp8_delayed": dtq.DelayedScaling,
    "fp8_block": dtq.Float8BlockScaling,
    "mxfp8": dtq.MXFP8BlockScaling,
    "nvfp4": dtq.NVFP4BlockScaling,
    "hybrid": lambda: dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling()),
    "hybrid_rd": lambda: dtq.hybrid_recipe(
        dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling(), weight_columnwise_source="rowwise_dequantized"
    ),
}


def _run(recipe, ctx, device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        dtq.nn.LayerNormMLP(K, N, activation="swiglu", name="mlp"), dtq.nn.Linear(K, K, name="out")
    ).to(device)
    x = torch.randn(TOKENS, K, device=device, requires_grad=True)
    torch.manual_seed(1)
    r = recipe()
    for _ in range(2):
        with dtq.autocast(r), ctx():
            y = model(x)
        y.square().sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("how", ["save_on_cpu", "dtq_offload"])
def test_offload_is_bitwise(name, how, device):
    import contextlib

    ctx = {
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=device == "cuda"),
        "dtq_offload": dtq.parallel.offload,
    }[how]
    a = _run(RECIPES[name], contextlib.nullcontext, device)
    b = _run(RECIPES[name], ctx, device)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(a[2][n], b[2][n]) for n in a[2])


@pytest.mark.parametrize(
    "recipe,qx,qw",
    [
        (dtq.MXFP8BlockScaling(), dtq.MXFP8Quantizer(), dtq.MXFP8Quantizer()),
        (
            dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling()),
            dtq.NVFP4Quantizer(random_hadamard=True),
            dtq.NVFP4Quantizer((16, 16)),
        ),
    ],
)
def test_offloaded_bytes_are_payload_bytes(recipe, qx, qw):
    lin = dtq.nn.Linear(K, N, bias=False, name="l")
    x = torch.randn(TOKENS, K, requires_grad=True)
    with dtq.autocast(recipe), dtq.parallel.offload() as off:
        y = lin(x)
    y.sum().backward()
    # saved for backward: x's columnwise payload (wgrad) and W's columnwise payload (dgrad)
    want = (
        qx.quantize(x.detach(), rowwise=False).payload_nbytes()
        + qw.quantize(lin.weight.__dtq_unwrap__(), rowwise=False).payload_nbytes()
    )
    assert off.bytes == want
    assert off.bytes < (x.numel() + lin.weight.numel()) * 4 * 0.6  # far below the fp32 activations
