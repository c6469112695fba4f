"""What a regular (non-editable) install gets, and its first use: the wheel carries the CUDA
sources (csrc/ as dtq/_csrc, found there when no checkout is beside the package), type information
and the trainer with its console script; building the kernels says so."""

import configparser
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory) -> tuple[pathlib.Path, set[str]]:
    """The wheel built from this checkout, unpacked: (its directory, the names it holds)."""
    pytest.importorskip("setuptools", reason="building the wheel without isolation needs setuptools")
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp)],
        check=True,
        cwd=tmp,
        capture_output=True,
    )
    (wheel,) = tmp.glob("dtq-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp / "site")
        return tmp / "site", set(z.namelist())


def test_wheel_ships_the_kernel_sources_and_kernels_find_them(wheel_site):
    from dtq import kernels

    site, names = wheel_site
    tmp_path = site.parent
    shipped = {pathlib.PurePosixPath(n).name for n in names if n.startswith("dtq/_csrc/")}
    expected = {p.name for p in (ROOT / "csrc").iterdir() if p.suffix in (".cu", ".cuh", ".cpp", ".h")}
    assert set(kernels.SOURCES) <= expected and shipped == expected, sorted(shipped ^ expected)
    for name in expected:  # byte-identical copies
        assert (tmp_path / "site" / "dtq" / "_csrc" / name).read_bytes() == (ROOT / "csrc" / name).read_bytes()

    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}  # the installed layout, no checkout beside it
    out = subprocess.run(
        [sys.executable, "-c", "import dtq.kernels as k; print(k.CSRC)"],
        check=True,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert pathlib.Path(out) == tmp_path / "site" / "dtq" / "_csrc"


def test_wheel_ships_types_and_the_trainer_with_its_command(wheel_site):
    """The wheel is typed (PEP 561 ``py.typed``), declares the ``dtq-train`` console script and
    carries the trainer, which runs from the installed layout alone (no checkout beside it)."""
    site, names = wheel_site
    assert "dtq/py.typed" in names
    assert {"dtq/launch/train.py", "dtq/launch/config.py", "dtq/launch/progress.py"} <= names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = configparser.ConfigParser()
    scripts.read(site / entry_points)
    assert dict(scripts["console_scripts"]) == {"dtq-train": "dtq.launch.train:cli"}
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", "import dtq.launch.train as t; print(t.__file__); t.cli()", "--help"],
        check=True,
        env=env,
        cwd=site.parent,
        capture_output=True,
        text=True,
    ).stdout
    path, usage = out.split("\n", 1)
    assert pathlib.Path(path) == site / "dtq" / "launch" / "train.py"
    assert usage.startswith("usage:") and "--config" in usage and "--resume" in usage


def test_python_m_dtq_kernels_runs_without_a_runpy_warning():
    """``python -m dtq.kernels`` runs ``dtq/kernels/__main__.py``; as a plain module imported by
    ``import dtq`` it made runpy warn before every run."""
    proc = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "dtq.kernels", "info"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "RuntimeWarning" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith("build dir: ")


def test_the_first_kernel_build_says_so_on_stderr(tmp_path, monkeypatch, capsys):
    """The first GPU use compiles the kernels for about a minute: dtq says where and how to do it
    ahead of time before, and how long it took after; a process finding them built says nothing."""
    from dtq import kernels

    built = object()

    def compile_(verbose=False):  # what torch's loader leaves in the build directory
        (tmp_path / "dtq_kernels.so").write_bytes(b"")
        return built

    monkeypatch.setenv("DTQ_KERNEL_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_load", compile_)
    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setattr(kernels, "_error", None)
    assert kernels.extension() is built
    before, after = capsys.readouterr().err.splitlines()
    assert str(tmp_path) in before and "python -m dtq.kernels build" in before
    assert after.startswith("dtq: CUDA kernels built in ")
    monkeypatch.setattr(kernels, "_ext", None)  # another process: the library is there
    assert kernels.extension() is built and capsys.readouterr().err == ""


def test_importing_dtq_leaves_dynamo_unimported():
    """``import dtq`` does not import ``torch._dynamo`` (about 1 s of every process: each spawned
    test rank, each torchrun worker): dtq marks its constant functions itself
    (``dtq._torch_private.assume_constant_result``); compiling imports dynamo when it is needed."""
    code = "import sys, dtq; print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout
