"""recfreq's and putdepth's queue (a fifo of first uses beside a lazy heap, parked victims,
compaction) against a plain reference: every key's (priority, -call) in a dict, victims by
sorting. Random op sequences; the victims, priorities and lengths must match exactly. No Ray."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import eviction
from policies.eviction import PutDepthPolicy, RecencyFrequencyPolicy
from tests.unit._pages import key


class ReferenceRecFreq:
    """recfreq's rules (see RecencyFrequencyPolicy) with no queue: a dict and a sort."""

    horizon_factor = eviction.HORIZON_FACTOR

    def __init__(self, capacity_pages: int) -> None:
        self.reuse_distance = float(capacity_pages)
        self.horizon = self.horizon_factor * self.reuse_distance
        self.ghost_capacity_pages = max(1, int(eviction.GHOST_FACTOR * capacity_pages))
        self.clock = 0
        self.calls = 0
        self.uses: dict = {}  # key -> (uses, clock at the last use)
        self.order: dict = {}  # key -> (priority, -call)
        self.ghost: OrderedDict = OrderedDict()

    def reused(self, last_use: int) -> None:
        distance = self.clock - last_use
        step = max(1.0, eviction.MEDIAN_STEP * self.reuse_distance)
        self.reuse_distance += step if distance > self.reuse_distance else -step
        self.reuse_distance = max(1.0, self.reuse_distance)

    def touch(self, key, uses: int, discount: float = 0.0) -> None:
        self.uses[key] = (uses, self.clock)
        self.calls += 1
        log2_uses = math.log2(min(uses, eviction.MAX_USES))
        rank = (self.clock + self.horizon * (log2_uses - discount), -self.calls)
        held = self.order.get(key)  # a read never lowers a priority: it keeps it and its call
        self.order[key] = held if held is not None and rank[0] <= held[0] else rank

    def on_insert(self, key, parent=None) -> None:
        if key in self.uses:
            self.on_access(key)
            return
        self.clock += 1
        past = self.ghost.pop(key, None)
        if past is not None and past[0] == 1:
            self.reused(past[1])
        self.horizon = self.horizon_factor * self.reuse_distance
        self.touch(key, (past[0] if past else 0) + 1, self.discount(key, parent))

    def discount(self, key, parent) -> float:
        return 0.0

    def on_access(self, key) -> None:
        if key in self.uses:
            uses, last_use = self.uses[key]
            if uses == 1:
                self.reused(last_use)
            self.touch(key, uses + 1)

    def on_remove(self, key) -> None:
        if key in self.uses:
            self.ghost[key] = self.uses.pop(key)
            del self.order[key]
            while len(self.ghost) > self.ghost_capacity_pages:
                self.ghost.popitem(last=False)

    def victims(self, num_pages: int, is_pinned) -> list:
        ranked = sorted(self.order, key=self.order.__getitem__)
        return [k for k in ranked if not is_pinned(k)][:num_pages]

    def __len__(self) -> int:
        return len(self.uses)


class ReferencePutDepth(ReferenceRecFreq):
    horizon_factor = eviction.PUT_DEPTH_HORIZON_FACTOR

    def __init__(self, capacity_pages: int) -> None:
        super().__init__(capacity_pages)
        self.depth: dict = {}
        self.put_clock = 0

    def discount(self, key, parent) -> float:
        depth = self.depth.get(parent, 0) + 1 if parent is not None else 1
        if depth == 1:
            self.depth = {}
            self.put_clock = self.clock
        self.depth[key] = depth
        return (eviction.PUT_DEPTH_DISCOUNT * math.log2(depth)
                + (self.clock - self.put_clock) / self.horizon)

    def on_access(self, key) -> None:
        self.depth = {}
        super().on_access(key)


