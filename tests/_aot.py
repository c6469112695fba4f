"""A torch.compile backend that keeps AOTAutograd's forward and backward graphs (in that order)
for a test to inspect, and runs them as they are."""

from __future__ import annotations


def capturing_backend() -> tuple[object, list]:
    """``(backend, graphs)``: pass ``backend`` to ``torch.compile``; ``graphs`` fills with each
    compiled ``fx.GraphModule``, forward first, then backward once it runs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep), graphs
