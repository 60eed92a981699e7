"""A free list of integer slot ids.

    free: [7, 3, 0]   <- pop() hands out 0, then 3, then 7
    used: {1, 2, 4, 5, 6}

Freed slots go to the end and are handed out last-in-first-out, which keeps the hot end of an
arena's memory warm (already faulted in) rather than touching cold pages.
"""

from __future__ import annotations


class SlotAllocator:
    """Hands out slot ids in [0, num_slots); None when full (an expected shortage)."""

    def __init__(self, num_slots: int) -> None:
        assert num_slots >= 0, f"num_slots must be >= 0, got {num_slots}"
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def claim_many(self, slots: list[int]) -> None:
        """Mark specific slots used (re-indexing a slab after a restart)."""
        wanted = set(slots)
        assert not wanted & self._used, "claiming slots already in use"
        assert all(0 <= slot < self.num_slots for slot in wanted), "slot out of range"
        self._used |= wanted
        self._free = [slot for slot in self._free if slot not in wanted]

    def free(self, slot: int) -> None:
        assert slot in self._used, f"double free of slot {slot}"
        self._used.remove(slot)
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)
