"""Page moves between the host and device tiers, off the node actor's event loop.

    event loop                                  copy thread (one per process)
    await tier_copies().copy(pairs)  -------->  per GPU: with its stream:
      (other requests are served meanwhile)        wait for the GPU's current stream
                                                   dst.copy_(src, non_blocking=True)
                                                   record an event
                                                 wait for the events
On CPU (the device tier's stand-in) the same path runs in the same thread, without streams.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from cluster.core.copies import copy_pages

Pair = tuple[torch.Tensor, torch.Tensor]  # (dst, src)


class TierCopies:
    """A copy thread with a CUDA stream per GPU it has copied on."""

    def __init__(self):
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="raykv-tier-copy")
        self._streams: dict[int, torch.cuda.Stream] = {}
        self.num_batches = 0

    async def copy(self, pairs: list[Pair]) -> None:
        """Copy every (dst, src), in the copy thread; returns once every byte is in place."""
        if pairs:
            await asyncio.wrap_future(self._executor.submit(self.copy_now, pairs))

    def copy_now(self, pairs: list[Pair]) -> None:
        """The copies themselves (in the copy thread; callable directly from any thread)."""
        self.num_batches += 1
        by_device: dict[int, list[Pair]] = {}
        for dst, src in pairs:
            device = dst.device if dst.is_cuda else src.device
            by_device.setdefault(device.index if device.type == "cuda" else -1, []).append(
                (dst, src))
        copy_pages(by_device.pop(-1, []))
        events = [self._copy_on_stream(device, group) for device, group in by_device.items()]
        for event in events:
            event.synchronize()

    def _copy_on_stream(self, device: int, pairs: list[Pair]) -> torch.cuda.Event:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        # Pages written on the GPU's current stream (puts through Ray) are complete first.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def close(self) -> None:
        self._executor.shutdown(wait=True)


_copies: TierCopies | None = None
_copies_lock = threading.Lock()


def tier_copies() -> TierCopies:
    """The process's copy thread (made on first use)."""
    global _copies
    with _copies_lock:
        if _copies is None:
            _copies = TierCopies()
        return _copies
