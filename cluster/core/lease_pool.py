"""A client's side of its slot lease (cluster/core/put_leases.py): the free slots it holds
ahead of its puts, and the pages it wrote that wait for their commit.

    free      | (1,40,7) | (1,41,7) | (1,42,7) | (1,43,7) |    leased, not written yet
                 take(2) -^----------^                            -> a put copies into these
    written   [(k1, (1,40)), (k2, (1,41))]                        -> the next leased-put call

The client's clock bounds the lease from its side: a lease granted by a call sent at s lasts
until s + lease_s at the node, at the latest. Slots are taken only while `margin_s` of that
remains, so a put does not copy into slots about to lapse (its fence would refuse them
anyway; this only saves the wasted copy). Near the end, the holder asks for a renewal.

How many slots to hold: twice the largest put seen (so one put's slots are ready while the
last one's top-up is in flight), and one put more each time puts outran the top-ups and found
a live lease dry (a burst of puts into fresh memory: each top-up's slots are faulted in by the
node and then by this client, ~15x the copy on 2 cores), within [min_pages, max_pages].
"""

from __future__ import annotations

import numpy as np

from cluster.core.tiers.slot_table import SLOT, TIER, as_places


class LeasePool:
    """Pure accounting; the caller holds whatever lock its threads need."""

    def __init__(self, min_pages: int, max_pages: int, margin_s: float):
        assert 0 <= min_pages <= max_pages, f"min_pages {min_pages} > max_pages {max_pages}"
        self.min_pages = min_pages
        self.max_pages = max_pages
        self.margin_s = margin_s
        self.lease_id = 0  # 0: none yet (the node never issues it)
        self.deadline_s = float("-inf")
        self.free = as_places([])
        self.target = min_pages
        self.short = False  # a put found too few slots since the last answer
        self._keys: list = []
        self._places: list[np.ndarray] = []

    # ---- the put's side ------------------------------------------------------------------

    def take(self, count: int, now_s: float) -> np.ndarray | None:
        """`count` leased slots as an int64 [count, 3] slot table, or None when fewer are
        held or the lease is too near its end. A shortage raises the target: to twice the
        put, and, when a live lease ran dry (puts came faster than its top-ups), by one more
        put, so that the next burst of as many puts finds its slots held (within max_pages)."""
        self.target = min(self.max_pages, max(self.target, 2 * count))
        if count == 0 or count > len(self.free) or not self.is_live(now_s):
            if count > len(self.free) and self.is_live(now_s):
                self.target = min(self.max_pages, self.target + count)
            self.short = self.short or (count > 0 and self.max_pages > 0)
            return None
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def wrote(self, keys: list, places: np.ndarray) -> None:
        """`keys[i]` was copied into `places[i]` (taken from this pool): commit it next."""
        assert len(keys) == len(places), f"{len(keys)} keys for {len(places)} slots"
        self._keys.extend(keys)
        self._places.append(as_places(places))

    def give_back(self, places: np.ndarray) -> None:
        """Taken slots that were not written after all: free again."""
        self._add_free(as_places(places))

    def lapsed(self) -> None:
        """The lease is gone (a failed call, or slots this process cannot map): forget it
        and its slots, and ask for a fresh one with the next call (which the caller paces)."""
        self.free = as_places([])
        self.lease_id = 0
        self.deadline_s = float("-inf")
        self.short = self.max_pages > 0

    def keep_free(self, mask: np.ndarray) -> None:
        """Keep only the free slots where `mask` is True (the rest moved: revoked)."""
        self.free = self.free[np.asarray(mask, dtype=bool)]

    def revoked(self, places) -> None:
        """The node took these leased slots back, as (tier, slot, generation) as leased:
        forget them (a slot leased again since, at a new generation, stays)."""
        gone = as_places(places)
        if not len(gone) or not len(self.free):
            return
        self.free = self.free[~_rows_in(self.free, gone)]

    # ---- the call's side -----------------------------------------------------------------

    def is_live(self, now_s: float) -> bool:
        return now_s < self.deadline_s - self.margin_s

    def num_written(self) -> int:
        return len(self._keys)

    def want(self) -> int:
        """How many more slots to ask for (0 when the pool is full enough)."""
        return max(0, min(self.target, self.max_pages) - len(self.free))

    def top_up(self) -> int:
        """How many more slots the next call asks for: want() when it commits writes or a
        put found the lease short, else 0 (a renewal only: an idle client's lease, taken
        back by a node short of room, does not grow again until a put needs it)."""
        return self.want() if (self._keys or self.short) else 0

    def needs_call(self, now_s: float) -> bool:
        """Whether a leased-put call is due: writes to commit, a put that found too few
        slots, or a lease with slots in hand that is near its end (renewed by any call)."""
        return bool(self._keys) or (self.short and self.want() > 0) or (
            len(self.free) > 0 and not self.is_live(now_s))

    def take_written(self) -> tuple[list, np.ndarray]:
        """The writes to commit in the call about to go: (keys, their places as an int64
        [N, 3] slot table)."""
        keys = self._keys
        places = np.concatenate(self._places) if self._places else as_places([])
        self._keys, self._places = [], []
        return keys, places

    def granted(self, lease_id: int, places, sent_s: float, lease_s: float,
                revoked=(), asked: int = 0) -> None:
        """A call sent at `sent_s` that asked for `asked` more slots came back: lease
        `lease_id` (renewed for `lease_s`), these newly leased places, and those the node
        took back (`revoked`). Another lease id than ours means ours lapsed: the slots we
        held are gone. Fewer places than asked leave the lease short: asked again, paced by
        the caller (the node readies more room after each call)."""
        if lease_id != self.lease_id:
            self.free = as_places([])
            self.lease_id = lease_id
        self.revoked(revoked)
        self._add_free(as_places(places))
        self.short = (self.short or len(places) < asked) and self.want() > 0
        self.deadline_s = sent_s + lease_s

    def _add_free(self, places: np.ndarray) -> None:
        if not len(places):
            return
        merged = np.concatenate([self.free, places])
        order = np.lexsort((merged[:, SLOT], merged[:, TIER]))  # runs of consecutive slots
        self.free = merged[order]


def _rows_in(table: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Per row of `table` (int64 [N, 3]), whether it is one of `rows` (all three columns)."""
    row_type = np.dtype((np.void, table.dtype.itemsize * table.shape[1]))
    return np.isin(np.ascontiguousarray(table).view(row_type).ravel(),
                   np.ascontiguousarray(rows, dtype=table.dtype).view(row_type).ravel())
