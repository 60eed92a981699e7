"""DirectoryIndex: where every page lives, as a pure object owned by one directory shard.

    index:  key -> {node_id: (tier, seq)}

Node actors send numbered batches of events (cluster/core/events.py). A batch is applied at
most once, in any order:

    per node:  epoch, watermark W (every seq <= W applied), applied seqs above W,
               tombstones key -> seq of removals, so an older `stored` cannot resurrect a page,
               digest: XOR of the node's keys here, and their count

A batch from an older epoch (a node that restarted) is fenced off. The answer RESYNC asks the
node for its whole inventory (replace_node), and is given when the shard cannot trust what it
holds for the node:
    - it does not know the node (purged as dead, a newer epoch, or it restarted empty);
    - W < the batch's acked_upto: batches it acknowledged are gone (it recovered from a stale
      Redis copy), so the gap below would never fill;
    - once every batch up to this one is applied, the node's digest differs from its own;
    - too many batches wait above a gap, or too many tombstones: memory stays bounded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import itemgetter

from cluster.core.events import APPLIED, DUPLICATE, FENCED, RESYNC, EventBatch, key_digest
from cluster.core.keys import PageKey

Location = tuple[str, int]  # (node_id, tier)
MAX_APPLIED_ABOVE_GAP = 256
MAX_TOMBSTONES = 65536

__all__ = ["APPLIED", "DUPLICATE", "FENCED", "RESYNC", "DirectoryIndex", "Location", "NodeLog"]


@dataclass(slots=True)
class NodeLog:
    epoch: int
    watermark: int = 0
    applied: set[int] = field(default_factory=set)
    tombstones: dict[PageKey, int] = field(default_factory=dict)
    keys: set[PageKey] = field(default_factory=set)
    last_seen_s: float = 0.0
    digest: int = 0

    def add_key(self, key: PageKey) -> None:
        if key not in self.keys:
            self.keys.add(key)
            self.digest ^= key_digest(key)

    def discard_key(self, key: PageKey) -> None:
        if key in self.keys:
            self.keys.discard(key)
            self.digest ^= key_digest(key)


def _places_of(index: dict, changes: list) -> Iterable:
    """index.get(key) of each change, as the loop over them reaches it. When no key repeats
    (an EventStream batch), all are looked up first, in C (`map`), so that their cache misses
    overlap: a change alters only its own key's places."""
    keys = list(map(_KEY, changes))
    if len(set(keys)) == len(keys):
        return list(map(index.get, keys))
    return (index.get(key) for key in keys)


_KEY = itemgetter(0)


def _ranked(places: dict[str, tuple[int, int]]) -> tuple[Location, ...]:
    """A key's (node, tier) places, best tier first (ties in the order the nodes came)."""
    if len(places) == 1:  # most keys: one holder, nothing to sort
        for node_id, (tier, _) in places.items():
            return ((node_id, tier),)
    return tuple(sorted(((n, t) for n, (t, _) in places.items()), key=lambda p: p[1]))


