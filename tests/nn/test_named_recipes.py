"""dtq.recipes' named factories (docs/recipes.md, "Named factories"): the quantizer each gives per
role and direction, as dtq.CustomRecipe and by name in the trainer, and a Linear step under each
whose payloads are those formats."""

from __future__ import annotations

import pickle

import pytest
import torch

import dtq
from dtq.launch.recipes import build_recipe
from dtq.recipes import FACTORIES

NV, MX, ID = dtq.NVFP4Quantizer, dtq.MXFP8Quantizer, dtq.IdentityQuantizer
HP = None  # the slot stays in high precision

# factory -> tensor_type -> (rowwise quantizer, columnwise quantizer), or HP for the whole slot
EXPECTED = {
    "mxfp8_fwd_nvfp4_bwd": {
        "input": (MX(), NV(random_hadamard=True)),
        "weight": (MX(), NV()),
        "grad_output": (NV(stochastic_rounding=True, random_hadamard=True),) * 2,
    },
    "nvfp4_1d_weight": {
        "input": (NV(random_hadamard=True),) * 2,
        "weight": (NV((1, 16)),) * 2,
        "grad_output": (NV(stochastic_rounding=True, random_hadamard=True),) * 2,
    },
    "mxfp8_fwd_high_precision_bwd": {
        "input": (MX(), ID()),
        "weight": (MX(), ID()),
        "grad_output": HP,
    },
    "high_precision_fwd_mxfp8_bwd": {
        "input": (ID(), MX()),
        "weight": (ID(), MX()),
        "grad_output": (MX(),) * 2,
    },
    "nvfp4_row_scaled_fwd_mxfp8_bwd": {
        "input": (NV(row_scaled=True), MX()),
        "weight": (NV(row_scaled=True), MX()),
        "grad_output": (MX(),) * 2,
    },
}

# slots whose columnwise payload is quantized from the dequantized rowwise one (the rest: "original")
COLUMNWISE_SOURCE = {("mxfp8_fwd_nvfp4_bwd", "weight"): "rowwise_dequantized"}


def test_every_factory_is_listed():
    assert set(FACTORIES) == set(EXPECTED)
    for name, f in FACTORIES.items():
        assert getattr(dtq.recipes, name) is f


@pytest.mark.parametrize("name", list(EXPECTED))
def test_formats_per_role(name):
    """Every role of every module type gets the documented quantizer per direction, through
    dtq.CustomRecipe and through the trainer's name; the recipe pickles and compares by value."""
    recipe = dtq.CustomRecipe(FACTORIES[name])
    assert build_recipe(name) == recipe and pickle.loads(pickle.dumps(recipe)) == recipe
    for module_type in ("linear", "grouped_linear"):
        for tensor_type, want in EXPECTED[name].items():
            role = dtq.QuantizerRole(module_type, tensor_type, "layers.0.mlp.fc1")
            q = recipe.quantizer(role)
            if want is HP:
                assert q is None, (role, q)
                continue
            got = (q.for_direction("rowwise"), q.for_direction("columnwise"))
            assert got == want, (role, got)
            source = COLUMNWISE_SOURCE.get((name, tensor_type), "original")
            assert getattr(q, "columnwise_source", "original") == source, (role, q)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_linear_step_uses_those_formats(name):
    """A Linear forward and backward under the recipe: the quantized weight the module keeps and
    the gradients flow; with quantized parameters, the weight's payloads are in those formats."""
    torch.manual_seed(0)
    lin = dtq.nn.Linear(64, 32, name="out")
    recipe = dtq.CustomRecipe(FACTORIES[name])
    dtq.convert(lin, recipe=recipe, quantized_params=True)
    w = lin.weight
    want = EXPECTED[name]["weight"]
    assert isinstance(w, dtq.QuantizedTensor) and w.quantizer.for_direction("rowwise") == want[0]
    assert w.quantizer.for_direction("columnwise") == want[1]
    x = torch.randn(32, 64, requires_grad=True)
    with dtq.autocast(recipe):
        y = lin(x)
    y.square().mean().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    ref = x.detach() @ w.dequantize(torch.float32, direction="rowwise").T
    # rowwise formats here: MXFP8 / NVFP4 / high precision, so the input's own quantization
    # error bounds the difference (NVFP4's ~1/8 relative per element is the widest)
    assert (y.detach() - ref - lin.bias.detach()).norm() < 0.25 * ref.norm()
