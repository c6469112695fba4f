"""The CUDA sources compile, on machines without a GPU: the kernels are built on first GPU use, and
a source that no longer compiles would make every GPU run fall back to the references (with one
warning), so CI checks it wherever ``nvcc`` exists: host code to the end of the host compiler's
semantic checks (``-fsyntax-only``: no object code), device code to the end of nvcc's front end
(``--fdevice-syntax-only``: types, templates and overloads are checked, no PTX is generated),
with the flags of the real build (``dtq.kernels.CUDA_FLAGS`` / ``CXX_FLAGS`` and torch's extension flags). The
bits are the GPU tests' business (tests/kernels/test_kernels.py)."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.utils.cpp_extension as cpp

from dtq import kernels

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(
    NVCC is None or torch.version.cuda is not None,
    reason="needs nvcc and a CPU build of torch (with CUDA torch the GPU tests build the kernels for real)",
)


def test_the_build_leaves_the_cxx_standard_to_torch():
    """dtq's build flags name no C++ standard: torch's extension builder adds the one its headers
    need. A -std=c++17 of dtq's own kept the kernels from building under torch 2.15, whose headers
    need C++20 (every GPU run there would have fallen back to the references)."""
    assert not [f for f in (*kernels.CUDA_FLAGS, *kernels.CXX_FLAGS) if f.startswith("-std")]


def _includes(tmp_path) -> list[str]:
    # A CPU build of torch ships c10/cuda's headers but not this generated one.
    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return [f"-I{tmp_path}", *(f"-I{p}" for p in cpp.include_paths()), f"-I{sysconfig.get_paths()['include']}"]


def _compile(cmd: list[str]) -> tuple[str, int, str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    errors = "\n".join(line for line in proc.stderr.splitlines() if "error" in line)
    return cmd[-1], proc.returncode, errors or proc.stderr[-2000:]


# quantize_fast_<dtype>.cu differ only in the input type they instantiate quantize_tile.cuh's
# kernels for: the BF16 one is compiled here (the heaviest sources of the set; CI time), the GPU
# build compiles all three.
_SAME_AS_BF16 = {"quantize_fast_f16.cu", "quantize_fast_f32.cu"}
# The standard torch's extension builder compiles with from torch 2.13 on (the real build passes no
# -std of its own and takes torch's; torch 2.15's headers need C++20).
_STD = "-std=c++20"


@needs_nvcc
def test_every_source_compiles(tmp_path):
    inc = _includes(tmp_path)
    jobs = []
    assert _SAME_AS_BF16 < set(kernels.SOURCES) and "quantize_fast_bf16.cu" in kernels.SOURCES
    for src in (s for s in kernels.SOURCES if s not in _SAME_AS_BF16):
        path = str(kernels.CSRC / src)
        out = str(tmp_path / (src + ".o"))
        if src.endswith(".cu"):
            jobs.append(
                [
                    NVCC,
                    "-c",
                    "-o",
                    out,
                    *inc,
                    *cpp.COMMON_NVCC_FLAGS,
                    *kernels.CUDA_FLAGS,
                    _STD,
                    "--fdevice-syntax-only",
                    "-Xcompiler",
                    "-fsyntax-only",
                    "-w",
                    path,
                ]
            )
        else:
            cxx = shutil.which("c++") or shutil.which("g++")
            if cxx is None:  # the bindings need a host compiler; the .cu files are the point here
                continue
            jobs.append([cxx, "-fsyntax-only", *inc, _STD, "-w", "-DTORCH_EXTENSION_NAME=dtq_kernels", path])
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_compile, jobs))
    failed = [(src, errors) for src, rc, errors in results if rc != 0]
    assert not failed, "\n\n".join(f"{src}:\n{errors}" for src, errors in failed)