class DirectoryIndex:
    """Page locations, longest-prefix match, and per-node event fencing."""

    def __init__(self) -> None:
        self.index: dict[PageKey, dict[str, tuple[int, int]]] = {}
        # key -> its locations sorted best tier first; dropped whenever the key's places change
        self.ranked: dict[PageKey, tuple[Location, ...]] = {}
        self.nodes: dict[str, NodeLog] = {}

    # ---- events --------------------------------------------------------------------------

    def apply(self, batch: EventBatch, now_s: float = 0.0) -> str:
        """Apply one batch; returns APPLIED, DUPLICATE, FENCED or RESYNC."""
        node_id, seq = batch.node_id, batch.seq
        log = self.nodes.get(node_id)
        if log is not None and batch.epoch < log.epoch:
            return FENCED
        if log is None or batch.epoch > log.epoch or log.watermark < batch.acked_upto:
            return self._resync(node_id)
        log.last_seen_s = max(log.last_seen_s, now_s)
        if seq <= log.watermark or seq in log.applied:
            return DUPLICATE
        self._apply_changes(node_id, log, batch.changes, seq)
        log.applied.add(seq)
        self._advance(log)
        if len(log.applied) > MAX_APPLIED_ABOVE_GAP or len(log.tombstones) > MAX_TOMBSTONES:
            return self._resync(node_id)
        # Once every batch up to this one is in (and none beyond), the node's digest must be
        # ours: a difference means a lost batch or a drifted index.
        in_step = log.watermark == seq and not log.applied
        if in_step and (log.digest, len(log.keys)) != (batch.digest, batch.num_keys):
            return self._resync(node_id)
        return APPLIED

    def _resync(self, node_id: str) -> str:
        self.drop_node(node_id)
        return RESYNC

    def _apply_changes(self, node_id: str, log: NodeLog, changes: list, seq: int) -> None:
        """Batch `seq`'s changes: a store (key, tier) wins over an older state of the key, a
        removal (key, None) leaves a tombstone so that an older store cannot bring the page
        back. One loop with NodeLog.add_key/discard_key, _forget and key_digest inline: it
        runs for every change.

        A node holds a key here exactly when the key's places name the node (`log.keys` and
        `index` change together), so a store over the node's own place skips `log.keys`. In
        order (every batch below `seq` applied), a tombstone of this batch would be dropped
        as soon as it is applied (_advance keeps only those above the watermark), and no
        change of this batch can be older than it: none is written."""
        index, ranked, keys, tombstones = self.index, self.ranked, log.keys, log.tombstones
        keep_tombstones = seq != log.watermark + 1
        digest = log.digest
        from_bytes = int.from_bytes  # key_digest(key) is from_bytes(key, "little")
        for (key, tier), places in zip(changes, _places_of(index, changes), strict=True):
            current = places.get(node_id) if places else None
            if tier is None:
                if current is not None and current[1] > seq:
                    continue
                if keep_tombstones:
                    tombstone = tombstones.get(key)
                    if tombstone is None or tombstone < seq:
                        tombstones[key] = seq
                if current is not None:
                    del places[node_id]
                    ranked.pop(key, None)
                    if not places:
                        del index[key]
                    if key in keys:
                        keys.discard(key)
                        digest ^= from_bytes(key, "little")
                continue
            if tombstones and tombstones.get(key, -1) > seq:
                continue
            if current is None:
                if places is None:
                    places = index[key] = {}
                places[node_id] = (tier, seq)
                ranked.pop(key, None)
                if key not in keys:
                    keys.add(key)
                    digest ^= from_bytes(key, "little")
            elif current[1] < seq:
                places[node_id] = (tier, seq)
                ranked.pop(key, None)
            else:
                continue
            if keep_tombstones and tombstones:
                tombstones.pop(key, None)
        log.digest = digest

    def _forget(self, node_id: str, key: PageKey) -> None:
        places = self.index.get(key)
        if places is not None:
            places.pop(node_id, None)
            self.ranked.pop(key, None)
            if not places:
                del self.index[key]

    @staticmethod
    def _advance(log: NodeLog) -> None:
        before = log.watermark
        while log.watermark + 1 in log.applied:
            log.watermark += 1
            log.applied.discard(log.watermark)
        if log.tombstones and log.watermark > before:
            # A removal at seq <= W can no longer be overtaken by an older batch.
            log.tombstones = {k: s for k, s in log.tombstones.items() if s > log.watermark}

    # ---- membership ----------------------------------------------------------------------

    def drop_node(self, node_id: str) -> int:
        """Purge every location of a node (dead or restarted); returns how many."""
        log = self.nodes.pop(node_id, None)
        if log is None:
            return 0
        for key in log.keys:
            self._forget(node_id, key)
        return len(log.keys)

    def replace_node(self, node_id: str, epoch: int, inventory: list[tuple[PageKey, int]],
                     seq: int, now_s: float = 0.0) -> bool:
        """Install a node's full inventory (directory rebuild, or a node rejoining).

        False, changing nothing, when it comes from an older (fenced) epoch of the node.
        """
        log = self.nodes.get(node_id)
        if log is not None and epoch < log.epoch:
            return False
        self.drop_node(node_id)
        log = self.nodes[node_id] = NodeLog(epoch, watermark=seq, last_seen_s=now_s)
        for key, tier in inventory:
            self.index.setdefault(key, {})[node_id] = (tier, seq)
            self.ranked.pop(key, None)
            log.add_key(key)
        return True

    def expired_nodes(self, now_s: float, timeout_s: float) -> list[str]:
        """Nodes not heard from (events or heartbeats) for longer than `timeout_s`."""
        return [n for n, log in self.nodes.items() if now_s - log.last_seen_s > timeout_s]

    def node_inventory(self, node_id: str) -> list[tuple[PageKey, int]]:
        log = self.nodes.get(node_id)
        if log is None:
            return []
        return [(key, self.index[key][node_id][0]) for key in log.keys]

    # ---- queries -------------------------------------------------------------------------

    def prefix_runs(self, keys: list[PageKey]) -> list[list]:
        """Locations (best tier first) of the longest prefix of `keys` held anywhere, as runs
        `[locations, num_pages]`: a prefix stored by one put is one run, so the answer stays
        small however long the prompt."""
        runs: list[list] = []
        for key in keys:
            ranked = self.ranked.get(key)
            if ranked is None:
                places = self.index.get(key)
                if not places:
                    break
                ranked = self.ranked[key] = _ranked(places)
            if runs and runs[-1][0] == ranked:
                runs[-1][1] += 1
            else:
                runs.append([ranked, 1])
        return runs

    def holders(self, keys: tuple[PageKey, ...] | list[PageKey]) -> tuple[str, ...]:
        """Nodes holding every one of `keys` (any tier), sorted; () when none does."""
        common: set[str] | None = None
        index = self.index
        for key in keys:
            places = index.get(key)
            if not places:
                return ()
            if common is None:
                common = set(places)
            elif not places.keys() >= common:  # only then a new, smaller set
                common = common & places.keys()
                if not common:
                    return ()
        return tuple(sorted(common or ()))

    def stats(self) -> dict:
        return {"num_keys": len(self.index), "num_nodes": len(self.nodes),
                "nodes": {n: len(log.keys) for n, log in self.nodes.items()},
                "waiting_batches": sum(len(log.applied) for log in self.nodes.values()),
                "tombstones": sum(len(log.tombstones) for log in self.nodes.values())}
