"""Real text that is always there offline: the Python standard library's own source, as bytes.

Tokens are bytes (vocab 256). The corpus is every ``*.py`` file under
``sysconfig.get_paths()["stdlib"]`` (installed packages excluded), in sorted path order, so it is
the same on every rank and every machine with the same Python. The stream is cut into windows of
``seq_len + 1`` bytes; a ``val_fraction`` of it, in 4 KiB chunks spread over the corpus, is the
validation split.

The order is a pure function of (seed, sample index): sample ``i`` of the training stream is
window ``perm_e[i % n]`` with ``e = i // n`` and ``perm_e`` a permutation seeded by ``seed + e``.
A step on rank ``r`` of ``W`` reads samples ``[pos + r * B, pos + (r + 1) * B)`` where ``pos`` is
the number of samples consumed so far, so resuming only needs ``pos``.
"""

from __future__ import annotations

import os
import pathlib
import sysconfig

import torch

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> list[pathlib.Path]:
    """The standard library's ``*.py`` files in sorted order (installed packages excluded, and not
    even walked: site-packages can be many times the size of the standard library)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        files += [pathlib.Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(max_bytes: int) -> torch.Tensor:
    """At most ``max_bytes`` bytes of the corpus as a uint8 tensor."""
    chunks, total = [], 0
    for path in stdlib_files():
        try:
            data = path.read_bytes()
        except OSError:
            continue  # an unreadable file: the rest of the corpus is still deterministic on this machine
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"data: found no Python source under {sysconfig.get_paths()['stdlib']}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class ByteWindows:
    """Fixed-length windows over a byte stream, read in a seeded, resumable order."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.count = (tokens.numel() - 1) // seq_len
        if self.count < 1:
            raise ValueError(
                f"data: {tokens.numel()} bytes do not fill one window of {seq_len + 1}; raise "
                "data.max_bytes or lower model.seq_len"
            )
        self._perm_epoch, self._perm = -1, None

    def _window(self, i: int) -> int:
        epoch, j = divmod(i, self.count)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.count, generator=g), epoch
        return int(self._perm[j])

    def batch(self, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``[start, start + size)``: inputs and next-byte targets, int64 ``[size, seq_len]``."""
        rows = torch.stack(
            [
                self.tokens[w * self.seq_len : w * self.seq_len + self.seq_len + 1]
                for w in map(self._window, range(start, start + size))
            ]
        ).long()
        return rows[:, :-1], rows[:, 1:]


def to_device(batch: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """A CPU batch on ``device``, on a GPU without waiting for it: a plain ``.to("cuda")`` of
    pageable memory synchronizes the stream, so every step would wait for the previous one to
    finish and start with an empty launch queue. From pinned memory the copy is queued behind the
    previous step's kernels instead (made contiguous first: a strided copy would stage through
    pageable memory)."""
    if device.type != "cuda":
        return tuple(t.to(device) for t in batch)
    return tuple(t.contiguous().pin_memory().to(device, non_blocking=True) for t in batch)


def splits(
    max_bytes: int, val_fraction: float, seq_len: int, seed: int, chunk: int = 4096
) -> tuple[ByteWindows, ByteWindows]:
    """(train, validation) windows. Every ``1 / val_fraction``-th chunk of ``chunk`` bytes is held
    out, so validation text comes from the same files as training text, not from one corner of
    the library. Validation batches are a fixed function of the seed too (the same every eval),
    spread over all held-out chunks."""
    tokens = load_corpus(max_bytes)
    period = max(2, round(1 / val_fraction))
    pieces = tokens.split(chunk)
    val = [c for i, c in enumerate(pieces) if i % period == period - 1]
    if not val:
        raise ValueError(
            f"data: {tokens.numel()} bytes hold no validation chunk (every {period}th chunk of "
            f"{chunk} bytes); raise data.max_bytes or data.val_fraction"
        )
    train = torch.cat([c for i, c in enumerate(pieces) if i % period != period - 1])
    return ByteWindows(train, seq_len, seed), ByteWindows(torch.cat(val), seq_len, seed)
