"""A regular (non-editable) install carries the CUDA sources: the wheel holds csrc/ as dtq/_csrc,
and dtq.kernels finds them there when no checkout is beside the package."""

import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_ships_the_kernel_sources_and_kernels_find_them(tmp_path):
    pytest.importorskip("setuptools", reason="building the wheel without isolation needs setuptools")
    from dtq import kernels

    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, cwd=tmp_path, capture_output=True)
    (wheel,) = tmp_path.glob("dtq-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path / "site")
        shipped = {pathlib.PurePosixPath(n).name for n in z.namelist() if n.startswith("dtq/_csrc/")}
    expected = {p.name for p in (ROOT / "csrc").iterdir() if p.suffix in (".cu", ".cuh", ".cpp")}
    assert set(kernels.SOURCES) <= expected and shipped == expected, sorted(shipped ^ expected)
    for name in expected:  # byte-identical copies
        assert (tmp_path / "site" / "dtq" / "_csrc" / name).read_bytes() == (ROOT / "csrc" / name).read_bytes()

    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}  # the installed layout, no checkout beside it
    out = subprocess.run([sys.executable, "-c", "import dtq.kernels as k; print(k.CSRC)"], check=True, env=env,
                         cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert pathlib.Path(out) == tmp_path / "site" / "dtq" / "_csrc"
