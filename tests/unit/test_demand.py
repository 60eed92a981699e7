"""The directory's demand tracker (cluster/core/demand.py) and what the control loop reads next
to it: holders of a chain, and the store's geometry_of / discard."""

from __future__ import annotations

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.core.demand import PrefixDemand
from cluster.core.directory_index import DirectoryIndex
from cluster.core.events import EventBatch
from tests.unit._pages import GEOMETRY, key
from tests.unit._pool_harness import run, store_put

K = [bytes([i]) * 16 for i in range(12)]


def test_deepest_match_is_tracked_with_its_chain_and_ancestors_are_credited():
    demand = PrefixDemand()
    demand.record(K[:6], 3, 0.0)  # matched K0..K2
    demand.record(K[:6], 3, 0.0)
    demand.record(K[:2] + K[7:9], 4, 0.0)  # another chain
    demand.record(K[:6], 5, 0.0)  # deeper: credits K2's entry on its way
    demand.record(K[:6], 0, 0.0)  # a miss: nothing
    top = {key: (keys, n) for key, keys, n in demand.top(10)}
    assert top == {K[2]: (tuple(K[:3]), 3), K[8]: ((K[0], K[1], K[7], K[8]), 1),
                   K[4]: (tuple(K[:5]), 1)}


def test_top_orders_by_recent_demand_not_by_total():
    demand = PrefixDemand(half_life_s=1.0)
    for _ in range(10):
        demand.record([K[1]], 1, 0.0)  # ten requests long ago
    for _ in range(3):
        demand.record([K[2]], 1, 20.0)  # three now
    assert [key for key, _, _ in demand.top(2)] == [K[2], K[1]]
    assert [n for _, _, n in demand.top(2)] == [3, 10]


def test_full_tracker_drops_its_coldest_quarter_and_keeps_the_hot():
    demand = PrefixDemand(max_entries=8, half_life_s=10.0)
    for _ in range(5):
        demand.record([K[0]], 1, 0.0)
    for i in range(1, 8):
        demand.record([K[i]], 1, float(i))
    demand.record([K[9]], 1, 9.0)  # full: drops 2 (the oldest one-offs K1, K2)
    tracked = {key for key, _, _ in demand.top(100)}
    assert K[0] in tracked and K[9] in tracked and {K[1], K[2]}.isdisjoint(tracked)
    assert demand.stats() == {"tracked_prefixes": 7, "evicted_prefixes": 2}


def test_holders_hold_every_key_of_the_chain():
    index = DirectoryIndex()
    index.replace_node("a", 1, [(K[0], 1), (K[1], 1), (K[2], 2)], 1)
    index.replace_node("b", 1, [(K[0], 0), (K[1], 1)], 1)
    index.apply(EventBatch("c", 1, 1, [(K[0], 1)], 0, 0, 0), 0.0)  # unknown: RESYNC, no keys
    assert index.holders(K[:2]) == ("a", "b")
    assert index.holders(K[:3]) == ("a",)
    assert index.holders(K[:4]) == ()
    assert index.holders(()) == ()


def test_store_geometry_of_and_discard_skip_pinned_pages(stores):
    store = stores.make()
    keys = [key(i) for i in range(3)]

    async def scenario():
        assert await store_put(store, [0, 1, 2]) == 3
        lease_id, located = await store.acquire(GEOMETRY, keys[:1])  # pins the first page
        assert len(located) == 1
        assert store.geometry_of(keys[2]) == GEOMETRY and store.geometry_of(K[11]) is None
        dropped = store.discard(GEOMETRY, keys)
        store.release(lease_id)
        return dropped

    assert run(scenario()) == 2
    assert store.has(GEOMETRY, keys[0]) and not store.has(GEOMETRY, keys[1])
    assert stores.events(store).drain() == {keys[0]: 0, keys[1]: None, keys[2]: None}
    assert store.discard(GEOMETRY, keys) == 1 and not store.has(GEOMETRY, keys[0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 6), min_size=1, max_size=5),
                          st.integers(0, 5), st.integers(0, 3)), max_size=60),
       st.integers(0, 10))
def test_top_is_nlargest_by_score_ties_in_entry_order(records, limit):
    """top() as heapq.nlargest over the entries by score (the plain way), ties included:
    requests at equal times give equal scores."""
    demand = PrefixDemand(max_entries=8)
    for path, num_matched, now_s in records:
        chain = [bytes(path[: i + 1]) for i in range(len(path))]
        demand.record(chain, num_matched, float(now_s))
    plain = heapq.nlargest(limit, demand.entries.items(), key=lambda item: item[1].log_score)
    assert demand.top(limit) == [(k, e.keys, e.num_requests) for k, e in plain]
