"""dtq's modules form a strictly downward stack (docs/architecture.md): no import cycle, counting
imports inside functions, and no import of a higher layer from a lower one. A new upward import
fails here with the file, the line and the two layers named."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "dtq"

# Lowest first. A module belongs to the longest prefix listed; modules of one layer may import
# each other (without a cycle).
LAYERS = [
    ("base", ["dtq._bits", "dtq._library", "dtq._torch_private", "dtq._warn", "dtq.kernels"]),
    ("codec", ["dtq.codec"]),
    ("distributed", ["dtq.distributed"]),
    ("tensor", ["dtq.tensor", "dtq.tensor_ops", "dtq.weights"]),
    ("formats", ["dtq.formats"]),
    ("recipe", ["dtq.recipe", "dtq.autocast", "dtq.gemm"]),
    ("nn", ["dtq.nn"]),
    ("parallel, checkpoint", ["dtq.parallel", "dtq.checkpoint"]),
    (
        "model tools",
        ["dtq.convert", "dtq.size_rule", "dtq.optim", "dtq.shapes", "dtq.presets", "dtq.recipes", "dtq.testing"],
    ),
    ("package", ["dtq"]),  # dtq/__init__.py: the public names, which the layers above use
    ("integrations, launch", ["dtq.integrations", "dtq.launch"]),
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def _imports(mods: dict[str, pathlib.Path]) -> list[tuple[str, str, int]]:
    """(importer, imported dtq module, line) for every import statement, at any depth; imports
    under ``if TYPE_CHECKING:`` only name types and are left out."""
    edges = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_lines(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and t.split(".")[0] == "dtq":
                    edges.append((name, t, node.lineno))
    return edges


def _layer(module: str) -> int:
    best, level = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    assert level is not None, f"{module} is in no layer of tests/package/test_layering.py: add it to LAYERS"
    return level


def test_no_import_cycle():
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for a, b, _ in _imports(mods):
        graph[a].add(b)
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles in dtq/ (function-level imports count): {cycles}"


def test_imports_point_down():
    mods = _modules()
    upward = [
        f"{mods[a].relative_to(ROOT.parent)}:{line} imports {b} ({LAYERS[_layer(b)][0]} layer) from the "
        f"{LAYERS[_layer(a)][0]} layer"
        for a, b, line in sorted(set(_imports(mods)))
        if _layer(b) > _layer(a)
    ]
    assert not upward, "imports that go up the stack:\n" + "\n".join(upward)


@pytest.mark.parametrize("module", sorted(_modules()))
def test_every_module_has_a_layer(module):
    _layer(module)
