"""Elastic slot allocation: one byte budget per tier per node, handed to pools in chunks.

    TierBudget (one per tier per node)      capacity_bytes, and who holds how much
        |  take / give, chunk by chunk
    ChunkedSlots (one per pool per tier)    slots 0..num_slots-1 of one size, in chunks of
                                            slots_per_chunk; only slots of held chunks are used

    chunk 0: [s0 s1 s2 s3]  held: s1 used       chunk 2: not held (no memory behind it)
    chunk 1: [s4 s5 s6 s7]  held: all free  --> release(1): its memory goes back to the budget

A pool grows by one chunk when it needs a slot and the budget has room, and gives a chunk back
when all its slots are free (an idle model shrinking, or another model reclaiming memory).
The arena behind the slots backs a chunk with real memory on `on_grant` and lets it go on
`on_release` (shared memory is populated, then punched out; disk space fallocated, then
punched). Without a budget the slots behave as a plain free list over all of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass

log = logging.getLogger("raykv.tiers")

# What readying a chunk's memory raises when the machine has none to give: OSError (ENOSPC
# from a disk's fallocate, ENOMEM or ENOSPC from a shared-memory file), RuntimeError (a CUDA
# allocation error: cupy's CUDARuntimeError, after the start-up VRAM check, when an engine or
# another process took the memory since), MemoryError. Such a chunk is refused like one the
# budget has no room for: the caller's put goes to another tier or stores nothing, a claim
# after a restart drops its pages; neither fails.
NO_MEMORY = (OSError, RuntimeError, MemoryError)


class TierBudget:
    """The bytes one tier of one node may hold, shared by every pool of that tier."""

    def __init__(self, capacity_bytes: int):
        assert capacity_bytes >= 0, f"capacity_bytes must be >= 0, got {capacity_bytes}"
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        # Bytes of chunks given back but not freed yet (device chunks a client still maps:
        # device_chunks.py): no holder's, yet not free either.
        self.retired_bytes = 0
        self.holders: dict[Hashable, int] = {}
        self.caps: dict[Hashable, int] = {}  # holder -> the most it may hold (its quota's max)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes - self.retired_bytes

    def free_bytes_for(self, holder: Hashable) -> int:
        """What `holder` could still take: the free bytes, within its cap."""
        cap = self.caps.get(holder)
        if cap is None:
            return self.free_bytes
        return max(0, min(self.free_bytes, cap - self.holders.get(holder, 0)))

    def set_cap(self, holder: Hashable, max_bytes: int | None) -> None:
        if max_bytes is None:
            self.caps.pop(holder, None)
        else:
            self.caps[holder] = max_bytes

    def take(self, holder: Hashable, num_bytes: int) -> bool:
        if num_bytes > self.free_bytes_for(holder):
            return False
        self.used_bytes += num_bytes
        self.holders[holder] = self.holders.get(holder, 0) + num_bytes
        return True

    def give(self, holder: Hashable, num_bytes: int) -> None:
        held = self.holders.get(holder, 0)
        assert num_bytes <= held, f"{holder!r} gives back {num_bytes} bytes but holds {held}"
        self.used_bytes -= num_bytes
        if held == num_bytes:
            del self.holders[holder]
        else:
            self.holders[holder] = held - num_bytes


Hook = Callable[[int], None]  # chunk index -> back it with memory / let its memory go


@dataclass(frozen=True, slots=True)
class Share:
    """An arena's claim on a tier's budget: who holds its chunks, and their size."""

    budget: TierBudget
    holder: Hashable
    chunk_bytes: int


def slots_per_chunk(share: Share | None, capacity_bytes: int, slot_bytes: int) -> int:
    """Slots in one chunk: as many as `share.chunk_bytes` holds (at least one), or all of the
    capacity when there is no budget to share."""
    chunk_bytes = share.chunk_bytes if share is not None else max(capacity_bytes, slot_bytes)
    return max(1, chunk_bytes // slot_bytes)


class ChunkedSlots:
    """Slot ids of one pool in one tier, allocated from the chunks the pool holds.

    Freed slots are handed out again last-in-first-out, which keeps memory already touched
    warm. `num_free` counts the slots of held chunks plus what the budget could still grant.
    """

    def __init__(self, num_slots: int, slot_bytes: int, share: Share | None = None):
        capacity_bytes = num_slots * slot_bytes
        self.slots_per_chunk = slots_per_chunk(share, capacity_bytes, slot_bytes)
        assert num_slots >= 0, f"num_slots must be >= 0, got {num_slots}"
        self.num_slots = num_slots
        # What a chunk costs the budget: the slots it holds (the rest of a chunk is unused).
        self.chunk_bytes = self.slots_per_chunk * slot_bytes
        self.num_chunks = -(-num_slots // self.slots_per_chunk)
        self.budget = share.budget if share else TierBudget(self.num_chunks * self.chunk_bytes)
        self.holder = share.holder if share else id(self)
        self.on_grant: Hook = lambda chunk: None
        self.on_release: Hook = lambda chunk: None
        self._free: list[int] = []
        self._used_per_chunk: dict[int, int] = {}  # held chunk -> used slots
        self._used: set[int] = set()
        self._arriving: set[int] = set()  # taken from the budget, memory being readied
        self.grant_failures = 0  # chunks whose memory could not be readied (NO_MEMORY)

    # ---- slots -----------------------------------------------------------------------------

    def alloc(self) -> int | None:
        """A free slot, growing by one chunk if none is free; None when the budget is out."""
        if not self._free and not self.grow():
            return None
        slot = self._free.pop()
        self._used.add(slot)
        self._used_per_chunk[slot // self.slots_per_chunk] += 1
        return slot

    def free(self, slot: int) -> None:
        assert slot in self._used, f"double free of slot {slot}"
        self._used.remove(slot)
        self._used_per_chunk[slot // self.slots_per_chunk] -= 1
        self._free.append(slot)

    def claim_many(self, slots: list[int]) -> list[int]:
        """Mark specific slots used (re-indexing after a restart), taking their chunks from
        the budget; returns the slots that could not be claimed (no budget left, or their
        chunk's memory could not be readied)."""
        refused, claimed, failed = [], set(), set()
        for slot in sorted(slots):
            chunk = slot // self.slots_per_chunk
            assert 0 <= slot < self.num_slots and slot not in self._used, f"bad claim {slot}"
            if chunk not in self._used_per_chunk and (chunk in failed or not self._hold(chunk)):
                failed.add(chunk)  # (the budget does not change within this loop)
                refused.append(slot)
                continue
            claimed.add(slot)
            self._used.add(slot)
            self._used_per_chunk[chunk] += 1
        self._free = [slot for slot in self._free if slot not in claimed]
        return refused

    # ---- chunks ----------------------------------------------------------------------------

    def grow(self) -> bool:
        """Hold one more chunk (the lowest not held); False if none is left or no budget."""
        chunk = self._next_chunk()
        return chunk is not None and self._hold(chunk)

    def _next_chunk(self) -> int | None:
        return next((c for c in range(self.num_chunks)
                     if c not in self._used_per_chunk and c not in self._arriving), None)

    def alloc_held(self) -> int | None:
        """A free slot of a chunk already held (never growing: no memory is readied on the
        caller's path); None when none is free."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        self._used_per_chunk[slot // self.slots_per_chunk] += 1
        return slot

    @property
    def num_free_held(self) -> int:
        """Free slots of the chunks held (none that the budget would have to grant)."""
        return len(self._free)

    def take_ahead(self, ahead_slots: int = 0) -> int | None:
        """Take the next chunk from the budget ahead of need, when the held chunks have fewer
        than a chunk's worth of free slots (or `ahead_slots`, if more); its memory is
        readied by the caller (off the event loop), then open_ahead(chunk) hands out its
        slots. None: no need, or no room."""
        if len(self._free) >= max(self.slots_per_chunk, ahead_slots) or self._arriving:
            return None
        return self.take_now()

    def take_now(self) -> int | None:
        """Take the next chunk from the budget for a caller that needs its slots now (its
        memory readied off the event loop, then open_ahead(chunk), as take_ahead's); None: no
        chunk left or no budget."""
        chunk = self._next_chunk()
        if chunk is None or not self.budget.take(self.holder, self.chunk_bytes):
            return None
        self._arriving.add(chunk)
        return chunk

    def open_ahead(self, chunk: int) -> None:
        """The chunk taken ahead is ready: its slots join the free list (after the others)."""
        self._arriving.remove(chunk)
        self._used_per_chunk[chunk] = 0
        start = chunk * self.slots_per_chunk
        stop = min(start + self.slots_per_chunk, self.num_slots)
        self._free[:0] = range(stop - 1, start - 1, -1)  # used after the warm free slots

    def drop_ahead(self, chunk: int) -> None:
        """Readying the chunk failed: give its bytes back."""
        self._arriving.remove(chunk)
        self.budget.give(self.holder, self.chunk_bytes)

    def _hold(self, chunk: int) -> bool:
        if not self.budget.take(self.holder, self.chunk_bytes):
            return False
        try:
            self.on_grant(chunk)
        except NO_MEMORY as error:
            self.budget.give(self.holder, self.chunk_bytes)
            self.note_grant_failure(chunk, error)
            return False
        except BaseException:
            self.budget.give(self.holder, self.chunk_bytes)
            raise
        self._used_per_chunk[chunk] = 0
        start = chunk * self.slots_per_chunk
        stop = min(start + self.slots_per_chunk, self.num_slots)
        self._free.extend(range(stop - 1, start - 1, -1))  # the chunk's first slot goes first
        return True

    def note_grant_failure(self, chunk: int, error: BaseException) -> None:
        """Count a chunk whose memory could not be readied (logged once, then counted)."""
        self.grant_failures += 1
        (log.warning if self.grant_failures == 1 else log.debug)(
            "a chunk's memory could not be readied (chunk %d; %d so far), taken as no room: "
            "%s", chunk, self.grant_failures, error)

    def release(self, chunk: int) -> None:
        """Give back a held chunk whose slots are all free."""
        assert self._used_per_chunk.get(chunk) == 0, f"chunk {chunk} is not held or not empty"
        start = chunk * self.slots_per_chunk
        in_chunk = set(range(start, min(start + self.slots_per_chunk, self.num_slots)))
        self._free = [slot for slot in self._free if slot not in in_chunk]
        del self._used_per_chunk[chunk]
        self.on_release(chunk)
        self.budget.give(self.holder, self.chunk_bytes)

    def release_empty(self, max_chunks: int | None = None) -> int:
        """Give back held chunks with no used slot, at most `max_chunks` (None: every one);
        returns how many."""
        limit = None if max_chunks is None else max(0, max_chunks)
        empty = [c for c, used in self._used_per_chunk.items() if used == 0][:limit]
        for chunk in empty:
            self.release(chunk)
        return len(empty)

    def chunks_by_use(self) -> list[tuple[int, int]]:
        """Held chunks as (used slots, chunk), emptiest first."""
        return sorted((used, chunk) for chunk, used in self._used_per_chunk.items())

    def slots_of(self, chunk: int) -> range:
        start = chunk * self.slots_per_chunk
        return range(start, min(start + self.slots_per_chunk, self.num_slots))

    # ---- figures ---------------------------------------------------------------------------

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def num_free(self) -> int:
        """Free slots of held chunks, plus those the budget could still grant."""
        budget_chunks = self.budget.free_bytes_for(self.holder) // max(1, self.chunk_bytes)
        grantable = min(budget_chunks, self.num_chunks - len(self._used_per_chunk))
        free = len(self._free) + grantable * self.slots_per_chunk
        return min(self.num_slots - self.num_used, free)

    @property
    def num_held_chunks(self) -> int:
        return len(self._used_per_chunk)

    @property
    def held_bytes(self) -> int:
        return len(self._used_per_chunk) * self.chunk_bytes
