"""The trainer's console output on rank 0: its log lines, and a tqdm progress bar over the steps
when stderr is an interactive terminal.

The bar is for people watching a terminal: it is never drawn into a log file, a pipe or CI
(stderr not a TTY), nor when tqdm is not installed (``pip install 'dtq[train]'``) or
``train.progress_bar = false``. The log lines are printed the same way with or without it
(``tqdm.write`` lifts the bar out of the way), so logs never depend on where they were written.
"""

from __future__ import annotations

import sys
from typing import TextIO


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class Console:
    """Rank 0's output. ``enabled``: this rank prints at all; ``bar``: draw a progress bar over
    ``total`` steps starting at ``initial`` if ``stream`` (default stderr) is a terminal."""

    def __init__(self, enabled: bool, total: int, initial: int = 0, bar: bool = True, stream: TextIO | None = None):
        self.enabled = enabled
        self._bar = None
        stream = sys.stderr if stream is None else stream
        tqdm = _tqdm() if enabled and bar and stream.isatty() else None
        if tqdm is not None and initial < total:
            self._bar = tqdm(total=total, initial=initial, file=stream, unit="step", dynamic_ncols=True, leave=False)

    @property
    def has_bar(self) -> bool:
        return self._bar is not None

    def print(self, line: str) -> None:
        """One log line on stdout (above the bar when there is one)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def step(self, loss: float | None = None) -> None:
        """One optimizer step done; ``loss``: the latest logged loss, shown beside the bar (the
        bar itself never synchronizes with the device)."""
        if self._bar is not None:
            if loss is not None:
                self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
