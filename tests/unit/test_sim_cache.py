"""The global-cache simulator: hits are the directory's longest prefix, puts make room with the
policy's victims, a page whose ancestor left is stranded (not cascaded) until the ancestor is
stored again; and it runs the service's own policies and DirectoryIndex. No Ray."""

from __future__ import annotations

import pytest

from cluster.core import directory_index, pool, sim_cache
from cluster.core.sim_cache import GlobalCache
from policies import eviction
from policies.eviction import LRUPolicy, make_policy


def k(name: str) -> bytes:
    return name.encode().ljust(16, b".")


class Scripted(LRUPolicy):
    """LRU, except that the next victims can be forced (to strand a page on purpose)."""

    def __init__(self) -> None:
        super().__init__(1)
        self.forced: list[bytes] = []

    def victims(self, num_pages, is_pinned):
        forced = [key for key in self.forced if key in self][:num_pages]
        rest = super().victims(num_pages + len(forced), lambda x: x in forced)
        return (forced + rest)[:num_pages]


def test_lru_hits_and_room():
    cache = GlobalCache(make_policy("lru", 3), 3)
    assert cache.serve([k("a"), k("b")]) == 0
    assert cache.serve([k("a"), k("b"), k("c")]) == 2
    assert cache.serve([k("d")]) == 0  # full: LRU's oldest, a, goes
    assert cache.stored == {k("b"), k("c"), k("d")}
    assert set(cache.index.index) == cache.stored  # the directory saw every change
    assert cache.counters["evictions"] == 1 and cache.counters["inserts"] == 4


def test_a_page_whose_ancestor_left_is_stranded_then_revived():
    policy = Scripted()
    cache = GlobalCache(policy, 3)
    cache.serve([k("a"), k("b"), k("c")])
    policy.forced = [k("a")]
    cache.serve([k("x")])  # a goes; b and c stay stored, out of every lookup's reach
    assert cache.stored == {k("b"), k("c"), k("x")}
    policy.forced = [k("x")]
    assert cache.serve([k("a"), k("b"), k("c")]) == 0
    assert cache.counters["stranded_hits"] == 2  # b, c: stored but not reachable
    assert cache.serve([k("a"), k("b"), k("c")]) == 3  # a stored again: b and c hit again


def test_a_put_longer_than_the_cache_stores_its_first_pages():
    cache = GlobalCache(make_policy("s3fifo", 2), 2)
    cache.serve([k("a"), k("b"), k("c")])
    assert cache.stored == {k("a"), k("b")}
    with pytest.raises(ValueError, match="capacity_blocks"):
        GlobalCache(make_policy("lru", 1), 0)


def test_the_simulator_runs_the_services_own_code():
    # One registry and one index, shared by the node store's pools and the simulator.
    assert pool.make_policy is eviction.make_policy
    assert sim_cache.DirectoryIndex is directory_index.DirectoryIndex
    from cluster.tools import sim

    assert sim.EVICTION_POLICIES is eviction.EVICTION_POLICIES
    assert sim.GlobalCache is GlobalCache
