"""One-time warnings: dtq says a thing once per process, not once per GEMM or per rank's step."""

from __future__ import annotations

import warnings

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Warn with ``message`` the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)
