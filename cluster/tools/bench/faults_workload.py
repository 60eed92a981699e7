"""The bounded concurrent workload that `raykv bench faults` runs while it injects faults.

    put threads (driver, head node; a client each)   put a fresh prompt of known KV, get it
                                                     back, get one older prompt
    remote reader (an actor on another node)         get the prompt put ~1 s ago, across nodes
    HTTP thread (the Serve app, loopback)            greedy completions of fixed prompts

Every page that comes back is checked against an xxh3 checksum of what was put (per page);
a page with other bytes is a wrong byte. Each operation is a Record with its start and end
times, so each fault's figures are the records of its time window. Misses are not errors: a
client error is an exception where the client promises a value (a put's count, a get's
prefix), or an HTTP answer that is neither a 200 nor an OpenAI-shaped error.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass

import ray
import torch
import xxhash

from cluster.core.spec import ModelSpec
from cluster.tools.doomed_writer import known_kv

PROMPT_TOKENS = 64
REMOTE_LAG_S = 1.0


def prompt(seq: int) -> list[int]:
    return [1_000_000 + seq * PROMPT_TOKENS + i for i in range(PROMPT_TOKENS)]


def page_sums(kv: torch.Tensor, page_tokens: int) -> list[int]:
    """xxh3-64 of each page's bytes (the page's [L, 2, H, page_tokens, D] slice, contiguous)."""
    num_pages = kv.shape[3] // page_tokens
    return [xxhash.xxh3_64_intdigest(
        kv[:, :, :, p * page_tokens:(p + 1) * page_tokens].contiguous().view(torch.uint8)
        .numpy().tobytes()) for p in range(num_pages)]


def wrong_pages(kv: torch.Tensor | None, num_tokens: int, sums: list[int],
                page_tokens: int) -> int:
    """How many pages of a get's answer differ from what was put."""
    if not num_tokens:
        return 0
    got = page_sums(kv[:, :, :, :num_tokens], page_tokens)
    return sum(1 for a, b in zip(got, sums, strict=False) if a != b)


@dataclass(frozen=True, slots=True)
class Record:
    kind: str  # "put" (put + get back), "old" (an older prompt), "remote", "http"
    start_s: float
    end_s: float
    ok: bool  # the operation did its job fully (a stored put read back; a hit; a 200)
    wrong: int = 0  # pages (or HTTP answers) with other bytes than were put
    error: str = ""  # an unhandled client error


@ray.remote(num_cpus=0, max_restarts=0)
class RemoteReader:
    """A client on another node that gets a prompt and checks its pages' checksums."""

    def __init__(self, spec: ModelSpec):
        from cluster import connect

        self.client = connect(spec)

    def check(self, tokens: list[int], sums: list[int]) -> tuple[int, int]:
        num_tokens, kv = self.client.get(tokens)
        return num_tokens, wrong_pages(kv, num_tokens, sums, self.client.page_tokens)


class Workload:
    """Threads that run until stop(); records every operation."""

    def __init__(self, spec: ModelSpec, num_threads: int, max_ops: int):
        self.spec, self.num_threads, self.max_ops = spec, num_threads, max_ops
        self.records: list[Record] = []
        self.history: list[tuple[int, float, list[int]]] = []  # (seq, put at, page sums)
        self._seqs = itertools.count()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self, extra: list) -> None:
        """Start the put threads, and each callable of `extra` (it gets this Workload) in a
        thread of its own."""
        targets = [self._put_loop] * self.num_threads + [lambda e=e: e(self) for e in extra]
        for target in targets:
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            self._threads.append(thread)

    def running(self) -> bool:
        return not self._stop.is_set() and len(self.records) < self.max_ops

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)

    def add(self, record: Record) -> None:
        with self._lock:
            self.records.append(record)

    def _put_loop(self) -> None:
        from cluster import connect

        client, rng = connect(self.spec), random.Random(threading.get_ident())
        while self.running():
            self._put_op(client)
            self._old_op(client, rng)
            time.sleep(0.01)

    def _put_op(self, client) -> None:
        seq = next(self._seqs)
        kv = known_kv(self.spec, PROMPT_TOKENS, seq)
        sums = page_sums(kv, client.page_tokens)
        start_s = time.monotonic()
        try:
            stored = client.put(prompt(seq), kv)
            num_tokens, got = client.get(prompt(seq))
        except Exception as error:  # noqa: BLE001  (counted: the client promised a value)
            self.add(Record("put", start_s, time.monotonic(), False, 0, repr(error)))
            return
        wrong = wrong_pages(got, num_tokens, sums, client.page_tokens)
        ok = stored == PROMPT_TOKENS and num_tokens == PROMPT_TOKENS and not wrong
        self.add(Record("put", start_s, time.monotonic(), ok, wrong))
        if stored == PROMPT_TOKENS:
            with self._lock:
                self.history.append((seq, time.monotonic(), sums))

    def _old_op(self, client, rng: random.Random) -> None:
        with self._lock:
            if not self.history:
                return
            seq, _, sums = self.history[rng.randrange(len(self.history))]
        start_s = time.monotonic()
        try:
            num_tokens, got = client.get(prompt(seq))
        except Exception as error:  # noqa: BLE001
            self.add(Record("old", start_s, time.monotonic(), False, 0, repr(error)))
            return
        wrong = wrong_pages(got, num_tokens, sums, client.page_tokens)
        self.add(Record("old", start_s, time.monotonic(), num_tokens > 0 and not wrong, wrong))

    def lagged(self) -> tuple[int, list[int]] | None:
        """The newest prompt put at least REMOTE_LAG_S ago (the directory has heard of it)."""
        cutoff_s = time.monotonic() - REMOTE_LAG_S
        with self._lock:
            for seq, put_s, sums in reversed(self.history):
                if put_s <= cutoff_s:
                    return seq, sums
        return None


def remote_loop(reader, timeout_s: float):
    """A workload thread: the remote reader gets the lagged prompt every 0.2 s."""

    def loop(work: Workload) -> None:
        while work.running():
            time.sleep(0.2)
            target = work.lagged()
            if target is None:
                continue
            seq, sums = target
            start_s = time.monotonic()
            try:
                num_tokens, wrong = ray.get(reader.check.remote(prompt(seq), sums),
                                            timeout=timeout_s)
            except Exception as error:  # noqa: BLE001  (a dead reader or a hang)
                work.add(Record("remote", start_s, time.monotonic(), False, 0, repr(error)))
                continue
            ok = num_tokens == PROMPT_TOKENS and not wrong
            work.add(Record("remote", start_s, time.monotonic(), ok, wrong))

    return loop


def recovery_s(records: list[Record], injected_s: float, kinds: tuple[str, ...]) -> float:
    """Seconds from the injection until the workload's operations of `kinds` succeed again:
    the end of the first success that started after the last failure (after the injection).
    With no success after it, the whole window."""
    window = sorted((r for r in records if r.start_s >= injected_s and r.kind in kinds),
                    key=lambda r: r.start_s)
    if not window:
        return 0.0
    last_failure_s = max((r.end_s for r in window if not r.ok), default=injected_s)
    after = [r.end_s for r in window if r.ok and r.start_s >= last_failure_s]
    return (min(after) if after else window[-1].end_s) - injected_s
