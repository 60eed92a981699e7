"""The worker side's data path: raykv pages into a request's blocks, and its new full pages
out of them (no vLLM import; a client is anything with raykv's get/put).

Loads run in the step that needs them: a page holds every layer, so the first layer cannot
start before the whole get is in. A load that comes back short is a miss for the rest: the
blocks it did not fill are reported, and vLLM recomputes them.

Saves copy the blocks out while the step's blocks are still the request's (the copy is a few
memcpys), then put them from one background thread, off the engine's critical path. A save
that finds MAX_PENDING_SAVES already queued is dropped: a dropped save is only a future miss.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from cluster.serving.vllm_layout import (
    BlockLayout,
    block_tokens,
    blocks_of,
    blocks_to_kv,
    kv_to_blocks,
)
from cluster.serving.vllm_plan import LoadSpec, SaveSpec

log = logging.getLogger("raykv.vllm")
MAX_PENDING_SAVES = 16
SHUTDOWN_TIMEOUT_S = 30.0


@dataclass(slots=True)
class MoverStats:
    """What the worker side did, in tokens and seconds."""

    loaded_tokens: int = 0
    failed_tokens: int = 0
    load_s: float = 0.0
    saved_tokens: int = 0
    dropped_saves: int = 0
    gather_s: float = 0.0
    put_s: float = 0.0
    num_puts: int = 0
    put_s: float = 0.0
    num_puts: int = 0


@dataclass
class KVMover:
    """Loads and saves between a raykv client and one worker's per-layer caches."""

    client: object
    layers: list[torch.Tensor]
    layout: BlockLayout
    dtype: torch.dtype
    stats: MoverStats = field(default_factory=MoverStats)

    def __post_init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="raykv-save")
        self._pending = 0
        self._lock = threading.Lock()

    def load(self, spec: LoadSpec) -> set[int]:
        """Fill tokens [spec.start, end) of the request's blocks; the block ids left unfilled."""
        start_s, end = time.perf_counter(), len(spec.token_ids)
        block_size = block_tokens(self.layers)
        try:
            num_tokens, kv = self.client.get(spec.token_ids, out=self._out(end))
        except Exception:  # a miss, whatever the reason: vLLM recomputes
            log.exception("raykv get failed; recomputing %d tokens", end - spec.start)
            num_tokens, kv = 0, None
        filled = num_tokens // block_size * block_size
        if kv is not None and filled > spec.start:
            kv_to_blocks(kv, self.layers, self.layout, spec.block_ids, (spec.start, filled))
        failed = blocks_of((max(filled, spec.start), end), spec.block_ids, block_size)
        self.stats.loaded_tokens += max(filled - spec.start, 0)
        self.stats.failed_tokens += end - max(filled, spec.start)
        self.stats.load_s += time.perf_counter() - start_s
        if failed:
            log.warning("raykv held %d of %d tokens of %s; recomputing the rest", filled, end,
                        spec.request_id)
        return failed

    def save(self, spec: SaveSpec) -> None:
        """Copy the pages out of the blocks now; put them in the background."""
        with self._lock:
            if self._pending >= MAX_PENDING_SAVES:
                self.stats.dropped_saves += 1
                return
            self._pending += 1
        start_s, num_tokens = time.perf_counter(), len(spec.token_ids)
        out = torch.empty(self._shape(num_tokens), dtype=self.dtype)
        kv = blocks_to_kv(self.layers, self.layout, spec.block_ids, num_tokens, out)
        self.stats.gather_s += time.perf_counter() - start_s
        self._saver.submit(self._put, spec.token_ids, kv)

    def close(self) -> None:
        """Finish the queued saves (each put is bounded by the client's call timeout)."""
        self._saver.shutdown(wait=True)

    def _put(self, token_ids: list[int], kv: torch.Tensor) -> None:
        start_s = time.perf_counter()
        try:
            self.stats.saved_tokens += self.client.put(token_ids, kv)
            self.stats.put_s += time.perf_counter() - start_s
            self.stats.num_puts += 1
        except Exception:  # a lost save is a future miss, never the engine's problem
            log.exception("raykv put failed")
        finally:
            with self._lock:
                self._pending -= 1

    def _shape(self, num_tokens: int) -> tuple[int, ...]:
        layer = self.layers[0]
        return (len(self.layers), 2, layer.shape[1], num_tokens, layer.shape[3] // 2)

    def _out(self, num_tokens: int) -> torch.Tensor:
        """A reused buffer with room for num_tokens (grown, never shrunk)."""
        if self._buffer is None or self._buffer.shape[3] < num_tokens:
            self._buffer = torch.zeros(self._shape(num_tokens), dtype=self.dtype)
        return self._buffer[:, :, :, :num_tokens]
