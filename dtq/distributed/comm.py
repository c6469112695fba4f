"""Bytes moved by dtq's gathers, per format and direction, and the warning for any fall-back to
high-precision communication. These counters are the one piece of process state dtq keeps besides
the autocast stack: they exist to make silent BF16 communication impossible."""

from __future__ import annotations

import collections
import warnings

_BYTES: collections.Counter = collections.Counter()
_WARNED: set[str] = set()


def record(format_name: str, direction: str, nbytes: int) -> None:
    _BYTES[f"{format_name}/{direction}"] += int(nbytes)


def add(counts) -> None:
    """Add ``(key, bytes)`` pairs, keys as :func:`comm_stats` names them."""
    for key, nbytes in counts:
        _BYTES[key] += nbytes


def record_fallback(dtype, nbytes: int, where: str, why: str) -> None:
    """Count a high-precision gather and warn once per reason (naming the first parameter)."""
    name = str(dtype).replace("torch.", "")
    _BYTES[f"{name}/fallback"] += int(nbytes)
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(
            f"dtq: {where} is gathered in high precision ({name}): {why}. dtq.parallel.comm_stats() "
            f"counts these bytes as '{name}/fallback' (warned once per reason, not per tensor)",
            stacklevel=3,
        )


def comm_stats(reset: bool = False) -> dict[str, int]:
    """``{"<format>/<direction>": bytes}`` all-gathered since the last reset (the size of the
    gathered output on this rank), format in fp8, fp8_row, fp8_block, mxfp8, nvfp4, identity; high-precision
    fall-backs as ``"<dtype>/fallback"``."""
    out = dict(_BYTES)
    if reset:
        _BYTES.clear()
    return out
