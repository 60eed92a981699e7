"""What a router sent where, for the seconds before the directory hears of it.

A request's pages reach the directory only after its engine has computed and stored them, and
the node's event batch has been applied: on a loaded machine, a few hundred milliseconds. A
second request with the same prefix routed in that window would find no hit in the directory
and go anywhere, and its replica would recompute the prefix. So the router remembers, for a
short time, which node it sent each page key to, and counts those pages as held there (in the
node's top tier) past the end of the directory's answer. This is the routing-time prediction
that Dynamo's router makes when it runs without KV events (its approximate indexer, entries
expiring after a TTL) and that Ray Serve's PrefixCacheAffinityRouter makes from its tree.

A wrong guess (the request failed, or the pages were never stored) costs one recompute on the
chosen replica; it lasts at most `ttl_s`. The directory's answer always comes first: only pages
past its longest prefix are predicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEVICE_TIER = 0  # the tier a just-computed page is put in first (cluster/core/pool.py)


class RoutedPrefixes:
    """A bounded, expiring map: page key -> (node id, expiry in seconds)."""

    def __init__(self, ttl_s: float = 3.0, max_keys: int = 65_536) -> None:
        if ttl_s <= 0 or max_keys <= 0:
            raise ValueError("ttl_s and max_keys must be positive")
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._routed: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._routed)

    def record(self, keys: Sequence[bytes], node_id: str, now_s: float) -> None:
        """The request with these page keys was sent to a replica on `node_id`."""
        expires_s = now_s + self.ttl_s
        for key in keys:
            self._routed[key] = (node_id, expires_s)
            self._routed.move_to_end(key)
        while len(self._routed) > self.max_keys:
            self._routed.popitem(last=False)

    def extend(self, located: list, keys: Sequence[bytes], now_s: float) -> list:
        """`located` (the directory's (node, tier) places per page of the longest cached
        prefix) lengthened by the pages after it that were routed to one node within the
        TTL: each as held in that node's top tier. The pages' run shares one places tuple,
        as a directory answer's run does."""
        self._expire(now_s)
        node_id, count = None, 0
        for key in keys[len(located):]:
            entry = self._routed.get(key)
            if entry is None or (node_id is not None and entry[0] != node_id):
                break
            node_id, count = entry[0], count + 1
        if not count:
            return located
        places = ((node_id, DEVICE_TIER),)
        return [*located, *([places] * count)]

    def _expire(self, now_s: float) -> None:
        # Entries are in order of recording, so their expiries are ascending.
        while self._routed:
            _, (_, expires_s) = next(iter(self._routed.items()))
            if expires_s > now_s:
                return
            self._routed.popitem(last=False)
