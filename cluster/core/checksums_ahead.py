"""Checksums taken once, soon after a page is copied in, so that demotion only writes (a mixin
of Pool).

    a put commits / a pull lands   the page's key is queued (host tier, no checksum yet)
    the node's loop, between requests   checksum_ahead(): the oldest queued pages, hashed in
                                        a thread, kept on their entries (slot generation
                                        unchanged: the bytes hashed are the page's)
    demotion (disk_write)               writes the page with the checksum it has: no pass over
                                        its bytes on the demotion's path
    a read-up from disk                 the header's checksum, verified, stays on the entry:
                                        the page is never hashed again while its bytes live

The disk tier checksums every page so that a torn or damaged page reads as a miss. It used
to hash each page on the writing thread: on a fast disk that pass is a good share of the
write (xxh3 at ~25 GB/s on this machine's cores against 2.5 to 5 GB/s of writes), and on the
demotion's path when a batch needs room. Hashing soon after the copy-in moves it off both
the put's path (the client copies at memcpy speed; the node hashes later, in its own thread
at a lower CPU priority, so that it takes no core from the copies of requests) and the
demotion's.

A page's bytes do not change while it sits in one slot (a committed page is never written
again; a late writer's slot is quarantined: tiers/fence.py). A page moved or freed while its
hash ran shows a new slot or slot generation, and its hash is dropped. Should a page's bytes
change anyway, its disk copy fails its checksum when read: a miss, never wrong bytes. A page
demoted before its turn is hashed on the writing thread, as before (`inline_checksums`).
Pages whose disk copy is encoded (fp8, int8) are not queued: the encoded bytes are hashed
when they are made.
"""

from __future__ import annotations

import asyncio
from collections import deque

from cluster.core.background import background_thread
from cluster.core.geometry import HOST
from cluster.core.keys import PageKey
from cluster.core.pool_entry import Entry, State
from cluster.core.tiers.disk_format import checksum

BATCH_BYTES = 64 << 20  # hashed per pass: ~3 ms of one core at ~25 GB/s



async def _on_hash_thread(function):
    """function(), run on the thread that hashes pages ahead (one per process), at the lower
    CPU priority of work ahead of need (background.py): it yields a core to the gets' and
    puts' copies, which run beside it on the node's machine, instead of taking one."""
    return await asyncio.get_running_loop().run_in_executor(
        background_thread("raykv-checksums"), function)


class ChecksumsAhead:
    """Pool's queue of host pages to hash. Uses the pool's index, memory tiers, disk and
    codec_id; `_queue_checksum` is called from Pool._on_event for every page that lands."""

    def _init_checksums(self) -> None:
        self._unsummed: deque[PageKey] = deque()
        self.checksums_ahead = 0  # pages hashed by checksum_ahead
        self.inline_checksums = 0  # pages demoted with no checksum yet (hashed on the write)

    def _wants_checksums(self) -> bool:
        return self.disk is not None and self.codec_id == 0

    @staticmethod
    def _awaits_checksum(entry: Entry | None) -> bool:
        """A page in the host tier with no checksum yet."""
        return entry is not None and entry.tier == HOST and entry.checksum is None

    def _queue_checksum(self, key: PageKey, entry: Entry | None, tier: int | None) -> None:
        """`entry`: the key's entry, looked up by the caller (Pool._on_event)."""
        if tier == HOST and self._awaits_checksum(entry) and self._wants_checksums():
            self._unsummed.append(key)
            if len(self._unsummed) > 2 * self._num_slots(HOST) + 64:
                self._compact_unsummed()

    def _compact_unsummed(self) -> None:
        """Keep only the keys still waiting (puts that outran the passes leave the queue
        with pages since gone or moved down): it stays within twice the host tier."""
        self._unsummed = deque(key for key in dict.fromkeys(self._unsummed)
                               if self._awaits_checksum(self.index.get(key)))

    @property
    def num_unsummed(self) -> int:
        """Keys waiting for checksum_ahead (some may have left the host tier since)."""
        return len(self._unsummed)

    async def checksum_ahead(self, max_bytes: int = BATCH_BYTES) -> int:
        """Hash the oldest queued host pages, about `max_bytes` of them, in a thread; returns
        how many got their checksum."""
        batch = self._next_unsummed(max(1, max_bytes // self.geometry.page_bytes))
        if not batch:
            return 0
        views = [self.memory[HOST].view(slot)[: self.geometry.page_bytes].numpy()
                 for _, _, slot, _ in batch]
        sums = await _on_hash_thread(lambda: [checksum(view) for view in views])
        done = 0
        for (key, entry, slot, generation), value in zip(batch, sums, strict=True):
            if (self.index.get(key) is entry and entry.tier == HOST and entry.slot == slot
                    and self.memory[HOST].generation(slot) == generation):
                entry.checksum = value
                done += 1
        self.checksums_ahead += done
        return done

    def _next_unsummed(self, max_pages: int) -> list[tuple]:
        """(key, entry, slot, generation) of up to `max_pages` queued pages still in host
        with no checksum; those gone, moved down or hashed already leave the queue."""
        batch = []
        while self._unsummed and len(batch) < max_pages:
            key = self._unsummed.popleft()
            entry = self.index.get(key)
            if not self._awaits_checksum(entry) or entry.state == State.PENDING:
                continue  # it is queued again if it comes back to host without one
            batch.append((key, entry, entry.slot, self.memory[HOST].generation(entry.slot)))
        return batch
