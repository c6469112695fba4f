"""CPU offload of saved activations. dtq modules save quantized activations as their plain
payload tensors, so any saved-tensor hook moves them at their quantized size, bit for bit;
``torch.autograd.graph.save_on_cpu`` works as it is. :func:`offload` adds asynchronous copies
to pinned memory on a side stream and prefetches the next tensors backward will need."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class _Offloader:
    def __init__(self, prefetch: int):
        self.prefetch = prefetch
        self.items: list = []  # [cpu tensor, device, event, prefetched device copy or None]
        self.bytes = 0
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def pack(self, t: torch.Tensor):
        if t.device.type != "cuda":
            self.bytes += t.numel() * t.element_size()
            self.items.append([t.detach().clone(), t.device, None, None])
            return len(self.items) - 1
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        t.record_stream(self.stream)
        self.bytes += t.numel() * t.element_size()
        self.items.append([host, t.device, event, None])
        return len(self.items) - 1

    def _fetch(self, i: int) -> None:
        host, device, event, ready = self.items[i]
        if ready is not None or device.type != "cuda":
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(event)
            dev = host.to(device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.items[i][3] = (dev, done)

    def unpack(self, i: int) -> torch.Tensor:
        host, device, _, _ = self.items[i]
        if device.type != "cuda":
            return host
        self._fetch(i)
        for j in range(max(0, i - self.prefetch), i):  # backward unpacks in reverse: fetch ahead
            self._fetch(j)
        dev, done = self.items[i][3]
        torch.cuda.current_stream(device).wait_event(done)
        dev.record_stream(torch.cuda.current_stream(device))
        return dev


@contextlib.contextmanager
def offload(prefetch: int = 2) -> Iterator[_Offloader]:
    """Saved activations go to pinned CPU memory asynchronously during forward and come back,
    ``prefetch`` tensors ahead, during backward. ``.bytes`` counts what was offloaded."""
    off = _Offloader(prefetch)
    with torch.autograd.graph.saved_tensors_hooks(off.pack, off.unpack):
        yield off
