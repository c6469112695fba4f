"""docs/troubleshooting.md documents every error and warning message a user can meet from dtq.

The test reads dtq/**/*.py (the example trainer, dtq/launch, aside) with ``ast`` and collects the
message of every

* exception built with a message (``raise ValueError(f"...")``, ``return ValueError(...)``, ...),
* warning (``warnings.warn(...)``, ``warn_once(key, message)``),
* high-precision fall-back reason (``record_fallback(..., why)``, ``gather_rows(..., reason=...)``),
* piece of a composed message (``shape_error(..., requirement)``, ``errors.append(...)`` in the
  checkpoint checks, whose lines end up in one RuntimeError).

Each message becomes a pattern: its literal text, with every interpolated value (``{...}`` in an
f-string, a ``+``-joined expression) standing for any short text. The start of that pattern (about
60 literal characters) must match docs/troubleshooting.md, whitespace-insensitively. So a new
user-facing error fails this test until its message is documented, and rewording a message fails
it until the docs follow.

Skipped: ``AssertionError`` (internal invariants), ``NotImplementedError`` / ``AttributeError``
without a dtq message (abstract bases, attribute protocol), messages with fewer than
``MIN_LITERAL`` literal characters (nothing recognisable to search for), and the few internal
messages listed in ``INTERNAL`` (each with the reason a user cannot reach it).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "troubleshooting.md"
# The example trainer ships inside the package but is not the library: its messages (config
# mistakes, launchers) are documented in docs/training.md, "Errors you may meet".
TRAINER = ROOT / "dtq" / "launch"

MIN_LITERAL = 15  # literal characters a message needs to be checked
PREFIX_LITERAL = 60  # literal characters of a message's start that the docs must contain
GAP = r".{0,120}?"  # what an interpolated value may look like in the docs

EXCEPTIONS = {
    "ValueError",
    "TypeError",
    "RuntimeError",
    "KeyError",
    "ImportError",
    "TimeoutError",
    "IndexError",
    "OSError",
    "FileNotFoundError",
    "LookupError",
    "NotImplementedError",
}
# call name -> (positional index, keyword) of the message argument
SINKS = {
    "warn": (0, "message"),
    "warn_once": (1, "message"),
    "record_fallback": (3, "why"),
    "shape_error": (3, "requirement"),
    "gather_rows": (None, "reason"),
}
APPEND_TARGETS = {"errors"}  # ``errors.append(msg)``: lines of check_state_dict's RuntimeError

# Messages no user call can reach (internal contracts between dtq's own modules).
INTERNAL = {
    "the fused kernel writes at most two directions",  # dtq.kernels.QuantizeLaunch: Quantizer passes <= 2 specs
    "stochastic rounding needs a seed tensor",  # dtq.kernels.QuantizeLaunch: quantize_payloads always draws one
    "one amax pass computes one Hadamard sign pattern",  # QuantizeLaunch: only columnwise NVFP4 is rotated
}


def _parts(node: ast.AST) -> list[str | None]:
    """Literal pieces of a message expression; None for each interpolated value."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        out: list[str | None] = []
        for v in node.values:
            out += [v.value] if isinstance(v, ast.Constant) else [None]
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _parts(node.left) + _parts(node.right)
    return [None]


def _message_arg(call: ast.Call) -> ast.AST | None:
    fn = call.func
    name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
    if name in EXCEPTIONS:
        return call.args[0] if call.args else None
    if (
        name == "append"
        and isinstance(fn, ast.Attribute)
        and isinstance(fn.value, ast.Name)
        and fn.value.id in APPEND_TARGETS
        and call.args
    ):
        return call.args[0]
    if name in SINKS:
        pos, kw = SINKS[name]
        if pos is not None and len(call.args) > pos:
            return call.args[pos]
        return next((k.value for k in call.keywords if k.arg == kw), None)
    return None


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def messages_in(source: str, filename: str = "<source>") -> list[tuple[str, str, str]]:
    """``(location, readable message, regex of its start)`` for every checked message in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        arg = _message_arg(node)
        if arg is None:
            continue
        parts = _parts(arg)
        literal = "".join(p for p in parts if p)
        if len(literal.strip()) < MIN_LITERAL or _norm(literal).strip() in INTERNAL:
            continue
        pattern, budget = [], PREFIX_LITERAL
        for p in parts:
            if budget <= 0:
                break
            if p is None:
                if pattern and pattern[-1] != GAP:
                    pattern.append(GAP)
                continue
            text = _norm(p)
            if not pattern:
                text = text.lstrip()
            text = text[:budget]
            if text:
                pattern.append(re.escape(text))
                budget -= len(text)
        while pattern and pattern[-1] == GAP:
            pattern.pop()
        if pattern:  # a message's start may end a sentence of the docs: no trailing blank needed
            pattern[-1] = pattern[-1].rstrip("\\ ")
        readable = "".join("{...}" if p is None else p for p in parts)
        out.append((f"{filename}:{node.lineno}", readable, "".join(pattern)))
    return out


def all_messages() -> list[tuple[str, str, str]]:
    out = []
    for path in sorted((ROOT / "dtq").rglob("*.py")):
        if path.is_relative_to(TRAINER):
            continue
        out += messages_in(path.read_text(), str(path.relative_to(ROOT)))
    return out


def _doc_text() -> str:
    return _norm(DOC.read_text())


def test_scanner_finds_the_messages():
    found = all_messages()
    assert len(found) > 60, f"only {len(found)} messages found: the scanner is broken"
    texts = " ".join(m for _, m, _ in found)
    for known in ("cannot all-gather", "is gathered in high precision", "must be a multiple of the MX block size"):
        assert known in texts


def test_every_message_is_documented():
    doc = _doc_text()
    missing = [f"{where}: {message}" for where, message, pattern in all_messages() if not re.search(pattern, doc)]
    assert not missing, (
        "docs/troubleshooting.md does not document these messages (quote the start of each, "
        "with what causes it and what to do):\n  " + "\n  ".join(missing)
    )


def test_an_undocumented_message_fails():
    src = (
        "def f(x):\n"
        '    raise ValueError(f"frobnicate: the widget {x} has no sprocket; attach one first")\n'
        '    raise AssertionError("an internal invariant that users never see")\n'
        "    raise NotImplementedError\n"
    )
    found = messages_in(src)
    assert len(found) == 1
    assert not re.search(found[0][2], _doc_text())
    assert re.search(found[0][2], "frobnicate: the widget 3 has no sprocket; attach one first")


@pytest.mark.parametrize("message", sorted(INTERNAL))
def test_internal_messages_still_exist(message):
    # An INTERNAL entry whose message left the code must leave the list too.
    code = " ".join(_norm(p.read_text()) for p in (ROOT / "dtq").rglob("*.py"))
    assert message in code
