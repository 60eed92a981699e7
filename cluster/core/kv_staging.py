"""Staging for cluster/core/kv_layout.py's tiles between host pages and caches on a CUDA
device: pinned host buffers, a side stream, and events that order it with the engine's stream
(pure: torch only). For caches on the CPU every step is the identity.

A scatter: the page tile is copied into pinned memory, then to a device scratch tile on the
side stream, which first waits for the engine's stream (the one current when the caches were
described: its queued forward may still read the blocks) and the caller's; the blocks are
written on the side stream; the engine's stream waits on an event recorded after them, and the
host waits for it too before the pinned buffer is reused. A gather: the side stream waits for
the engine's and the caller's streams, assembles the tile in device scratch, copies it to
pinned memory, and the host copies it into the page once the event is done. Buffers are grown,
never shrunk; one lock per direction.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext

import numpy as np
import torch


class Stager:
    """Moves tiles between host pages and a CUDA device: pinned staging, a side stream, and
    events ordering it with the engine's stream. On CPU caches every step is the identity."""

    def __init__(self, device: torch.device):
        self.device = device
        self.scatter_lock, self.gather_lock = threading.Lock(), threading.Lock()
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._engine_stream = torch.cuda.current_stream(device)
            self._stream = torch.cuda.Stream(device)
        self._buffers: dict[str, torch.Tensor] = {}

    def on_stream(self):
        """A context running the tile's ops on the side stream (nothing on CPU)."""
        return torch.cuda.stream(self._stream) if self._cuda else nullcontext()

    def to_device(self, tile: torch.Tensor) -> torch.Tensor:
        """The tile on the caches' device: host -> pinned -> device on the side stream."""
        if not self._cuda or tile.device == self.device:
            return tile
        pinned = self._buffer("scatter-host", tile, pin=True)
        np.copyto(pinned.numpy(), tile.numpy())  # host to host: memcpy, no OpenMP
        scratch = self._buffer("scatter-device", tile)
        with torch.cuda.stream(self._stream):
            scratch.copy_(pinned, non_blocking=True)
        return scratch

    def after_scatter(self) -> None:
        """The engine's stream waits for the writes; the staging is free again on return."""
        if self._cuda:
            done = torch.cuda.Event()
            done.record(self._stream)
            self._engine_stream.wait_event(done)
            done.synchronize()

    def join(self) -> None:
        """The side stream starts after what the engine and the caller have queued: the
        forward's writes to the blocks, and a device page still being produced."""
        if self._cuda:
            self._stream.wait_stream(self._engine_stream)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def device_scratch(self, target: torch.Tensor) -> torch.Tensor:
        """Where the tile is assembled: the target itself on CPU or on the same device."""
        if not self._cuda or target.device == self.device:
            return target
        return self._buffer("gather-device", target)

    def to_host(self, scratch: torch.Tensor, target: torch.Tensor) -> None:
        """The assembled tile into the page: device -> pinned on the side stream -> host."""
        if scratch is target:
            if self._cuda:
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
            return
        pinned = self._buffer("gather-host", target, pin=True)
        with torch.cuda.stream(self._stream):
            pinned.copy_(scratch, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()
        np.copyto(target.numpy(), pinned.numpy())

    def _buffer(self, name: str, like: torch.Tensor, pin: bool = False) -> torch.Tensor:
        """A contiguous tensor shaped like `like` over a reused buffer (grown, never shrunk)."""
        num_bytes = like.numel() * like.element_size()
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < num_bytes:
            device = "cpu" if pin else self.device
            buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device, pin_memory=pin)
            self._buffers[name] = buffer
        return buffer[:num_bytes].view(like.dtype).view(like.shape)

