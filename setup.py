"""Ships the CUDA sources in csrc/ inside the package (as ``dtq/_csrc``) so that a regular,
non-editable install can still build the kernels on first GPU use. Everything else about the
package is declared in pyproject.toml."""

import pathlib
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent


class BuildPyWithCsrc(build_py):
    def run(self):
        super().run()
        target = pathlib.Path(self.build_lib) / "dtq" / "_csrc"
        shutil.copytree(ROOT / "csrc", target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.md"))


setup(cmdclass={"build_py": BuildPyWithCsrc})