# An op: ("insert", key, chained), ("access", key), ("remove", key),
# ("victims", n, pinned keys), ("evict", n): victims then on_remove of each, as a tier does;
# ("insert_many", keys, chained), ("remove_many", keys): the run calls (the reference makes
# a call per key), with keys held already and repeated keys among them.
KEYS = st.integers(0, 12)  # few keys: the fifo empties, parked entries meet new ones
OPS = st.one_of(
    st.tuples(st.just("insert"), KEYS, st.booleans()),
    st.tuples(st.just("insert_many"), st.lists(KEYS, max_size=8), st.booleans()),
    st.tuples(st.just("remove_many"), st.lists(KEYS, max_size=8)),
    st.tuples(st.just("access"), KEYS),
    st.tuples(st.just("remove"), KEYS),
    st.tuples(st.just("victims"), st.integers(0, 12), st.frozensets(KEYS, max_size=6)),
    st.tuples(st.just("evict"), st.integers(0, 12)),
)


def drive(policy, ops) -> list:
    """Apply `ops`; everything observable: victims' answers, lengths, priorities."""
    seen = []
    last = None
    for op in ops:
        if op[0] == "insert":
            page = key(op[1])
            policy.on_insert(page, last if op[2] else None)
            last = page
        elif op[0] == "insert_many":
            pages = [key(i) for i in op[1]]
            parent = last if op[2] else None  # a chained run goes on from the last insert
            if isinstance(policy, ReferenceRecFreq):
                for page in pages:
                    policy.on_insert(page, parent)
                    parent = page if op[2] else None
            else:
                policy.on_insert_many(pages, parent, op[2])
            last = pages[-1] if pages else last
        elif op[0] == "remove_many":
            pages = [key(i) for i in op[1]]
            if isinstance(policy, ReferenceRecFreq):
                for page in pages:
                    policy.on_remove(page)
            else:
                policy.on_remove_many(pages)
        elif op[0] == "access":
            policy.on_access(key(op[1]))
        elif op[0] == "remove":
            policy.on_remove(key(op[1]))
        elif op[0] == "victims":
            pinned = {key(i) for i in op[2]}
            seen.append(policy.victims(op[1], pinned.__contains__))
        else:
            out = policy.victims(op[1], lambda _k: False)
            for page in out:
                policy.on_remove(page)
            seen.append(out)
        seen.append(len(policy))
    seen.append(policy.victims(len(policy), lambda _k: False))
    return seen


def priorities(policy) -> dict:
    if isinstance(policy, ReferenceRecFreq):
        return dict(policy.order)
    return {k: entry[:2] for k, entry in policy._rank.items()}


@pytest.mark.parametrize(("fast", "reference"), [(RecencyFrequencyPolicy, ReferenceRecFreq),
                                                 (PutDepthPolicy, ReferencePutDepth)])
@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 20), ops=st.lists(OPS, max_size=150))
def test_the_queue_gives_the_references_victims_and_priorities(fast, reference, capacity,
                                                               ops):
    policy, plain = fast(capacity), reference(capacity)
    assert drive(policy, ops) == drive(plain, ops)
    assert priorities(policy) == priorities(plain)
    assert policy.reuse_distance == plain.reuse_distance


@pytest.mark.parametrize("cls", [RecencyFrequencyPolicy, PutDepthPolicy])
def test_first_uses_queue_in_the_fifo_and_stale_entries_are_compacted(cls):
    """Pages inserted once (a tier's demotions) go to the fifo, not the heap; re-ranking
    leaves stale entries, which compaction bounds (at most 2 x live + 64 queued)."""
    policy = cls(1000)
    for i in range(500):
        policy.on_insert(key(i))
    assert len(policy._fifo) == 500 and not policy._heap
    for _ in range(3):
        for i in range(500):
            policy.on_access(key(i))
    assert len(policy._fifo) + len(policy._heap) <= 2 * len(policy) + 64
    out = policy.victims(500, lambda _k: False)
    assert len(out) == 500 == len(set(out))


@pytest.mark.parametrize("cls", [RecencyFrequencyPolicy, PutDepthPolicy])
def test_a_parked_entry_goes_back_behind_a_newer_lower_one(cls):
    """victims() parks a read page (a bonus: ranked ahead of the clock); a page inserted
    meanwhile ranks lower and enters the empty fifo; the parked one must not go before it."""
    policy = cls(64)
    policy.on_insert(key(0))
    policy.on_access(key(0))
    assert policy.victims(1, lambda _k: False) == [key(0)]  # parked, not removed
    policy.on_insert(key(1))
    assert policy.victims(2, lambda _k: False) == [key(1), key(0)]
