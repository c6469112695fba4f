"""Compiled graphs of quantized-parameter models reused by another process. Inductor keeps its FX
graph and AOTAutograd caches on disk (``TORCHINDUCTOR_CACHE_DIR``), so a second run of the same
training script loads the first run's graphs without tracing them. Such a graph names a quantized
weight's layout by a constant key; the second process must read that key as the same layout,
though it never traced the graph. (The key used to be a number handed out in the order layouts
were traced: the second run failed with a ``KeyError``.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# One process: a quantized-parameter MLP compiled with inductor, forward + backward under the
# recipe (dtq::linear and dtq::linear_backward) and with the recipe off (dtq::dequantize_weight);
# prints the cache counters and every result's bits.
SCRIPT = textwrap.dedent(
    """
    import hashlib, json, torch, dtq
    from torch._dynamo.utils import counters

    def bits(t):
        return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

    torch.manual_seed(0)
    r = dtq.Float8CurrentScaling()
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    model = torch.compile(dtq.convert(mlp, recipe=r, quantized_params=True), fullgraph=True)
    out = []
    for enabled in (True, False):
        x = torch.randn(32, 64, requires_grad=True)
        with dtq.autocast(r, enabled=enabled):
            y = model(x)
        y.square().sum().backward()
        out += [bits(y), bits(x.grad)] + [bits(p.grad) for p in mlp.parameters() if p.grad is not None]
        mlp.zero_grad(set_to_none=True)
    print(json.dumps({"bits": out, "aot": dict(counters["aot_autograd"])}))
    """
)


def _run(cache: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[Path, dict]:
    """A cache directory one process has filled, and what that process printed (both tests start
    from it: a process compiling the script costs about 13 s on two cores)."""
    cache = tmp_path_factory.mktemp("inductor_cache")
    return cache, _run(cache)


def test_a_second_process_runs_the_cached_graphs_of_quantized_weights(first_run):
    cache, first = first_run
    second = _run(cache)
    saved = first["aot"].get("autograd_cache_saved", 0)
    assert saved >= 1 and not first["aot"].get("autograd_cache_hit"), first
    # the second process traced nothing below dynamo: every graph came from the first one's cache
    assert second["aot"].get("autograd_cache_hit", 0) == saved and not second["aot"].get("autograd_cache_miss"), second
    assert second["bits"] == first["bits"]


def test_another_dtq_does_not_reuse_the_cached_graphs(first_run, tmp_path):
    """The caches key a graph by what dynamo traced, which calls ``dtq::linear`` whatever dtq's
    version; the graphs below it (its backward's ops, their schemas) are what that version traced.
    A process running other dtq sources (here: one changed line) compiles its own instead of
    calling ops with a schema that may have changed (it used to fail: 'missing value for argument')."""
    import shutil

    cache = first_run[0]
    other = tmp_path / "other"
    shutil.copytree(ROOT / "dtq", other / "dtq", ignore=shutil.ignore_patterns("__pycache__"))
    with open(other / "dtq" / "nn" / "_ops.py", "a") as f:
        f.write("\n# another version\n")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": str(other)}
    # (cwd: `python -c` puts the working directory ahead of PYTHONPATH)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not got["aot"].get("autograd_cache_hit") and got["aot"].get("autograd_cache_miss", 0) >= 1, got
