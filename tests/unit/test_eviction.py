"""Eviction policies: exact orders, pinning, ghost re-admission, and a randomized len check."""

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from policies.eviction import (
    EVICTION_POLICIES,
    MAX_USES,
    EvictionPolicy,
    LRUPolicy,
    PutDepthPolicy,
    RecencyFrequencyPolicy,
    S3FIFOPolicy,
    make_policy,
)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def never(_key) -> bool:
    return False


def always(_key) -> bool:
    return True


def filled(policy: EvictionPolicy, num_keys: int) -> EvictionPolicy:
    for i in range(num_keys):
        policy.on_insert(key(i))
    return policy


# ---- LRU -------------------------------------------------------------------------------


def test_lru_insert_order():
    policy = filled(LRUPolicy(8), 4)
    assert policy.victims(4, never) == [key(0), key(1), key(2), key(3)]
    assert policy.victims(2, never) == [key(0), key(1)]


def test_lru_access_moves_to_newest():
    policy = filled(LRUPolicy(8), 4)
    policy.on_access(key(0))
    policy.on_access(key(2))
    assert policy.victims(4, never) == [key(1), key(3), key(0), key(2)]


def test_lru_reinsert_counts_as_use_and_remove_drops():
    policy = filled(LRUPolicy(8), 3)
    policy.on_insert(key(0))
    policy.on_remove(key(1))
    assert policy.victims(10, never) == [key(2), key(0)]
    assert len(policy) == 2


def test_lru_victims_do_not_remove_and_skip_pinned():
    policy = filled(LRUPolicy(8), 5)
    pinned = {key(0), key(2)}
    assert policy.victims(2, pinned.__contains__) == [key(1), key(3)]
    assert policy.victims(2, pinned.__contains__) == [key(1), key(3)]
    assert len(policy) == 5


# ---- S3-FIFO ---------------------------------------------------------------------------


def test_s3fifo_one_hit_wonders_go_before_reaccessed_key():
    policy = filled(S3FIFOPolicy(10), 6)
    policy.on_access(key(0))
    assert policy.victims(5, never) == [key(1), key(2), key(3), key(4), key(5)]
    assert policy.queue_of(key(0)) == "main"  # promoted by the scan, still present
    assert len(policy) == 6


def test_s3fifo_victims_are_stable_and_side_effect_free_on_the_key_set():
    policy = filled(S3FIFOPolicy(10), 6)
    policy.on_access(key(3))
    first = policy.victims(6, never)
    assert first == policy.victims(6, never)
    assert len(policy) == 6 and sorted(first) == sorted(key(i) for i in range(6))


def test_s3fifo_main_keys_get_second_chances_by_frequency():
    policy = filled(S3FIFOPolicy(10), 3)
    for _ in range(3):
        policy.on_access(key(0))
    policy.on_access(key(1))
    # Everything moves to main (freq reset to 0), then main evicts in FIFO order.
    assert policy.victims(3, never) == [key(2), key(0), key(1)]
    for _ in range(2):
        policy.on_access(key(0))
    # key(0) has freq 2: two trips round main before it becomes a victim.
    assert policy.victims(3, never) == [key(2), key(1), key(0)]


def test_s3fifo_ghost_readmission_goes_to_main():
    policy = filled(S3FIFOPolicy(10), 3)
    [victim] = policy.victims(1, never)
    assert victim == key(0)
    policy.on_remove(victim)
    assert policy.queue_of(victim) == "ghost" and len(policy) == 2
    policy.on_insert(victim)
    assert policy.queue_of(victim) == "main"
    policy.on_insert(key(9))
    assert policy.queue_of(key(9)) == "small"
    # With small at/over target, the small one-hit wonders go before the re-admitted key.
    assert policy.victims(4, never) == [key(1), key(2), key(9), key(0)]


def test_s3fifo_ghost_is_bounded():
    policy = S3FIFOPolicy(10)  # small target 1, ghost 9
    for i in range(20):
        policy.on_insert(key(i))
        policy.on_remove(key(i))
    assert len(policy) == 0
    assert policy.queue_of(key(10)) is None
    assert all(policy.queue_of(key(i)) == "ghost" for i in range(11, 20))


# ---- recency + frequency ---------------------------------------------------------------


def test_recfreq_a_reused_key_outlives_later_single_use_keys():
    policy = filled(RecencyFrequencyPolicy(8), 4)  # clock 1..4; median reuse distance 8
    assert policy.horizon == 16
    policy.on_access(key(0))  # a first reuse after 3 ticks: the median steps to 7
    assert policy.reuse_distance == 7 and policy.horizon == 16  # until the next tick
    assert policy.victims(4, never) == [key(1), key(2), key(3), key(0)]  # key(0): 4 + 16
    for i in range(4, 8):  # clocks 5..8 (< 20)
        policy.on_insert(key(i))
    assert policy.horizon == 14
    assert policy.victims(8, never)[-1] == key(0)


def test_recfreq_ties_go_to_the_later_use_so_leaves_go_first():
    policy = filled(RecencyFrequencyPolicy(8), 3)
    for i in range(3):  # a prefix read again root first: equal uses, equal clock
        policy.on_access(key(i))
    assert policy.victims(3, never) == [key(2), key(1), key(0)]


