"""PrefixLRU, one replica's own prefix cache index: longest-prefix match, a page budget, LRU
eviction that takes a chain's tail before its head."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.core.prefix_lru import PrefixLRU


def chain(name: str, num_pages: int) -> list[str]:
    return [f"{name}{i}" for i in range(num_pages)]


def test_match_walks_to_the_first_miss_and_counts_pages():
    lru = PrefixLRU(capacity_bytes=4 * 10, page_bytes=10)
    a = chain("a", 3)
    assert lru.insert(a, lambda i: f"kv{i}") == 3
    assert lru.match([*a, "x", "a2"]) == ["kv0", "kv1", "kv2"]
    assert lru.match(["x", *a]) == []
    assert lru.used_bytes == 30 and len(lru) == 3
    assert lru.counters == {"matched_pages": 3, "missed_pages": 2, "stored_pages": 3,
                            "evicted_pages": 0}


def test_a_new_chain_evicts_the_oldest_chain_tail_first():
    lru = PrefixLRU(capacity_bytes=45, page_bytes=10)  # 4 pages
    a, b = chain("a", 3), chain("b", 2)
    lru.insert(a, str)
    lru.insert(b, str)
    assert lru.match(a) == ["0", "1"]  # a2 went, a0 and a1 stay reachable
    assert lru.match(b) == ["0", "1"]
    assert lru.counters["evicted_pages"] == 1


def test_a_match_makes_its_pages_the_newest():
    lru = PrefixLRU(capacity_bytes=40, page_bytes=10)
    a, b, c = chain("a", 2), chain("b", 2), chain("c", 2)
    lru.insert(a, str)
    lru.insert(b, str)
    lru.match(a)
    lru.insert(c, str)
    assert len(lru.match(a)) == 2 and lru.match(b) == []


def test_held_pages_are_not_made_again_and_a_chain_past_the_capacity_keeps_its_head():
    lru = PrefixLRU(capacity_bytes=30, page_bytes=10)
    made = []
    lru.insert(chain("a", 2), lambda i: made.append(i) or i)
    assert lru.insert(chain("a", 5), lambda i: made.append(i) or i) == 3
    assert made == [0, 1, 2] and lru.match(chain("a", 5)) == [0, 1, 2]


def test_a_budget_below_one_page_is_refused():
    with pytest.raises(ValueError, match="holds no page"):
        PrefixLRU(capacity_bytes=9, page_bytes=10)


operations = st.lists(st.tuples(st.sampled_from(["insert", "match"]),
                                 st.integers(0, 5), st.integers(1, 6)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(capacity_pages=st.integers(1, 8), ops=operations)
def test_within_budget_and_every_chain_keeps_a_prefix(capacity_pages, ops):
    """Disjoint chains under any mix of inserts and matches: the budget holds, each chain's
    held pages are a prefix of it, and a match returns exactly that prefix's values."""
    lru = PrefixLRU(capacity_bytes=capacity_pages * 8, page_bytes=8)
    for op, name, num_pages in ops:
        keys = chain(f"c{name}-", num_pages)
        if op == "insert":
            stored = lru.insert(keys, lambda i, k=keys: (k[i], "kv"))
            assert stored == min(num_pages, capacity_pages)
            assert lru.match(keys[:stored]) == [(k, "kv") for k in keys[:stored]]
        else:
            found = lru.match(keys)
            assert found == [(k, "kv") for k in keys[: len(found)]]
        assert len(lru) <= capacity_pages and lru.used_bytes <= capacity_pages * 8
        for other in range(6):
            held = [k in lru for k in chain(f"c{other}-", 8)]
            assert held == sorted(held, reverse=True), f"chain {other} lost a middle page"
