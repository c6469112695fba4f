"""Fixtures shared by the test folders. Shared helper modules are ``tests._quantizers`` (a
quantizer of every format and option, bitwise comparisons) and ``tests._recipe_matrix`` (the
recipes every matrix test runs); pyproject.toml's [tool.pytest.ini_options] says why tests import
them as ``tests.*`` and what that means for ``dtq.testing.spawn``."""

from __future__ import annotations

import pytest
import torch

# CPU everywhere; CUDA where there is a GPU, where the kernels' paths run instead of the references.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Each available device in turn: a test that takes ``device`` runs once per device."""
    return request.param


@pytest.fixture
def fresh_dynamo():
    """A reset torch._dynamo before and after the test: no compiled graph, guard or recompile count
    carries over from another test (use with ``pytest.mark.usefixtures("fresh_dynamo")``)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
