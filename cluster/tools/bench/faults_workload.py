"""The bounded concurrent workload that `raykv bench faults` runs while it injects faults.

    put threads (driver, head node; a client each)   put a fresh prompt of known KV, get it
                                                     back, get one older prompt
    remote reader (an actor on another node)         get the prompt put ~1 s ago, across nodes
    HTTP thread (the Serve app, loopback)            greedy completions of fixed prompts

Every page that comes back is checked against an xxh3 checksum of what was put (per page);
a page with other bytes is a wrong byte. Every operation, whichever thread or fault ran it, is
a Record with its start and end times (`Workload.op`): an exception is an error record, and a
workload thread that dies records its death. A fault's figures are the records that overlap
its window (operations in flight when it hit included); the run's totals are every record.
Misses are not errors: a client error is an exception where the client promises a value (a
put's count, a get's prefix), or an HTTP answer that is neither a 200 nor an OpenAI-shaped
error.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
import torch
import xxhash

from cluster.core.spec import ModelSpec
from cluster.tools.doomed_writer import known_kv

PROMPT_TOKENS = 64
REMOTE_LAG_S = 1.0
# The kinds the workload's threads record; the others are recorded by a fault's injection.
THREAD_KINDS = ("put", "old", "remote", "http")


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
    kind: str  # "put" (put + get back), "old" (an older prompt), "remote", "http", a fault's
    start_s: float
    end_s: float
    ok: bool  # the operation did its job fully (a stored put read back; a hit; a 200)
    wrong: int = 0  # pages (or HTTP answers) with other bytes than were put
    error: str = ""  # an unhandled client error


def timed_record(kind: str, op: Callable[..., tuple[bool, int]], *args) -> Record:
    """Run op(*args) -> (ok, wrong pages) as a Record; an exception is an error record
    (counted: the client promised a value)."""
    start_s = time.monotonic()
    try:
        ok, wrong = op(*args)
    except Exception as error:  # noqa: BLE001
        return Record(kind, start_s, time.monotonic(), False, 0, repr(error))
    return Record(kind, start_s, time.monotonic(), bool(ok), int(wrong))


def checked_get(client, tokens: list[int], sums: list[int]) -> tuple[int, int]:
    """(tokens the get found, its pages whose bytes differ from `sums`)."""
    num_tokens, kv = client.get(tokens)
    return num_tokens, wrong_pages(kv, num_tokens, sums, client.page_tokens)


def full_get(client, tokens: list[int], sums: list[int]) -> tuple[bool, int]:
    """An op: a get that must find every token with the bytes put."""
    num_tokens, wrong = checked_get(client, tokens, sums)
    return num_tokens == len(tokens) and not wrong, wrong


def put_and_get(client, tokens: list[int], kv: torch.Tensor, sums: list[int]) -> tuple[bool, int]:
    """An op: put, then a get that must find every token with the bytes put."""
    stored = client.put(tokens, kv)
    ok, wrong = full_get(client, tokens, sums)
    return ok and stored == len(tokens), wrong


def in_window(records: list[Record], start_s: float, end_s: float) -> list[Record]:
    """The records of the operations that overlapped [start_s, end_s]: those in flight when
    it began or ended too."""
    return [r for r in records if r.end_s >= start_s and r.start_s <= end_s]


def tally(records: list[Record]) -> dict:
    """{"ops", "wrong_bytes", "client_errors", "misses", "errors"} (the first 3 distinct)."""
    return {"ops": len(records), "wrong_bytes": sum(r.wrong for r in records),
            "client_errors": sum(1 for r in records if r.error),
            "misses": sum(1 for r in records if not r.ok and not r.error),
            "errors": sorted({r.error for r in records if r.error})[:3]}


@ray.remote(num_cpus=0, max_restarts=0)
class RemoteReader:
    """A client on another node that gets a prompt and checks its pages' checksums."""

    def __init__(self, spec: ModelSpec):
        from cluster import connect

        self.client = connect(spec)

    def check(self, tokens: list[int], sums: list[int]) -> tuple[int, int]:
        return checked_get(self.client, tokens, sums)


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
            thread = threading.Thread(target=self._guarded, args=(target,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _guarded(self, target: Callable[[], None]) -> None:
        """A thread that dies stops its operations: its death is an error record."""
        try:
            target()
        except Exception as error:  # noqa: BLE001
            now_s = time.monotonic()
            self.add(Record("thread", now_s, now_s, False, 0, f"thread died: {error!r}"))

    def running(self) -> bool:
        return not self._stop.is_set() and len(self.records) < self.max_ops

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)

    def add(self, record: Record) -> None:
        with self._lock:
            self.records.append(record)

    def op(self, kind: str, op: Callable[..., tuple[bool, int]], *args) -> Record:
        """Run op(*args) as an operation of `kind` and record it (see timed_record)."""
        record = timed_record(kind, op, *args)
        self.add(record)
        return record

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
        if self.op("put", put_and_get, client, prompt(seq), kv, sums).ok:
            with self._lock:
                self.history.append((seq, time.monotonic(), sums))

    def _old_op(self, client, rng: random.Random) -> None:
        with self._lock:
            if not self.history:
                return
            seq, _, sums = self.history[rng.randrange(len(self.history))]
        self.op("old", _hit, client, prompt(seq), sums)

    def lagged(self) -> tuple[int, list[int]] | None:
        """The newest prompt put at least REMOTE_LAG_S ago (the directory has heard of it)."""
        cutoff_s = time.monotonic() - REMOTE_LAG_S
        with self._lock:
            for seq, put_s, sums in reversed(self.history):
                if put_s <= cutoff_s:
                    return seq, sums
        return None


def _hit(client, tokens: list[int], sums: list[int]) -> tuple[bool, int]:
    """An op: a get of an older prompt; any hit with the bytes put is ok (it may be evicted)."""
    num_tokens, wrong = checked_get(client, tokens, sums)
    return num_tokens > 0 and not wrong, wrong


def _remote_check(reader, seq: int, sums: list[int], timeout_s: float) -> tuple[bool, int]:
    num_tokens, wrong = ray.get(reader.check.remote(prompt(seq), sums), timeout=timeout_s)
    return num_tokens == PROMPT_TOKENS and not wrong, wrong


def remote_loop(reader, timeout_s: float):
    """A workload thread: the remote reader gets the lagged prompt every 0.2 s (a dead reader
    or a hang is an error record)."""

    def loop(work: Workload) -> None:
        while work.running():
            time.sleep(0.2)
            target = work.lagged()
            if target is not None:
                work.op("remote", _remote_check, reader, *target, timeout_s)

    return loop


def recovery_s(window: list[Record], injected_s: float, kinds: tuple[str, ...]) -> float | None:
    """Seconds from the injection until the window's operations of `kinds` succeed again: the
    end of the first success that started after the last failure (after the injection). With
    no success after it, the whole window; with no operation of `kinds`, None (not exercised)."""
    relevant = [r for r in window if r.kind in kinds and r.end_s >= injected_s]
    if not relevant:
        return None
    last_failure_s = max((r.end_s for r in relevant if not r.ok), default=injected_s)
    after = [r.end_s for r in relevant if r.ok and r.start_s >= last_failure_s]
    return (min(after) if after else max(r.end_s for r in relevant)) - injected_s
