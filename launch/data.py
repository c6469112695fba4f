"""Real text that is always there offline: the Python standard library's own source, as bytes.

Tokens are bytes (vocab 256). The corpus is every ``*.py`` file under
``sysconfig.get_paths()["stdlib"]`` (installed packages excluded), in sorted path order, so it is
the same on every rank and every machine with the same Python. The stream is cut into windows of
``seq_len + 1`` bytes; the last ``val_fraction`` of the bytes is the validation split.

The order is a pure function of (seed, sample index): sample ``i`` of the training stream is
window ``perm_e[i % n]`` with ``e = i // n`` and ``perm_e`` a permutation seeded by ``seed + e``.
A step on rank ``r`` of ``W`` reads samples ``[pos + r * B, pos + (r + 1) * B)`` where ``pos`` is
the number of samples consumed so far, so resuming only needs ``pos``.
"""

from __future__ import annotations

import pathlib
import sysconfig

import torch

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> list[pathlib.Path]:
    """The standard library's ``*.py`` files in sorted order (installed packages excluded)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS & set(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(max_bytes: int) -> torch.Tensor:
    """At most ``max_bytes`` bytes of the corpus as a uint8 tensor."""
    chunks, total = [], 0
    for path in stdlib_files():
        try:
            data = path.read_bytes()
        except OSError:
            continue  # an unreadable file: the rest of the corpus is still deterministic on this machine
        chunks.append(data[:max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"data: found no Python source under {sysconfig.get_paths()['stdlib']}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class ByteWindows:
    """Fixed-length windows over a byte stream, read in a seeded, resumable order."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int, shuffle: bool = True):
        self.tokens, self.seq_len, self.seed, self.shuffle = tokens, seq_len, seed, shuffle
        self.count = (tokens.numel() - 1) // seq_len
        if self.count < 1:
            raise ValueError(f"data: {tokens.numel()} bytes do not fill one window of {seq_len + 1}; raise "
                             "data.max_bytes or lower model.seq_len")
        self._perm_epoch, self._perm = -1, None

    def _window(self, i: int) -> int:
        epoch, j = divmod(i, self.count)
        if not self.shuffle:
            return j
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.count, generator=g), epoch
        return int(self._perm[j])

    def batch(self, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``[start, start + size)``: inputs and next-byte targets, int64 ``[size, seq_len]``."""
        rows = torch.stack([self.tokens[w * self.seq_len: w * self.seq_len + self.seq_len + 1]
                            for w in map(self._window, range(start, start + size))]).long()
        return rows[:, :-1], rows[:, 1:]


def splits(max_bytes: int, val_fraction: float, seq_len: int, seed: int) -> tuple[ByteWindows, ByteWindows]:
    """(train, validation) windows; validation is read in order (the same batches every eval)."""
    tokens = load_corpus(max_bytes)
    cut = int(tokens.numel() * (1 - val_fraction))
    return ByteWindows(tokens[:cut], seq_len, seed), ByteWindows(tokens[cut:], seq_len, seed, shuffle=False)
