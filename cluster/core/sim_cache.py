"""One global cache of C blocks, driven per request as raykv's node store drives a tier, with
raykv's own eviction policy and its own directory index deciding.

Per request (a chain of page keys, root first):

    lookup    DirectoryIndex.prefix_runs(keys): the longest prefix the cache holds (hits)
    get       policy.on_access(key) for each hit page, in chain order (Pool.acquire does so)
    put       the pages not stored (Pool.reserve skips stored ones, without an access):
              policy.victims(shortfall, is_pinned=never) makes room first, each victim goes
              (policy.on_remove), then each new page is inserted (policy.on_insert, with
              the put's previous new page as its parent, None for the first, as
              Pool.commit passes it); at most C new pages per request
    events    every change goes through the node's EventStream into the DirectoryIndex, as
              the node actor sends it to its directory shard

A policy's victim need not be a leaf. As in the service, nothing cascades: a page whose
ancestor left stays stored, taking room, but no lookup reaches it (prefix_runs stops at the
first missing page) until a later put stores the ancestor again; then it hits once more. The
engine reads its prefix into its own buffer before it prefills and puts (aget with out=), so
nothing of the request is pinned while room is made.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.core.directory_index import APPLIED, DirectoryIndex
from cluster.core.events import EventStream
from cluster.core.geometry import HOST
from cluster.core.keys import PageKey
from policies.eviction import EvictionPolicy, IsPinned, PerKeyBatches

NODE_ID = "global"


def _never(_key: PageKey) -> bool:
    return False


class GlobalCache:
    """A cache of `capacity_blocks` pages under one eviction policy, with a directory."""

    def __init__(self, policy: EvictionPolicy, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.policy = policy
        self.capacity_blocks = capacity_blocks
        self.stored: set[PageKey] = set()
        self.index = DirectoryIndex()
        self.stream = EventStream(NODE_ID, epoch=1, num_shards=1)
        batch = self.stream.resync(0, [])
        accepted = self.index.replace_node(NODE_ID, 1, [], batch.seq)
        self.stream.on_resync(0, batch.seq, accepted)
        self.counters = {"evictions": 0, "inserts": 0, "stranded_hits": 0}

    def serve(self, keys: Sequence[PageKey]) -> int:
        """One request: its hit pages (the longest stored prefix), then its put."""
        num_hit = sum(num_pages for _, num_pages in self.index.prefix_runs(list(keys)))
        for key in keys[:num_hit]:
            self.policy.on_access(key)
        fresh = [k for k in dict.fromkeys(keys[num_hit:]) if k not in self.stored]
        # Stored pages past the first miss: kept, but their ancestor had left.
        self.counters["stranded_hits"] += len(keys) - num_hit - len(fresh)
        fresh = fresh[: self.capacity_blocks]
        shortfall = len(self.stored) + len(fresh) - self.capacity_blocks
        if shortfall > 0:
            self._evict(shortfall)
        parent = None
        for key in fresh[: self.capacity_blocks - len(self.stored)]:
            self.stored.add(key)
            self.policy.on_insert(key, parent)
            parent = key
            self.stream.record(key, HOST)
            self.counters["inserts"] += 1
        self._sync()
        return num_hit

    def _evict(self, num_pages: int) -> None:
        for key in self.policy.victims(num_pages, _never):
            self.policy.on_remove(key)
            self.stored.discard(key)
            self.stream.record(key, None)
            self.counters["evictions"] += 1

    def _sync(self) -> None:
        for shard, batch in self.stream.outgoing():
            status = self.index.apply(batch)
            self.stream.on_status(shard, batch.seq, status)
            if status != APPLIED:
                raise RuntimeError(f"the directory answered {status} to batch {batch.seq}")


class DeadFirstLRU(PerKeyBatches):
    """An oracle, not a policy raykv can run: told at each use of a page whether any later
    request will hold it, it evicts the pages never used again first (the longest dead
    first), and the others least recently used first. It shows how much of Belady's lead
    comes from knowing which pages are dead, under the same GlobalCache as the policies.

    `dead_first_lru_hits` tells it, before each request, the next use of each of its pages
    (`told`); a page the request holds but does not touch (one stored past a miss) keeps
    what it was told before.
    """

    def __init__(self) -> None:
        self.told: dict[PageKey, bool] = {}  # page -> used again later (this request's)
        self._live: dict[PageKey, None] = {}  # least recently used first
        self._dead: dict[PageKey, None] = {}  # dead longest first

    def _place(self, key: PageKey) -> None:
        self._live.pop(key, None)
        self._dead.pop(key, None)
        (self._live if self.told.get(key, True) else self._dead)[key] = None

    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        self._place(key)

    def on_access(self, key: PageKey) -> None:
        if key in self._live or key in self._dead:
            self._place(key)

    def on_remove(self, key: PageKey) -> None:
        self._live.pop(key, None)
        self._dead.pop(key, None)

    def victims(self, num_pages: int, is_pinned: IsPinned) -> list[PageKey]:
        out: list[PageKey] = []
        for queue in (self._dead, self._live):
            for key in queue:
                if len(out) >= num_pages:
                    return out
                if not is_pinned(key):
                    out.append(key)
        return out

    def __len__(self) -> int:
        return len(self._live) + len(self._dead)


def dead_first_lru_hits(chains: Sequence[Sequence[PageKey]], capacity_blocks: int) -> list[int]:
    """Hit pages per request of the DeadFirstLRU oracle in a GlobalCache of capacity_blocks."""
    from cluster.core.belady import next_uses

    never = len(chains)
    oracle = DeadFirstLRU()
    cache = GlobalCache(oracle, capacity_blocks)
    hits: list[int] = []
    for chain, uses in zip(chains, next_uses(chains), strict=True):
        oracle.told = {key: use < never for key, use in zip(chain, uses, strict=True)}
        hits.append(cache.serve(chain))
    return hits
