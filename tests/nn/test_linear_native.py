"""What dtq/nn/linear_native.py registers with the kernel library for a planned call, checked on
any machine: the plan is made for a CUDA device as an sm_90 GPU with the library makes it (the
library's availability and the GPU's capability are answered, its registration recorded), and
the description is read back as csrc/linear.cpp's ``Reader`` reads it. The C++ function saves
x's and the weight's ``[K, M]`` codes and scales in the order ``LinearPlan.forward`` saves them,
reads the payload fields at the positions the description names, and runs dgrad / wgrad exactly
where the plan needs them; plans it cannot run get no id. The bits of the C++ function against
the Python plan: tests/kernels/test_native_linear.py (GPU)."""

import dataclasses

import pytest
import torch

import dtq
from dtq import kernels
from dtq.nn import linear_native
from dtq.nn.linear_plan import LinearPlan
from dtq.presets import recipe_from_name
from dtq.weights import HighPrecisionWeight


@pytest.fixture(autouse=True)
def _forget_plans():
    """The quantize plans and GEMM paths decided here for a CUDA device under answered
    availability and capability are not kept for later tests (a GPU machine's own may differ)."""
    from dtq import codec, gemm

    yield
    codec._plans.clear()
    gemm._chosen.clear()


_HEAD = ("mode_a", "given_a", "mode_b", "given_b", "signs", "data", "scale", "data_t", "scale_t")
_LISTS = ("cfg_a", "fields_a", "cfg_b", "fields_b")


def _read(ints: list[int]) -> tuple[bool, list]:
    """(fprop's fast accumulation, [x, weight, dy] launches), as csrc/linear.cpp reads them."""
    it = iter(ints)
    fast = bool(next(it))

    def launch():
        if next(it) == 0:
            return None
        out = {k: next(it) for k in _HEAD}
        for k in _LISTS:
            out[k] = [next(it) for _ in range(next(it))]
        return out

    launches = [launch(), launch(), launch()]
    assert next(it, None) is None, "trailing ints"
    return fast, launches


def _plan(
    monkeypatch, recipe, need_dgrad: bool, need_wgrad: bool, *, x_shape=(64, 64), w_dtype=torch.bfloat16, calls=None
):
    """A plan made for a CUDA device, and the descriptions it registered (``calls``: receives
    ``(launch, amax)`` of each ``native_quantize`` call)."""
    registered = []

    class Library:  # the kernel library's registration, recorded
        def register_linear(self, ints):
            registered.append(list(ints))
            return len(registered) - 1

        def native_quantize(self, t, known, id, which):  # output j of the launch: the value j
            assert 0 <= id < len(registered)
            calls.append((which, known))
            return [torch.tensor(float(j)) for j in range(8)]

    monkeypatch.setattr(kernels, "available", lambda device=None: True)
    monkeypatch.setattr(kernels, "capability", lambda device: (9, 0))
    monkeypatch.setattr(kernels, "extension", lambda verbose=False: Library())
    monkeypatch.setattr(linear_native, "_OUTPUTS", {})  # (the stub's ids are not the library's)
    layer = dtq.nn.Linear(64, 128, bias=False, params_dtype=torch.bfloat16)
    call = layer._slots(recipe, 0).call(need_dgrad, need_wgrad)
    weight = torch.empty(128, 64, dtype=w_dtype, device="meta")
    plan = LinearPlan(call, torch.Size(x_shape), torch.bfloat16, torch.device("cuda"), weight)
    return plan, registered


def _outputs(qp) -> list[str]:
    """The names of a quantize launch's output tensors, in quantize_alloc's order."""
    return [*qp.launch.names[0], *(qp.launch.names[1] if len(qp.launch.names) > 1 else ())]


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("x_shape", [(64, 64), (4, 16, 64)])
def test_a_plan_with_both_gradients_is_described_as_its_python_forward_runs_it(fast, x_shape, monkeypatch):
    recipe = dataclasses.replace(dtq.Float8CurrentScaling(), fprop_fast_accumulation=fast)
    plan, registered = _plan(monkeypatch, recipe, True, True, x_shape=x_shape)
    assert linear_native.native_of(plan) == 0 and len(registered) == 1
    got_fast, (x, w, g) = _read(registered[0])
    assert got_fast == fast == plan.fprop_fast_accum()
    for launch, qp in ((x, plan.qx), (w, plan.qw), (g, plan.qg)):
        names = _outputs(qp)
        assert (names[launch["data"]], names[launch["scale"]]) == ("data", "scale_inv")
        assert names[launch["data_t"]] == "data_t" and launch["scale_t"] == launch["scale"]  # one scale, both layouts
        assert qp.transposed
        assert (launch["cfg_a"], launch["fields_a"], launch["cfg_b"], launch["fields_b"]) == (
            qp.launch.cfgs[0],
            qp.launch.fields[0],
            qp.launch.cfgs[1],
            qp.launch.fields[1],
        )
        assert (launch["mode_a"], launch["mode_b"], launch["signs"]) == (*qp.launch.modes, qp.launch.signs)
    # the C++ function saves x's codes and scale, then the weight's: LinearPlan.forward's order
    assert plan.x_fields == plan.w_fields == ("data_t", "scale_inv")
    # a producer's max|x| (max|dy|: the compiled quantize_grad's; max|w|: the weight's one-rank
    # gather's) stands for both slots of its launch (rowwise and [K, M] codes)
    assert plan.x_known == plan.w_known == plan.g_known == ("rowwise",)
    assert (x["given_a"], x["given_b"], w["given_a"], w["given_b"], g["given_a"], g["given_b"]) == (1, 1, 1, 1, 1, 1)


