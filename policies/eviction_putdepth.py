"""recfreq with a discount for the pages deep in one put (policy "putdepth", raykv's
default)."""

from __future__ import annotations

import math

from policies.eviction_base import Key
from policies.eviction_recfreq import RecencyFrequencyPolicy

PUT_DEPTH_HORIZON_FACTOR = 1.8  # PutDepthPolicy's horizon, in median reuse distances
PUT_DEPTH_DISCOUNT = 0.06  # PutDepthPolicy: horizons lost per doubling of the put depth


class PutDepthPolicy(RecencyFrequencyPolicy):
    """`recfreq` with a discount for the pages deep in one put: on a prefix cache, a put
    that writes many new pages is less likely to be read again, page for page, than one that
    appends a short turn to a cached prefix.

        put depth   the parent's put depth + 1 when the parent is among the current put's
                    pages, else 1 (a new put); a read (on_access) ends the put
        discount    PUT_DEPTH_DISCOUNT x log2(put depth) horizons off the new page's bonus,
                    ranked from the clock at the put's first page
        horizon     PUT_DEPTH_HORIZON_FACTOR x the median first-reuse distance

    On Mooncake's conversation trace the chance that the k-th new page of a put is read
    again falls with k: 0.40 at k = 1, 0.31 at 2-3, 0.26 at 8-15, 0.21 at 64 and beyond. All
    of a put's pages rank from one clock and the discount grows with depth, so within a put
    the deeper page always leaves first (a leaf before its ancestors: evicting part of a put
    never strands the rest behind a missing parent), where recfreq lets a put's pages leave
    root first. A page read again loses its discount: its rank is recfreq's. Without parents
    (parent=None) no page is discounted. O(1) more per insert than recfreq; the put's depths
    are dropped when the next put starts.
    """

    horizon_factor = PUT_DEPTH_HORIZON_FACTOR

    def __init__(self, capacity_pages: int) -> None:
        super().__init__(capacity_pages)
        self._put_depth: dict[Key, int] = {}  # the current put's new pages -> put depth
        self._put_clock = 0  # the clock at the current put's first page

    _discounted = True

    def _insert_discount(self, key: Key, parent: Key, clock: int) -> float:
        depth = self._put_depth.get(parent, 0) + 1
        if depth == 1:  # the parent is not the current put's: a new put
            self._begin_put(key, clock)
            return 0.0
        self._put_depth[key] = depth
        # Ranked from the put's first tick, so that depth alone orders the put: leaves first.
        ticks_since_put = (clock - self._put_clock) / self.horizon
        return PUT_DEPTH_DISCOUNT * math.log2(depth) + ticks_since_put

    def _begin_put(self, key: Key, clock: int) -> None:
        # A page without a parent (or whose parent is not the current put's) has depth 1
        # and no discount: log2(1) = 0 and no tick since its own.
        self._put_depth = {key: 1}
        self._put_clock = clock

    def on_access(self, key: Key) -> None:
        if self._put_depth:
            self._put_depth = {}
        super().on_access(key)

