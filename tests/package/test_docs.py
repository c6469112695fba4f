"""Every ```python block in README.md and docs/*.md runs as written (each file's blocks in order,
sharing one namespace), so examples cannot rot; the distributed examples also run under torchrun.
The docs stand alone: they never point outside the repository."""

import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("path", [p for p in DOCS if _blocks(p)], ids=lambda p: p.name)
def test_doc_examples_run(path):
    namespace: dict = {"__name__": f"doc_{path.stem}"}
    for i, code in enumerate(_blocks(path)):
        exec(compile(code, f"{path.name}[block {i}]", "exec"), namespace)


def _snippet(path: pathlib.Path, marker: str) -> str:
    (code,) = [b for b in _blocks(path) if marker in b]
    return code


@pytest.mark.parametrize("marker", ["fully_shard(model)", "LayerNormMLPParallel("], ids=["fsdp2", "tp"])
def test_distributed_snippets_join_the_torchrun_job(tmp_path, marker):
    """Started by torchrun, the docs' FSDP2 and TP examples join its process group: both ranks see
    world size 2 (a guard of their own that made a one-rank group on every process went unnoticed)."""
    script = tmp_path / "snippet.py"
    script.write_text(_snippet(ROOT / "docs" / "distributed.md", marker))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "world size 2, rank 0" in out and "world size 2, rank 1" in out, out[-4000:]


def test_a_one_rank_group_under_a_launchers_world_size_warns(monkeypatch):
    """dtq warns (once) when the default process group has one rank while the launcher's WORLD_SIZE
    says the job has two: every process would train alone, unsharded."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import dtq
    from dtq import _warn
    from dtq.distributed import world

    monkeypatch.setattr(world, "_checked", False)
    monkeypatch.setattr(_warn, "_warned", set())
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    try:
        model = fully_shard(torch.nn.Sequential(dtq.nn.Linear(64, 64, name="a")))
        with pytest.warns(UserWarning, match=r"1 rank, but WORLD_SIZE=2 .*init_process_group\(\)"):
            dtq.parallel.precompute_amax(model, dtq.Float8CurrentScaling())
    finally:
        dist.destroy_process_group()


# A package index is an install instruction, not a document outside the repository.
_ALLOWED_URLS = ("https://download.pytorch.org/whl/",)


def test_docs_never_point_outside_the_repository():
    """README, docs/ and docstrings link only to files of this repository (which exist), never to
    ../shared or another project's pages."""
    problems = []
    for path in DOCS:
        text = path.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)", text):  # markdown links
            local = (path.parent / target).resolve()
            if "://" in target or not local.is_relative_to(ROOT) or not local.exists():
                problems.append(f"{path.relative_to(ROOT)}: link {target}")
        problems += [
            f"{path.relative_to(ROOT)}: {url}"
            for url in re.findall(r"https?://[^\s)`>]+", text)
            if not url.startswith(_ALLOWED_URLS)
        ]
    for path in [*DOCS, *ROOT.glob("dtq/**/*.py"), *ROOT.glob("launch/**/*.py"), *ROOT.glob("tests/**/*.py")]:
        if path.name != "test_docs.py":
            text = path.read_text()
            problems += [f"{path.relative_to(ROOT)}: {bad}" for bad in ("../shared", "DESIGN.md") if bad in text]
    assert not problems, "\n".join(problems)
