"""What a node's pool holds in its mapped tiers, published in shared memory for the clients on
its node: key digest -> place row (tier, slot, generation; slot_table.py). A get of pages that
another client put then needs no call: it looks them up here, copies the slots and checks
their generations, as it does with its own notes (cluster/slabs.py, cluster/fetch.py).

    header   | magic | capacity | probes | alive_ns | 0 ...                    64 bytes
    entries  | seq | d0 | d1 | tier | slot | generation | check | 0 |  64 bytes each

One writer (the node's pool, on its event loop) and any number of readers, which map the file
read-only. An entry is only a hint; correctness stays with the reader's copy-then-check of
the slot's generation (a slot's generation moves whenever it is freed, before it is reused):

- Torn entries. The writer makes `seq` odd, writes the fields, then makes it even again
  (a seqlock); a reader reads seq, the entry, then seq again and keeps the entry only when
  both reads are the same even value and the entry's own seq and `check` (a mix of its
  fields) agree. A torn or half-written entry is a miss of that page, never another page's
  place. (x86 keeps stores in order and loads in order, which the seqlock needs; the check
  word also catches a tear where the hardware would reorder.)
- A full table. Open addressing over a power-of-two table (four times the mapped slots), a key
  probing at most PROBES entries from its bucket; with no free entry among them the writer
  overwrites one (round robin): that page merely misses here and is asked for.
- Stale entries. The generation in the entry is the slot's when the page was published; a
  page freed or moved since fails the reader's check (a miss, asked for as before).
- A dead node. The node stamps `alive_ns` in a loop of its own (CLOCK_MONOTONIC, the same in
  every process of the host); readers ignore an index not stamped within `max_age_s`, as they stop
  trusting their own notes after HINT_TTL_S.

Tenants. Entries hold a digest of the page key, blake2b(key, person="raykv-held-v1"), never
the key itself. Page keys are keyed by their namespace's secret (keys.py), so only a client
holding that secret can compute a key and find its page here, and the digests give away no
key (which would let a reader acquire or read another tenant's pages through the node).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import threading
import time
import uuid
from collections.abc import Sequence

import numpy as np

from cluster.core.tiers.shm import SharedFile
from cluster.core.tiers.slot_table import as_places

MAGIC = 0x72_61_79_6B_76_68_6C_64  # "raykvhld"
WORDS = 8  # uint64 words per entry (and in the header): 64 bytes
PROBES = 16
SEQ, D0, D1, TIER, SLOT, GENERATION, CHECK = range(7)
H_MAGIC, H_CAPACITY, H_PROBES, H_ALIVE = range(4)
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                 0xD6E8FEB86659FD93, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53], dtype=np.uint64)
_PERSON = b"raykv-held-v1"


_HASHER = hashlib.blake2b(digest_size=16, person=_PERSON)


def digest(key: bytes) -> bytes:
    """The 16 bytes a key is published under (see the module docstring: tenants); a copy of
    a primed hasher costs about half of a fresh one's set-up, on every key of every get."""
    hasher = _HASHER.copy()
    hasher.update(key)
    return hasher.digest()


def digests(keys: Sequence[bytes]) -> np.ndarray:
    """uint64 [N, 2]: (d0, d1) per key; never (0, 0), the mark of a free entry."""
    if not keys:
        return np.empty((0, 2), dtype=np.uint64)
    table = np.frombuffer(b"".join(map(digest, keys)), dtype=np.uint64).reshape(-1, 2).copy()
    table[(table[:, 0] == 0) & (table[:, 1] == 0), 1] = 1
    return table


def check_words(fields: np.ndarray) -> np.ndarray:
    """The check word of entries whose (d0, d1, tier, slot, generation) are fields[..., 0:5]."""
    with np.errstate(over="ignore"):
        mixed = fields[..., :5].astype(np.uint64) * _MIX[:5]
        return np.bitwise_xor.reduce(mixed, axis=-1) ^ _MIX[5]