def test_recfreq_ghost_remembers_uses_of_removed_keys():
    policy = RecencyFrequencyPolicy(2)  # median reuse distance 2, ghost 8
    policy.on_insert(key(0))
    policy.on_remove(key(0))
    policy.on_insert(key(1))  # clock 2
    policy.on_insert(key(0))  # clock 3, its second use: the median steps to 1, so 3 + 2
    policy.on_insert(key(2))  # clock 4
    assert policy.victims(3, never) == [key(1), key(2), key(0)]
    for i in range(10, 30):  # the ghost forgets the oldest removals
        policy.on_insert(key(i))
        policy.on_remove(key(i))
    policy.on_remove(key(0))
    assert len(policy._ghost) == policy.ghost_capacity_pages == 8


@pytest.mark.parametrize("cls", [RecencyFrequencyPolicy, PutDepthPolicy])
def test_recfreq_a_parent_read_alone_past_the_use_cap_still_leaves_after_its_child(cls):
    """Both past MAX_USES at one tick: the parent's lone read, a later call, ties with the
    child's priority and must not rank it first (the stored hypothesis counterexample)."""
    policy = cls(64)
    parent, child = key(0), key(1)
    policy.on_insert(parent)
    policy.on_insert(child, parent)
    for _ in range(MAX_USES + 1):
        policy.on_access(parent)
        policy.on_access(child)
    policy.on_access(parent)  # a prompt that shares only the first page
    assert policy._rank[parent][0] == policy._rank[child][0]
    assert policy.victims(2, never) == [child, parent]


@pytest.mark.parametrize("cls", [RecencyFrequencyPolicy, PutDepthPolicy])
def test_recfreq_a_parent_read_alone_after_the_horizon_shrank_still_leaves_after_its_child(
        cls):
    """A read's new priority (a later clock, one more use, but a shorter horizon) may fall
    below the priority the parent had beside its child; a read never lowers it."""
    policy = cls(8)  # median reuse distance 8
    parent, child = key(0), key(1)
    policy.on_insert(parent)  # clock 1
    policy.on_insert(child, parent)  # clock 2
    for _ in range(2):  # first reuses 1 and 0 ticks apart: the median steps to 6
        policy.on_access(parent)
        policy.on_access(child)  # 3 uses each at clock 2
    policy.on_insert(key(2))  # clock 3: the horizon shrinks by a quarter (6, not 8)
    assert policy.reuse_distance == 6
    policy.on_access(parent)  # 3 + 2 new horizons: below 2 + log2(3) old ones
    assert policy._rank[parent][0] == policy._rank[child][0]
    assert policy.victims(3, never) == [key(2), child, parent]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), min_size=1, max_size=12))
@example(paths=[[0, 0]] * 8 + [[0]])  # the parent past MAX_USES, read alone at the end
def test_recfreq_never_ranks_a_read_page_before_its_descendants(paths):
    """Prompts written, then read again, root first (no removals): every ancestor leaves
    after its descendants. (Pages only written, never read, leave root first.)"""
    policy = RecencyFrequencyPolicy(64)
    for path in [*paths, *paths]:
        chain = [tuple(path[: i + 1]) for i in range(len(path))]
        for page in chain:
            if page in policy:
                policy.on_access(page)
            else:
                policy.on_insert(page)
    order = policy.victims(len(policy), never)
    position = {page: i for i, page in enumerate(order)}
    for page, at in position.items():
        for depth in range(1, len(page)):
            assert position[page[:depth]] > at, (page, order)


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_pinned_keys_are_never_returned(name):
    policy = make_policy(name, 10)
    filled(policy, 8)
    policy.on_access(key(5))
    pinned = {key(0), key(1), key(5), key(7)}
    out = policy.victims(8, pinned.__contains__)
    assert sorted(out) == sorted(key(i) for i in (2, 3, 4, 6))
    assert policy.victims(8, always) == []
    assert len(policy) == 8


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_unknown_keys_and_edge_sizes_are_harmless(name):
    policy = make_policy(name, 4)
    policy.on_remove(key(1))
    policy.on_access(key(1))
    assert len(policy) == 0 and policy.victims(3, never) == []
    policy.on_insert(key(1))
    policy.on_remove(key(2))
    assert policy.victims(0, never) == []
    assert policy.victims(5, never) == [key(1)]
    with pytest.raises(ValueError, match="num_pages"):
        policy.victims(-1, never)


def test_registry_and_make_policy():
    assert isinstance(make_policy("lru", 4), LRUPolicy)
    assert isinstance(make_policy("S3FIFO", 4), S3FIFOPolicy)
    for name in EVICTION_POLICIES:
        assert isinstance(make_policy(name, 4), EvictionPolicy)
    with pytest.raises(ValueError, match="lru, putdepth, recfreq, s3fifo"):
        make_policy("arc", 4)
    with pytest.raises(ValueError, match="capacity_pages"):
        make_policy("s3fifo", 0)


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_len_matches_reference(name, seed):
    rng = random.Random(seed)
    policy = make_policy(name, 64)
    present: set[bytes] = set()
    for _ in range(5000):
        k = key(rng.randrange(200))
        op = rng.random()
        if op < 0.4:
            policy.on_insert(k)
            present.add(k)
        elif op < 0.6:
            policy.on_access(k)
        elif op < 0.8:
            policy.on_remove(k)
            present.discard(k)
        else:
            pinned = {p for p in present if rng.random() < 0.3}
            num_pages = rng.randrange(6)
            out = policy.victims(num_pages, pinned.__contains__)
            assert len(out) == len(set(out)) and set(out) <= present - pinned
            assert len(out) == min(num_pages, len(present - pinned))
            for victim in out[: rng.randrange(len(out) + 1)]:
                policy.on_remove(victim)
                present.discard(victim)
        assert len(policy) == len(present)
    assert sorted(policy.victims(len(present), never)) == sorted(present)
