"""Belady's prefix-closed optimum against a brute force over every cache content, and against
every raykv eviction policy run through the global-cache simulator. No Ray."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.core.belady import belady_hits, next_uses
from cluster.core.sim_cache import GlobalCache
from policies.eviction import EVICTION_POLICIES, make_policy


def longest_prefix(chain: tuple[int, ...], cached: frozenset) -> int:
    num_hit = 0
    while num_hit < len(chain) and chain[num_hit] in cached:
        num_hit += 1
    return num_hit


def brute_force(chains: list[tuple[int, ...]], capacity_blocks: int) -> int:
    """The most hit blocks of any cache: after each request it may hold any `capacity_blocks`
    of what it held and what the request brought (not only prefix-closed sets)."""
    best = {frozenset(): 0}
    for chain in chains:
        after: dict[frozenset, int] = {}
        for cached, hits in best.items():
            hits += longest_prefix(chain, cached)
            pool = sorted(cached | set(chain))
            for size in range(min(capacity_blocks, len(pool)) + 1):
                for kept in itertools.combinations(pool, size):
                    key = frozenset(kept)
                    after[key] = max(after.get(key, -1), hits)
        best = after
    return max(best.values())


@st.composite
def tree_traces(draw, max_blocks: int = 7, max_requests: int = 6):
    """Requests that are root-to-node paths of one random forest of block ids."""
    num_blocks = draw(st.integers(1, max_blocks))
    parents = [draw(st.integers(-1, i - 1)) for i in range(num_blocks)]
    chains = []
    for _ in range(draw(st.integers(1, max_requests))):
        node, chain = draw(st.integers(0, num_blocks - 1)), []
        while node != -1:
            chain.append(node)
            node = parents[node]
        chains.append(tuple(reversed(chain)))
    return chains


@settings(max_examples=150, deadline=None)
@given(tree_traces(), st.integers(1, 3))
def test_belady_equals_the_brute_force_optimum(chains, capacity_blocks):
    assert sum(belady_hits(chains, capacity_blocks)) == brute_force(chains, capacity_blocks)


@settings(max_examples=60, deadline=None)
@given(tree_traces(max_blocks=12, max_requests=12), st.integers(1, 6))
def test_no_raykv_policy_beats_belady(chains, capacity_blocks):
    keys = [[i.to_bytes(16, "little") for i in chain] for chain in chains]
    bound = sum(belady_hits(keys, capacity_blocks))
    for name in EVICTION_POLICIES:
        cache = GlobalCache(make_policy(name, capacity_blocks), capacity_blocks)
        assert sum(cache.serve(chain) for chain in keys) <= bound, name


def test_belady_by_hand():
    chains = [(0, 1), (0, 2), (0, 1), (0, 2), (0, 1)]
    # One block: only the shared root pays (hits in requests 2..5).
    assert belady_hits(chains, 1) == [0, 1, 1, 1, 1]
    # Two: root and 1 (used three times) beat root and 2.
    assert belady_hits(chains, 2) == [0, 1, 2, 1, 2]
    assert belady_hits(chains, 3) == [0, 1, 2, 2, 2]
    assert belady_hits(chains, 0) == [0] * 5


def test_next_uses():
    assert next_uses([(0, 1), (0, 2), (0, 1)]) == [[1, 2], [2, 3], [3, 3]]
