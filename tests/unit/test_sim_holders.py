"""The simulator's cache of DirectoryIndex.holders answers gives the index's own answer after
any sequence of stores, tier moves and removals. No Ray."""

from __future__ import annotations

import random

from cluster.core.directory_index import APPLIED, DirectoryIndex
from cluster.core.events import EventStream
from cluster.core.sim_holders import HoldersCache


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_kept_answers_match_the_index_through_random_changes():
    rng = random.Random(7)
    index = DirectoryIndex()
    streams = [EventStream(str(n), 1, 1) for n in range(4)]
    for stream in streams:
        batch = stream.resync(0, [])
        stream.on_resync(0, batch.seq, index.replace_node(stream.node_id, 1, [], batch.seq))
    cache = HoldersCache([index])
    prefixes = {k(100 + p): tuple(k(i) for i in range(p, p + 6)) for p in range(8)}
    held = [set() for _ in streams]
    for _ in range(400):
        node = rng.randrange(len(streams))
        keys = rng.sample(range(14), 3)
        for key in keys:
            if rng.random() < 0.4 and k(key) in held[node]:
                held[node].discard(k(key))
                streams[node].record(k(key), None)
            else:
                held[node].add(k(key))
                streams[node].record(k(key), rng.randrange(3))  # a store or a tier move
        for shard, batch in streams[node].outgoing():
            cache.before_apply(shard, streams[node].node_id, batch.changes)
            assert index.apply(batch) == APPLIED
            streams[node].on_status(shard, batch.seq, APPLIED)
        asked = rng.sample(sorted(prefixes), 4)
        cache.keep_only(0, asked)
        for prefix_id in asked:
            keys_of = prefixes[prefix_id]
            expected = tuple(sorted(str(n) for n in range(len(streams))
                                    if all(key in held[n] for key in keys_of)))
            assert cache.answer(0, prefix_id, keys_of) == index.holders(keys_of) == expected
        assert set(cache.kept[0]) <= set(asked)
