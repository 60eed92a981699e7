"""The worker side's data path: raykv pages into a request's blocks, and its new full pages
out of them (no vLLM import; a client is anything with raykv's get, put, flush, keys, salted,
continued and bounded).

Loads run in one loader thread, off the engine's step: vLLM holds each loading request in
WAITING_FOR_REMOTE_KVS and schedules others meanwhile. A finished load is reported with the
blocks it did not fill (finished()): vLLM recomputes those. A load the scheduler side judged
cheaper than the step it would cost the request (step_budget.py) is made in the step instead
(load_now, before the forward), each raykv call within its deadline, and its unfilled blocks
go to vLLM as load errors of that step. The two kinds stage pages in buffers of their own; a
sync load while a background one runs may mix their rate samples' split by source (the
client's record of reads is one), never their pages. A load fetches the pages from the
one holding its first token on (KVClient.continued), not the prefix vLLM already holds.
Each load's time and its client's timed reads become rate samples per source tier
(engine_rates.load_samples), which the connector hands vLLM's stats path once a step
(take_samples).

Saves copy the new pages out of the blocks while the step's blocks are still the request's
(the copy is a few memcpys), then put them from one background thread, off the engine's
critical path; with `flush_saves` the thread then flushes them (KVClient.flush: committed, and
the directory told), and settle_saves waits, within a bound, for the saves handed over so far
(the connector calls it where raykv.save_mode says: step_budget.py). A save puts only its new
pages (continuing the key chain after the pages saved before), so chunked prefill copies each
page once. A save that finds MAX_PENDING_SAVES already queued is dropped: a dropped save is
only a future miss. A prefill's save for a remote decode (SaveSpec.keep, P/D) is never
dropped: its decode waits for those pages.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import torch

from cluster.core import cpu_sets
from cluster.core.spec import ModelSpec
from cluster.serving.engine_rates import load_samples
from cluster.serving.vllm_layout import (
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
    num_loads: int = 0
    load_s: float = 0.0
    gathered_tokens: int = 0  # copied out of vLLM's blocks for saves
    saved_tokens: int = 0  # stored by the saves' puts
    dropped_saves: int = 0
    gather_s: float = 0.0
    put_s: float = 0.0
    num_puts: int = 0
    unflushed_saves: int = 0  # put, but their flush ran past its timeout or failed
    num_settles: int = 0  # steps that waited for saves
    settle_s: float = 0.0  # what those waits took
    late_saves: int = 0  # saves still out when a step's wait for them ended


@dataclass
class KVMover:
    """Loads and saves between a raykv client and one worker's caches (`layers` and `layout`
    are vllm_layout's; pages are `spec`'s)."""

    client: object
    layers: list
    layout: object
    spec: ModelSpec
    stats: MoverStats = field(default_factory=MoverStats)
    flush_saves: bool = True  # each save's put is flushed after it (module doc)

    def __post_init__(self) -> None:
        self._buffers: dict[bool, torch.Tensor] = {}  # staging: the loader's, the step's
        self._loader = cpu_sets.thread_pool(1, "raykv-load")
        self._saver = cpu_sets.thread_pool(1, "raykv-save")
        self._pending = 0
        self._unsettled: list[Future] = []  # saves handed over since the last settle_saves
        self._lock = threading.Lock()
        self._finished: list[tuple[str, set[int]]] = []
        # loads' rate samples, not taken yet
        self._samples: list[tuple[str, int, float, float]] = []
        # loads made in the step: bytes, seconds, whether cut at the deadline
        self._in_step: list[tuple[int, float, bool]] = []
        self._pinned = torch.cuda.is_available() and bool(getattr(self.layers[0], "is_cuda",
                                                                   False))

    # ---- loads ---------------------------------------------------------------------------

    def start_load(self, spec: LoadSpec) -> None:
        """Load in the loader thread; finished() reports it."""
        self._loader.submit(self._load_and_report, spec)

    def finished(self) -> list[tuple[str, set[int]]]:
        """The loads done since the last call: (request id, block ids left unfilled)."""
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def load_now(self, spec: LoadSpec) -> set[int]:
        """A load made in the step (spec.sync_timeout_s): load() in this thread, each raykv
        call bounded by the deadline; the block ids left unfilled."""
        try:
            return self.load(spec)
        except Exception:  # the step goes on: a crash is a miss of all of it
            log.exception("raykv load of %s failed", spec.request_id)
            return self._missed(spec)

    def load(self, spec: LoadSpec) -> set[int]:
        """Fill tokens [spec.start, end) of the request's blocks now; the block ids left
        unfilled."""
        start_s, end = time.perf_counter(), len(spec.token_ids)
        block_size = block_tokens(self.layers)
        first, kv = self._first_page(spec.start), None
        in_step, cut_tokens, raised = spec.sync_timeout_s is not None, 0, False
        reads = self._reads()
        reads.clear()  # what this load reads, nothing older
        try:  # the pages from the one holding token `start` on
            client = self._client_from(spec.salt, spec.token_ids, first)
            if in_step:
                client = client.bounded(spec.sync_timeout_s)
            num_tokens, kv = client.get(spec.token_ids[first:],
                                        out=self._out(end - first, in_step))
        except Exception as error:  # a miss, whatever the reason: vLLM recomputes
            if in_step:
                log.warning("raykv load of %s in the step (deadline %.3f s) failed: %s; "
                            "recomputing %d tokens", spec.request_id, spec.sync_timeout_s,
                            type(error).__name__, end - spec.start)
            else:
                log.exception("raykv get failed; recomputing %d tokens", end - spec.start)
            num_tokens, raised = 0, True
        if in_step and (raised or (num_tokens < end - first
                                   and time.perf_counter() - start_s >= spec.sync_timeout_s)):
            # Cut at its deadline: raised, or answered short once it passed (the bounded
            # client answers what it had, with no error). It still measured a rate: its bytes
            # took at least that long, and the next estimate must not repeat the miss
            # (docs/benchmarks.md, vllm-serve: loads cut at their deadline). A late reply
            # must not land in the next load's staging.
            cut_tokens = end - first
            self._buffers.pop(True, None)
            if not raised:
                log.warning("raykv load of %s in the step passed its deadline (%.3f s) with "
                            "%d of %d tokens", spec.request_id, spec.sync_timeout_s,
                            num_tokens, end - first)
        filled = first + num_tokens // block_size * block_size
        if kv is not None and filled > spec.start:
            kv_to_blocks(kv, self.layers, self.layout, spec.block_ids[first // block_size:],
                         (spec.start - first, filled - first))
        failed = blocks_of((max(filled, spec.start), end), spec.block_ids, block_size)
        self.stats.loaded_tokens += max(filled - spec.start, 0)
        self.stats.failed_tokens += end - max(filled, spec.start)
        self.stats.num_loads += 1
        load_s = time.perf_counter() - start_s
        self.stats.load_s += load_s
        samples = load_samples(list(reads), load_s)
        reads.clear()
        with self._lock:
            self._samples.extend(samples)
            if in_step and (num_tokens or cut_tokens):
                self._in_step.append((self.spec.page_bytes(cut_tokens or num_tokens), load_s,
                                      bool(cut_tokens)))
        if failed:
            log.warning("raykv held %d of %d tokens of %s; recomputing the rest", filled, end,
                        spec.request_id)
        return failed

    def take_samples(self) -> tuple[list[tuple[str, int, float, float]],
                                    list[tuple[int, float, bool]]]:
        """The loads' rate samples since the last call (engine_rates.load_samples), and the
        (bytes, seconds, cut at the deadline) of those made in the step."""
        with self._lock:
            samples, self._samples = self._samples, []
            in_step, self._in_step = self._in_step, []
        return samples, in_step

    def _reads(self):
        """The client's record of its timed reads (cluster/view.py); a client without one
        (a test's fake) reads untimed."""
        reads = getattr(getattr(self.client, "view", None), "transfers", None)
        return reads if reads is not None else deque()

    def _load_and_report(self, spec: LoadSpec) -> None:
        try:
            failed = self.load(spec)
        except Exception:  # vLLM must hear of every load: a crash is a miss of all of it
            log.exception("raykv load of %s failed", spec.request_id)
            failed = self._missed(spec)
        with self._lock:
            self._finished.append((spec.request_id, failed))

    def _missed(self, spec: LoadSpec) -> set[int]:
        """A load that crashed: all of it is a miss, counted; its block ids."""
        self.stats.failed_tokens += len(spec.token_ids) - spec.start
        return blocks_of((spec.start, len(spec.token_ids)), spec.block_ids,
                         block_tokens(self.layers))

    # ---- saves ---------------------------------------------------------------------------

    def save(self, spec: SaveSpec) -> None:
        """Copy the new pages out of the blocks now; put them in the background."""
        with self._lock:
            if self._pending >= MAX_PENDING_SAVES and not spec.keep:
                self.stats.dropped_saves += 1
                return
            self._pending += 1
        start_s, num_tokens = time.perf_counter(), len(spec.token_ids) - spec.start
        out = self._staging(num_tokens)
        kv = blocks_to_kv(self.layers, self.layout, spec.block_ids, num_tokens, out)
        self.stats.gather_s += time.perf_counter() - start_s
        self.stats.gathered_tokens += num_tokens
        future = self._saver.submit(self._put, spec, kv)
        with self._lock:
            self._unsettled.append(future)

    def settle_saves(self, timeout_s: float) -> bool:
        """Wait, at most `timeout_s`, for the saves handed over so far to be put (and flushed,
        with flush_saves); whether all were. Those still out go on in the background."""
        with self._lock:
            futures, self._unsettled = self._unsettled, []
        if not futures:
            return True
        start_s = time.perf_counter()
        _, not_done = wait(futures, timeout=max(0.0, timeout_s))
        self.stats.settle_s += time.perf_counter() - start_s
        self.stats.num_settles += 1
        self.stats.late_saves += len(not_done)
        return not not_done

    def close(self) -> None:
        """Finish the queued loads and saves (each call is bounded by the client's timeout)."""
        self._loader.shutdown(wait=True)
        self._saver.shutdown(wait=True)

    def _put(self, spec: SaveSpec, kv: torch.Tensor) -> None:
        start_s = time.perf_counter()
        try:
            client = self._client_from(spec.salt, spec.token_ids, spec.start)
            self.stats.saved_tokens += client.put(spec.token_ids[spec.start:], kv)
            self.stats.put_s += time.perf_counter() - start_s
            self.stats.num_puts += 1
            if self.flush_saves and not client.flush():
                self.stats.unflushed_saves += 1
        except Exception:  # a lost save is a future miss, never the engine's problem
            log.exception("raykv put failed")
        finally:
            with self._lock:
                self._pending -= 1

    # ---- helpers -------------------------------------------------------------------------

    def _client_from(self, salt: bytes, token_ids: list[int], first: int):
        """The client keyed under `salt`, its chain continued after token `first` (a page
        boundary): its calls on token_ids[first:] use the full prompt's keys."""
        client = self.client.salted(salt)
        if first:
            client = client.continued(client.keys(token_ids[:first])[-1])
        return client

    def _first_page(self, token: int) -> int:
        page_tokens = self.client.page_tokens
        return token // page_tokens * page_tokens

    def _staging(self, num_tokens: int) -> torch.Tensor:
        """Host memory for num_tokens of KV in raykv's layout (pinned when the cache is on a
        GPU)."""
        return torch.empty(self.spec.page_shape(num_tokens), dtype=self.spec.torch_dtype(),
                           pin_memory=self._pinned)

    def _out(self, num_tokens: int, in_step: bool = False) -> torch.Tensor:
        """The loader's (or the step's) reused staging with room for num_tokens (grown,
        never shrunk)."""
        buffer = self._buffers.get(in_step)
        if buffer is None or buffer.shape[3] < num_tokens:
            buffer = self._buffers[in_step] = self._staging(num_tokens)
        return buffer[:, :, :, :num_tokens]
