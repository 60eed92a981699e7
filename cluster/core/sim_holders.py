"""The cluster simulator's cache of DirectoryIndex.holders answers, for the control loop.

Every snapshot asks each shard which nodes hold every page of its most demanded prefixes
(sim_control.snapshot, as actors/control_loop.py asks): a walk over each prefix's keys, up to
1,024 of them, twice a second of simulated time. Most of those answers do not change between
snapshots. This keeps each answer, computed by the shard's own DirectoryIndex.holders, until a
batch changes whether some node holds one of that prefix's keys (a store on a node that did
not hold the key, or a removal from one that did; a move between tiers changes nothing).

    answer(shard, prefix_id, keys)       the kept answer, else holders(keys), kept and watched
    before_apply(shard, node_id, changes)  before a batch is applied: drop the answers whose
                                         keys it adds to or takes from a node
    keep_only(shard, prefix_ids)         drop the answers of prefixes no longer asked for
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import itemgetter

from cluster.core.directory_index import DirectoryIndex
from cluster.core.keys import PageKey

_KEY = itemgetter(0)  # a change's key


class HoldersCache:
    """holders() answers per shard, exact: see the module doc."""

    def __init__(self, shards: Sequence[DirectoryIndex]) -> None:
        self.shards = shards
        self.kept: list[dict[PageKey, tuple[tuple, tuple[str, ...]]]] = [{} for _ in shards]
        self.watch: list[dict[PageKey, set[PageKey]]] = [{} for _ in shards]

    def answer(self, shard: int, prefix_id: PageKey, keys: tuple) -> tuple[str, ...]:
        kept = self.kept[shard].get(prefix_id)
        if kept is not None and (kept[0] is keys or kept[0] == keys):
            return kept[1]
        if kept is not None:
            self._drop(shard, prefix_id)
        holders = self.shards[shard].holders(keys)
        self.kept[shard][prefix_id] = (keys, holders)
        watch = self.watch[shard]
        for key in keys:
            watched = watch.get(key)
            if watched is None:
                watch[key] = {prefix_id}
            else:
                watched.add(prefix_id)
        return holders

    def before_apply(self, shard: int, node_id: str, changes: Iterable) -> None:
        watch = self.watch[shard]
        if not watch:
            return
        index = self.shards[shard].index
        changes = changes if isinstance(changes, list) else list(changes)
        # Most changes touch no watched key: found in C (`map`). A set found here and
        # emptied by a drop below drops nothing more, as a key no longer watched would not.
        found = zip(changes, map(watch.get, map(_KEY, changes)), strict=True)
        for (key, tier), watched in [(c, w) for c, w in found if w is not None]:
            places = index.get(key)
            if (places is not None and node_id in places) != (tier is not None):
                for prefix_id in list(watched):
                    self._drop(shard, prefix_id)

    def keep_only(self, shard: int, prefix_ids: Iterable[PageKey]) -> None:
        wanted = set(prefix_ids)
        for prefix_id in [p for p in self.kept[shard] if p not in wanted]:
            self._drop(shard, prefix_id)

    def _drop(self, shard: int, prefix_id: PageKey) -> None:
        keys, _ = self.kept[shard].pop(prefix_id)
        watch = self.watch[shard]
        for key in keys:
            watched = watch.get(key)
            if watched is not None:
                watched.discard(prefix_id)
                if not watched:
                    del watch[key]
