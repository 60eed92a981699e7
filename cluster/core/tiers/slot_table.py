"""A request's pages as a slot table: one row per page, whole-array operations, no per-page loop.

    places   int64 [N, 3]: (tier, slot, generation) of pages 0..N-1 of a request
    runs     pages p..p+k-1 in slots s..s+k-1 of one tier, inside one chunk: one strided copy

    places   | (1, 40, 7) | (1, 41, 7) | (1, 42, 9) | (0, 3, 1) | (1, 9, 2) |
    runs     | page 0, host slots 40..42, 3 pages   | dev 3, 1  | host 9, 1 |

A get copies each run in one pass (a page of a run is a row of a [k, *page_shape] view of the
slab) and checks every page's generation with one gather per tier. A fresh put reserves
consecutive slots, so a request of N pages is usually one run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

TIER, SLOT, GENERATION = 0, 1, 2


@dataclass(frozen=True, slots=True)
class SlotRun:
    """Pages position..position+count-1 of a request, in slots first..first+count-1 of `tier`."""

    position: int
    tier: int
    first_slot: int
    count: int


def as_places(places: Sequence | np.ndarray) -> np.ndarray:
    """An int64 [N, 3] table of (tier, slot, generation) rows, from tuples or an array."""
    table = np.asarray(places, dtype=np.int64)
    return table.reshape(-1, 3) if table.size else np.empty((0, 3), dtype=np.int64)


def slot_runs(places: np.ndarray, slots_per_chunk: Sequence[int]) -> list[SlotRun]:
    """The runs of `places`, in page order: a run breaks where the tier changes, the slot is
    not the previous one's next, or a chunk boundary of the tier (`slots_per_chunk[tier]`)
    starts (chunks are separate allocations in the device tier)."""
    if not len(places):
        return []
    whole = _one_run(places, slots_per_chunk)
    if whole is not None:
        return [whole]
    tiers, slots = places[:, TIER], places[:, SLOT]
    per_chunk = np.asarray(slots_per_chunk, dtype=np.int64)[tiers]
    breaks = np.ones(len(places), dtype=bool)
    breaks[1:] = ((tiers[1:] != tiers[:-1]) | (slots[1:] != slots[:-1] + 1)
                  | (slots[1:] // per_chunk[1:] != slots[:-1] // per_chunk[:-1]))
    starts = np.flatnonzero(breaks)
    counts = np.diff(np.append(starts, len(places)))
    return [SlotRun(int(p), int(tiers[p]), int(slots[p]), int(k))
            for p, k in zip(starts.tolist(), counts.tolist(), strict=True)]


def _one_run(places: np.ndarray, slots_per_chunk: Sequence[int]) -> SlotRun | None:
    """All of `places` as one run (consecutive slots of one tier in one chunk, as a fresh put
    reserves them), else None: the common case, in a few scalar tests and one pass."""
    tier, first, count = int(places[0, TIER]), int(places[0, SLOT]), len(places)
    last, per_chunk = first + count - 1, slots_per_chunk[tier]
    if (int(places[-1, SLOT]) != last or int(places[-1, TIER]) != tier
            or first // per_chunk != last // per_chunk):
        return None
    if count > 2 and not (np.diff(places[:, :GENERATION], axis=0) == (0, 1)).all():
        return None
    return SlotRun(0, tier, first, count)


def num_unchanged(places: np.ndarray, generations: Sequence[np.ndarray]) -> int:
    """How many leading pages still hold the generation noted in `places`, with
    `generations[tier]` a tier's live generation table (one gather per tier)."""
    if not len(places):
        return 0
    changed = np.flatnonzero(~unchanged(places, generations))
    return int(changed[0]) if changed.size else len(places)


def unchanged(places: np.ndarray, generations: Sequence[np.ndarray]) -> np.ndarray:
    """Per page of `places`, whether its slot still holds the generation noted there
    (bool [N]; one gather per tier)."""
    tiers = places[:, TIER]
    if len(places) and (tiers == tiers[0]).all():  # one tier, as a rule: one gather
        return generations[int(tiers[0])][places[:, SLOT]].astype(np.int64) == \
            places[:, GENERATION]
    now = np.empty(len(places), dtype=np.int64)
    for tier in np.unique(tiers).tolist():
        rows = tiers == tier
        now[rows] = generations[tier][places[rows, SLOT]].astype(np.int64)
    return now == places[:, GENERATION]


class PlaceHints:
    """key -> (place, noted_s) for at most `capacity` keys: a ring of rows, the row noted
    longest ago reused first. A key noted again moves to a new row (its old row is emptied),
    so every key sits in at most one row and a lookup never answers another key's place.

        rows:   | k7 (1,40,7) t=3.1 | k8 (1,41,7) t=3.1 | -- | k2 (0,3,1) t=2.0 |
                                                             ^ next row to (re)use
    """

    def __init__(self, capacity: int):
        assert capacity > 0, "a hint table needs at least one row"
        self.capacity = capacity
        self._rows: dict[bytes, int] = {}
        self._keys = np.full(capacity, None, dtype=object)
        # Written now, not np.zeros' untouched pages: each of the first gets through the
        # ring would otherwise fault in its rows' pages (~50 us a 256-page get on this VM).
        self._places = np.full((capacity, 3), -1, dtype=np.int64)
        self._noted_s = np.full(capacity, -np.inf)
        self._next_row = 0

    def __len__(self) -> int:
        return len(self._rows)

    def prefix(self, keys: Sequence[bytes], oldest_s: float) -> np.ndarray:
        """The places of the longest prefix of `keys` noted at `oldest_s` or later."""
        if not keys or keys[0] not in self._rows:  # none noted (a first get): no array work
            return self._places[:0]
        rows = np.fromiter(map(self._rows.get, keys, repeat(-1)), dtype=np.int64,
                           count=len(keys))
        live = rows >= 0
        live[live] = self._noted_s[rows[live]] >= oldest_s
        dead = np.flatnonzero(~live)
        return self._places[rows[: dead[0] if dead.size else len(rows)]]

    def note(self, keys: Sequence[bytes], places: np.ndarray, now_s: float) -> None:
        """Note `places` (int64 [N, 3]) for `keys` as of `now_s`."""
        if len(keys) > self.capacity:
            keys, places = list(keys)[-self.capacity :], places[-self.capacity :]
        if not len(keys):
            return
        self.forget(keys)
        start, end = self._next_row, self._next_row + len(keys)
        # Consecutive rows as a rule (a slice and a range: no index arrays on a get's path);
        # wrapping past the end of the ring, an index array.
        rows = (slice(start, end) if end <= self.capacity
                else np.arange(start, end) % self.capacity)
        row_ids = range(start, end) if end <= self.capacity else rows.tolist()
        self._next_row = end % self.capacity
        # Keys noted longest ago: their hints go (filter(None) skips empty rows; a key is
        # never b"").
        deque(map(self._rows.pop, filter(None, self._keys[rows].tolist()), repeat(None)),
              maxlen=0)
        self._keys[rows] = keys
        self._places[rows] = places
        self._noted_s[rows] = now_s
        self._rows.update(zip(keys, row_ids, strict=True))

    def forget(self, keys: Sequence[bytes]) -> None:
        rows = np.fromiter(map(self._rows.pop, keys, repeat(-1)), dtype=np.int64,
                           count=len(keys))
        self._keys[rows[rows >= 0]] = None

    def clear(self) -> None:
        self._rows.clear()
        self._keys[:] = None
