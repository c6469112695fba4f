"""Every ```python block in README.md and docs/*.md runs as written (each file's blocks in order,
sharing one namespace), so examples cannot rot."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("path", [p for p in DOCS if _blocks(p)], ids=lambda p: p.name)
def test_doc_examples_run(path):
    namespace: dict = {"__name__": f"doc_{path.stem}"}
    for i, code in enumerate(_blocks(path)):
        exec(compile(code, f"{path.name}[block {i}]", "exec"), namespace)
