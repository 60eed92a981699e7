"""putdepth, raykv's default eviction policy: recfreq with a discount for pages deep in one put.
Its rules, the parent that Pool.commit and the global-cache simulator pass it, and that it
is the default. No Ray."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.core.config import CacheConfig
from cluster.core.geometry import DEVICE, HOST
from cluster.core.pool_limits import PoolLimits
from cluster.core.sim_cache import GlobalCache
from cluster.core.sim_cluster import SimNode
from policies import eviction
from policies.eviction import PutDepthPolicy, RecencyFrequencyPolicy
from tests.unit._pages import key
from tests.unit._pool_harness import put, read, run


def never(_key) -> bool:
    return False


def put_chain(policy, keys) -> None:
    """One put's new pages, root first, each with the previous one as its parent."""
    parent = None
    for page in keys:
        policy.on_insert(page, parent)
        parent = page


def test_a_puts_deeper_pages_leave_first():
    policy = PutDepthPolicy(64)
    put_chain(policy, [key(i) for i in range(5)])
    assert policy.victims(5, never) == [key(i) for i in (4, 3, 2, 1, 0)]


def test_the_discount_is_log2_of_the_put_depth_in_horizons():
    policy = PutDepthPolicy(64)  # median reuse distance 64: horizon 1.8 x 64
    assert policy.horizon == pytest.approx(eviction.PUT_DEPTH_HORIZON_FACTOR * 64)
    put_chain(policy, [key(i) for i in range(4)])
    first_clock = 1
    for depth in range(1, 5):
        priority = policy._rank[key(depth - 1)][0]
        expected = first_clock - policy.horizon * eviction.PUT_DEPTH_DISCOUNT * math.log2(depth)
        assert priority == pytest.approx(expected)


def test_the_first_page_of_a_put_is_ranked_as_recfreq_ranks_it():
    # A one-page put (the depth-1 page of any put): no discount, the recfreq rank.
    policy, plain = PutDepthPolicy(16), RecencyFrequencyPolicy(16)
    plain.horizon_factor = eviction.PUT_DEPTH_HORIZON_FACTOR
    plain.horizon = policy.horizon
    for i in range(6):
        policy.on_insert(key(i), None)
        plain.on_insert(key(i))
    for i in (1, 3, 3):
        policy.on_access(key(i))
        plain.on_access(key(i))
    assert policy.victims(6, never) == plain.victims(6, never)


def test_a_read_ends_the_put_and_a_reused_page_loses_its_discount():
    policy = PutDepthPolicy(64)
    put_chain(policy, [key(0), key(1), key(2)])  # one put: depths 1, 2, 3
    policy.on_access(key(0))  # the next request reads its prefix: the put is over
    policy.on_insert(key(3), key(2))  # its parent is from the last put: depth 1 again
    assert policy._put_depth == {key(3): 1}
    ranks = {k: policy._rank[k][0] for k in (key(1), key(2), key(3))}
    assert ranks[key(3)] == pytest.approx(4)  # clock 4, no discount
    assert ranks[key(2)] < ranks[key(1)] < 1  # still discounted, from the put's clock 1
    policy.on_access(key(2))  # a second use: recfreq's bonus, no discount
    assert policy._rank[key(2)][0] == pytest.approx(4 + policy.horizon)


def test_a_page_whose_parent_is_another_puts_starts_a_new_put():
    policy = PutDepthPolicy(64)
    put_chain(policy, [key(0), key(1)])
    put_chain(policy, [key(10), key(11)])  # parent None: a new put
    policy.on_insert(key(2), key(1))  # key(1) belonged to the put before: depth 1
    assert policy._put_depth == {key(2): 1}
    assert policy._rank[key(2)][0] == pytest.approx(5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=6), min_size=1, max_size=10))
def test_no_page_leaves_before_its_descendants(paths):
    """Prompts put (new pages with their parents) and read again root first, no removals:
    every ancestor leaves after all its descendants, the pages only written included
    (recfreq lets those leave root first)."""
    policy = PutDepthPolicy(64)
    for path in [*paths, *paths]:
        chain = [tuple(path[: i + 1]) for i in range(len(path))]
        parent = None
        for page in chain:
            if page in policy:
                policy.on_access(page)
            else:
                policy.on_insert(page, parent)
                parent = page
    order = policy.victims(len(policy), never)
    position = {page: i for i, page in enumerate(order)}
    for page, at in position.items():
        for depth in range(1, len(page)):
            assert position[page[:depth]] > at, (page, order)


class Recording(PutDepthPolicy):
    def __init__(self, capacity_pages: int) -> None:
        super().__init__(capacity_pages)
        self.inserts: list[tuple[object, object]] = []

    def on_insert_many(self, keys, parent=None, chained=False) -> None:
        # on_insert comes here too (one key): every insert, with the parent it is given
        first = parent
        for page in keys:
            self.inserts.append((page, parent))
            parent = page if chained else None
        super().on_insert_many(keys, first, chained)


def test_the_simulator_passes_the_puts_previous_new_page_as_parent():
    policy = Recording(8)
    cache = GlobalCache(policy, 8)
    a, b, c, d = (key(i) for i in range(4))
    cache.serve([a, b])
    cache.serve([a, b, c, d])  # a, b hit; c, d new
    assert policy.inserts == [(a, None), (b, a), (c, None), (d, c)]


def test_the_cluster_simulator_passes_parents_on_puts_only():
    node = SimNode([2, 8, 0], "putdepth")
    device, host = Recording(2), Recording(8)
    node.policies[DEVICE], node.policies[HOST] = device, host
    a, b, c = (key(i) for i in range(3))
    node.put([a, b, c])  # a, b fill the device tier, c spills into host
    assert device.inserts == [(a, None), (b, a)] and host.inserts == [(c, None)]
    node.put([key(9)])  # room for it on the device: b, the deepest, goes down to host
    assert host.inserts[-1] == (b, None)  # a move, not a put: no parent


def test_pool_commit_passes_the_puts_previous_new_page_as_parent(harness):
    pool = harness.make(device_pages=8, host_pages=8, disk_pages=0, eviction="putdepth")
    recording = Recording(8)
    pool.policies[0] = recording  # the device tier, where puts land

    async def scenario():
        await put(pool, [0, 1])
        assert len(await read(pool, [0, 1])) == 2
        await put(pool, [0, 1, 2, 3])  # 0, 1 stored: skipped

    run(scenario())
    assert recording.inserts == [(key(0), None), (key(1), key(0)),
                                 (key(2), None), (key(3), key(2))]


def test_putdepth_is_the_default_and_recfreq_stays_registered():
    assert CacheConfig.model_fields["eviction"].default == "putdepth"
    assert PoolLimits(1, 1, 1).eviction == "putdepth"
    assert eviction.EVICTION_POLICIES["putdepth"] is PutDepthPolicy
    assert eviction.EVICTION_POLICIES["recfreq"] is RecencyFrequencyPolicy