@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, False)])
def test_the_compiled_quantize_ops_return_the_launch_outputs_in_their_layouts(grads, monkeypatch):
    """The compiled path's quantize ops (``quantize_input``, ``planned_weight``, ``quantize_grad``)
    through the library: each launch's outputs listed as the plan's Python lists the distinct
    payload tensors (``x_layout``, ``w_layout``, ``g_layout``): rowwise codes, their scale (shared
    with the [K, M] codes), [K, M] codes where a backward GEMM reads them; a producer's amax passed
    on where the launch reads one (x, dy, and the weight: its gather's max|w|)."""
    calls = []
    plan, registered = _plan(monkeypatch, dtq.Float8CurrentScaling(), *grads, calls=calls)
    amax = torch.tensor(3.0)
    cases = [(linear_native.INPUT, plan.qx, plan.x_layout, plan.x_known)]
    cases.append((linear_native.WEIGHT, plan.qw, plan.w_layout, plan.w_known))
    if plan.qg is not None:
        cases.append((linear_native.GRAD, plan.qg, plan.g_layout, plan.g_known))
    for which, qp, layout, known in cases:
        got = linear_native.payloads(plan, which, torch.empty(64, 64, dtype=torch.bfloat16), amax)
        first = {}
        for _, field, i in layout:
            first.setdefault(i, field)
        names = _outputs(qp)
        assert [names[int(t)] for t in got] == [first[i] for i in range(len(first))]
        expect = {linear_native.INPUT: grads[1], linear_native.WEIGHT: grads[0], linear_native.GRAD: grads[1]}[which]
        assert [names[int(t)] for t in got] == ["data", "scale_inv", "data_t"][: 3 if expect else 2]
        assert calls[-1] == (which, amax if known else None)
    # a parameter takes the launch (a compiled graph is handed a module's weight and FSDP2's
    # unsharded parameter as they are: nn.Parameter); a tensor of another kind, or an amax the
    # launch does not read as it is, keeps the Python path (which checks it and says what is wrong)
    weight = torch.nn.Parameter(torch.empty(128, 64, dtype=torch.bfloat16))
    got = linear_native.payloads(plan, linear_native.WEIGHT, weight, amax)
    assert got is not None and calls[-1] == (linear_native.WEIGHT, amax)
    assert linear_native.payloads(plan, linear_native.WEIGHT, HighPrecisionWeight(weight.detach())) is None
    x = torch.empty(64, 64, dtype=torch.bfloat16)
    assert linear_native.payloads(plan, linear_native.INPUT, x, torch.tensor([3.0])) is None
    assert linear_native.payloads(plan, linear_native.INPUT, x, amax.double()) is None
    assert len(registered) == 1


def test_dgrad_only_and_no_gradient_describe_only_the_codes_they_read(monkeypatch):
    plan, registered = _plan(monkeypatch, dtq.Float8CurrentScaling(), True, False)
    linear_native.native_of(plan)
    _, (x, w, g) = _read(registered[0])
    assert x["data_t"] == -1 and g["data_t"] == -1  # no wgrad: no [K, M] codes of x or dy
    assert w["data_t"] >= 0 and g["data"] >= 0  # dgrad: dy's rows and the weight's [K, M] codes
    assert plan.x_fields == () and plan.w_fields == ("data_t", "scale_inv")
    plan, registered = _plan(monkeypatch, dtq.Float8CurrentScaling(), False, False)
    linear_native.native_of(plan)
    _, (x, w, g) = _read(registered[0])
    assert g is None and x["data_t"] == w["data_t"] == -1


@pytest.mark.parametrize("name", ["mxfp8", "fp8-block", "fp8-row", "hybrid", "nvfp4"])
def test_plans_of_other_formats_keep_the_python_path(name, monkeypatch):
    plan, registered = _plan(monkeypatch, recipe_from_name(name), True, True)
    assert linear_native.native_of(plan) is None and not registered


def test_wgrad_alone_keeps_the_python_path(monkeypatch):
    # dy's columnwise codes alone come [M, N] from their launch: wgrad would transpose them
    plan, registered = _plan(monkeypatch, dtq.Float8CurrentScaling(), False, True)
    assert linear_native.native_of(plan) is None and not registered


def test_plans_made_while_it_is_off_keep_the_python_path(monkeypatch):
    monkeypatch.setattr(linear_native, "enabled", False)
    plan, registered = _plan(monkeypatch, dtq.Float8CurrentScaling(), True, True)
    assert linear_native.native_of(plan) is None and not registered
