"""Belady's prefix-closed optimum against a brute force over every cache content, and against
every raykv eviction policy run through the global-cache simulator. No Ray."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.core.belady import belady_hits, next_uses
from cluster.core.sim_cache import GlobalCache, dead_first_lru_hits
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


def dead_first_lru_reference(chains: list[tuple[int, ...]], capacity_blocks: int) -> list[int]:
    """The dead-first LRU oracle written plainly: a list of (dead, last use) per stored page,
    the victim being the smallest; pages stored past a miss are neither touched nor re-told."""
    later = [set(key for c in chains[i + 1:] for key in c) for i in range(len(chains))]
    stored: dict[int, tuple[bool, int]] = {}  # page -> (alive, tick of its last use)
    tick, hits = 0, []
    for i, chain in enumerate(chains):
        num_hit = longest_prefix(chain, frozenset(stored))
        hits.append(num_hit)
        for key in chain[:num_hit]:
            tick += 1
            stored[key] = (key in later[i], tick)
        fresh = [k for k in dict.fromkeys(chain[num_hit:]) if k not in stored][:capacity_blocks]
        for _ in range(len(stored) + len(fresh) - capacity_blocks):
            del stored[min(stored, key=stored.__getitem__)]
        for key in fresh:
            tick += 1
            stored[key] = (key in later[i], tick)
    return hits


@settings(max_examples=150, deadline=None)
@given(tree_traces(max_blocks=12, max_requests=12), st.integers(1, 6))
def test_dead_first_lru_oracle_against_a_plain_reference_and_belady(chains, capacity_blocks):
    keys = [[i.to_bytes(16, "little") for i in chain] for chain in chains]
    hits = dead_first_lru_hits(keys, capacity_blocks)
    assert hits == dead_first_lru_reference(chains, capacity_blocks)
    assert sum(hits) <= sum(belady_hits(keys, capacity_blocks))


def test_dead_first_lru_by_hand():
    chains = [[i.to_bytes(16, "little") for i in chain]
              for chain in [(0, 1), (0, 2), (0, 1), (0, 3), (0, 3)]]
    # Two blocks. Request 1 evicts 1 (alive, but used before 0), request 2 then evicts 2
    # (dead the moment it came) though it was stored after 0, and request 3 evicts 1 (dead
    # since request 2, while 0 is still alive).
    assert dead_first_lru_hits(chains, 2) == [0, 1, 1, 1, 2]
    # Three blocks: request 3 evicts 2, dead longer than 1.
    assert dead_first_lru_hits(chains, 3) == [0, 1, 2, 1, 2]