def capacity_for(num_slots: int) -> int:
    """A power of two at least four times `num_slots` (load <= 1/4), and at least 1024."""
    return 1 << max(10, int(4 * max(1, num_slots) - 1).bit_length())


class HeldIndex:
    """The node's side: publishes and withdraws pages (one writer)."""

    def __init__(self, shm_prefix: str, num_slots: int):
        self.capacity = capacity_for(num_slots)
        self._file = SharedFile(f"{shm_prefix}-held-{uuid.uuid4().hex[:12]}",
                                (self.capacity + 1) * WORDS * 8)
        self.path = self._file.path
        words = np.frombuffer(self._file.mmap, dtype=np.uint64)
        self._header = words[:WORDS]
        self._table = words[WORDS:].reshape(self.capacity, WORDS)
        self._header[H_CAPACITY], self._header[H_PROBES] = self.capacity, PROBES
        self._header[H_MAGIC] = MAGIC
        self._where: dict[bytes, int] = {}  # key -> its entry
        self._keys: list[bytes | None] = [None] * self.capacity  # entry -> its key
        self._next_victim = 0
        self._lock = threading.Lock()  # publish/withdraw from a copy thread too
        self._batches = threading.local()  # .pending: a batch open on that thread (batched())
        self.overwritten = 0  # entries taken from another key: the table was full there
        self.beat()

    def beat(self) -> None:
        """Stamp the header: readers trust the index for max_age_s after this."""
        self._header[H_ALIVE] = time.monotonic_ns()

    def expire(self) -> None:
        """Readers stop trusting the index now (until the next beat)."""
        self._header[H_ALIVE] = 0

    @contextlib.contextmanager
    def batched(self):
        """Within it, this thread's publishes and withdraws are held back and written at its
        end in one pass each, the last change of a key winning. A pool moving a batch of pages
        changes them one by one, and one write per page cost it about 23 us (hashing and numpy
        set-up), 0.7 ms of a 30-page read-up from disk. An entry is only a hint: one written a
        few microseconds later is a miss at worst (the module docstring). Nested: one batch."""
        if getattr(self._batches, "pending", None) is not None:
            yield
            return
        pending: dict[bytes, tuple | None] = {}
        self._batches.pending = pending
        try:
            yield
        finally:
            self._batches.pending = None
            self._flush(pending)

    def _flush(self, pending: dict) -> None:
        gone = [key for key, place in pending.items() if place is None]
        kept = [(key, place) for key, place in pending.items() if place is not None]
        if gone:
            self.withdraw(gone)
        if kept:
            self.publish([key for key, _ in kept], [place for _, place in kept])

    def publish(self, keys: Sequence[bytes], places) -> None:
        """Entries for `keys` at `places` (an int64 [N, 3] slot table: the pages are ready
        there, at those generations)."""
        places = as_places(places)
        if not len(keys):
            return
        pending = getattr(self._batches, "pending", None)
        if pending is not None:
            pending.update(zip(keys, map(tuple, places.tolist()), strict=True))
            return
        found = digests(keys)
        with self._lock:
            rows = np.fromiter((self._entry_for(key, int(d0))
                                for key, d0 in zip(keys, found[:, 0].tolist(), strict=True)),
                               dtype=np.int64, count=len(keys))
            fields = np.empty((len(keys), 5), dtype=np.uint64)
            fields[:, :2] = found
            fields[:, 2:] = places.astype(np.uint64)
            self._write(rows, fields)

    def withdraw(self, keys: Sequence[bytes]) -> None:
        """No entries for `keys` any more (dropped, written to disk, or pending again)."""
        pending = getattr(self._batches, "pending", None)
        if pending is not None:
            pending.update(dict.fromkeys(keys))
            return
        with self._lock:
            rows = [self._where.pop(key) for key in keys if key in self._where]
            for row in rows:
                self._keys[row] = None
            if rows:
                self._write(np.asarray(rows, dtype=np.int64),
                            np.zeros((len(rows), 5), dtype=np.uint64))

    def _entry_for(self, key: bytes, d0: int) -> int:
        """The entry `key` is (to be) published in: its own, a free one in its probe window,
        else one taken from another key (round robin over the window)."""
        row = self._where.get(key)
        if row is not None:
            return row
        mask, start = self.capacity - 1, d0 & (self.capacity - 1)
        for probe in range(PROBES):
            if self._keys[(start + probe) & mask] is None:
                row = (start + probe) & mask
                break
        else:
            row = (start + self._next_victim) & mask
            self._next_victim = (self._next_victim + 1) % PROBES
            del self._where[self._keys[row]]
            self.overwritten += 1
        self._where[key] = row
        self._keys[row] = key
        return row

    def _write(self, rows: np.ndarray, fields: np.ndarray) -> None:
        """Write entries under their seqlocks: seq odd, fields, check, seq even."""
        table = self._table
        seq = table[rows, SEQ] | np.uint64(1)  # odd: being written (rows may repeat)
        table[rows, SEQ] = seq
        table[rows, D0:CHECK] = fields
        table[rows, CHECK] = check_words(fields)
        table[rows, SEQ] = seq + np.uint64(1)

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        self._file.close()


class HeldView:
    """A client's read-only mapping of a node's HeldIndex."""

    def __init__(self, path: str, max_age_s: float):
        fd = os.open(path, os.O_RDONLY)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        words = np.frombuffer(self._mmap, dtype=np.uint64)
        header = words[:WORDS]
        if int(header[H_MAGIC]) != MAGIC:
            raise ValueError(f"{path} is not a held-pages index")
        self.capacity, self.probes = int(header[H_CAPACITY]), int(header[H_PROBES])
        self._header = header
        self._table = words[WORDS : WORDS * (self.capacity + 1)].reshape(self.capacity, WORDS)
        self.path = path
        self.max_age_ns = int(max_age_s * 1e9)

    def alive(self) -> bool:
        return time.monotonic_ns() - int(self._header[H_ALIVE]) <= self.max_age_ns

    def prefix(self, keys: Sequence[bytes]) -> np.ndarray:
        """The places (int64 [N, 3]) of the longest prefix of `keys` with an intact entry;
        none when the node has not stamped the index lately."""
        if not keys or not self.alive():
            return as_places([])
        wanted = digests(keys)
        table = self._table
        rows, found = self._probe(wanted)
        num = int(np.argmin(found)) if not found.all() else len(keys)
        if not num:
            return as_places([])
        rows = rows[:num]
        before = table[rows, SEQ]  # the seqlock: seq, the entry, seq again
        entries = table[rows]
        after = table[rows, SEQ]
        intact = ((before == after) & (before & np.uint64(1) == 0) & (entries[:, SEQ] == before)
                  & (entries[:, D0] == wanted[:num, 0]) & (entries[:, D1] == wanted[:num, 1])
                  & (check_words(entries[:, D0:CHECK]) == entries[:, CHECK]))
        num = int(np.argmin(intact)) if not intact.all() else num
        return entries[:num, TIER : GENERATION + 1].astype(np.int64)

    def _probe(self, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(entry, found) per digest of `wanted`: the first entry of its probe window whose d0
        is the digest's. The index is at most a quarter full, so a digest sits in its home
        entry as a rule: one gather of those first (a cache line per key), and the whole window
        (PROBES lines) only for the keys not found there."""
        table, mask = self._table, np.uint64(self.capacity - 1)
        home = wanted[:, 0] & mask
        found = table[home, D0] == wanted[:, 0]
        rows = home.astype(np.int64)
        if found.all():
            return rows, found
        away = np.flatnonzero(~found)
        windows = ((home[away, None] + np.arange(self.probes, dtype=np.uint64)) & mask)
        candidates = table[windows, D0] == wanted[away, :1]  # [away, probes]
        found[away] = candidates.any(axis=1)
        rows[away] = windows[np.arange(len(away)), np.argmax(candidates, axis=1)].astype(np.int64)
        return rows, found

    def close(self) -> None:
        try:
            self._mmap.close()
        except BufferError:  # a view of it is still alive somewhere: it goes with that
            pass

