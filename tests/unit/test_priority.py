"""Namespaces' priority classes: lower classes give their pages first when memory is freed
across namespaces (policies/quota.py's giving_order), in the pure policy and in a NodeStore."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.core.geometry import HOST, PageGeometry
from cluster.core.registry import Registry
from cluster.core.store import StoreConfig
from policies.quota import Guard, Quota, giving_order, namespace_guard, release_order
from tests.unit._pages import GEOMETRY, key, unique_prefix
from tests.unit._pool_harness import make_limits, run

NOBODY = Guard(None, frozenset(), frozenset())


def test_lower_classes_give_first():
    quotas = {"lo": Quota(priority="low"), "hi": Quota(priority="high"), "mid": Quota()}
    usage = {"lo": 4, "hi": 4, "mid": 4, "unknown": 4}
    assert giving_order(NOBODY, usage, quotas) == (
        frozenset({"lo"}), frozenset({"mid", "unknown"}), frozenset({"hi"}))


def test_within_a_class_those_over_their_share_give_first_and_the_kept_never():
    quotas = {"a": Quota(priority="low"), "b": Quota(priority="low"),
              "c": Quota(min_bytes=8, priority="low"), "d": Quota()}
    guard = Guard(None, frozenset({"c"}), frozenset({"a", "d"}))
    assert giving_order(guard, {"a": 8, "b": 2, "c": 8, "d": 8}, quotas) == (
        frozenset({"a"}), frozenset({"b"}), frozenset({"d"}))


def test_a_namespace_at_its_max_gives_only_its_own_pages_whatever_its_class():
    quotas = {"x": Quota(max_bytes=4, priority="high"), "y": Quota(priority="low")}
    guard = namespace_guard({"x": 4, "y": 4}, quotas, "x", 1)
    assert giving_order(guard, {"x": 4, "y": 4}, quotas) == (frozenset({"x"}),)


def test_all_normal_keeps_the_order_of_shares():
    guard = namespace_guard({"x": 2, "z": 10}, {}, "w", 1)
    assert giving_order(guard, {"x": 2, "z": 10}, {}) == (frozenset({"x", "z"}),)
    assert giving_order(NOBODY, {}, {}) == ()


def test_a_priority_is_one_of_three_classes():
    with pytest.raises(ValueError, match="priority must be one of low, normal, high"):
        Quota(priority="urgent")
    assert Quota(priority="low").combined(Quota(priority="high")).priority == "high"
    registry = Registry(16)
    registry.add_namespace("t", Quota(priority="high"))
    assert registry.describe()["namespaces"]["t"]["priority"] == "high"


def put(store, ids, namespace: str) -> int:
    ids = list(ids)
    return run(store.put_pages(GEOMETRY, [key(i) for i in ids],
                               [np.full(GEOMETRY.page_bytes, i % 251, np.uint8) for i in ids],
                               None, namespace))


@pytest.mark.parametrize("newcomer", ["hi", "lo", "other"])
def test_a_high_namespace_keeps_its_pages_when_a_low_one_gives(stores, newcomer):
    store = stores.make(stores.config(device_pages=0, host_pages=8, disk_pages=0))
    store.set_quotas({}, {"hi": Quota(priority="high"), "lo": Quota(priority="low")})
    put(store, range(4), "hi")  # the oldest pages: LRU alone would evict these first
    put(store, range(10, 14), "lo")
    assert put(store, range(20, 24), newcomer) == 4  # whoever asks, the low class gives
    index = store.pool(GEOMETRY).index
    assert all(key(i) in index for i in range(4))  # the high namespace's pages stay
    assert not any(key(i) in index for i in range(10, 14))  # the low one's gave
    usage = store.elastic.namespace_bytes(HOST)
    assert usage["hi"] == (8 if newcomer == "hi" else 4) * GEOMETRY.slot_bytes


def test_a_donor_gives_back_its_chunks_of_lower_classes_first():
    quotas = {"lo": Quota(priority="low"), "hi": Quota(priority="high")}
    chunks = [(0, 1, frozenset({"hi"})), (1, 4, frozenset({"lo"})), (2, 2, frozenset()),
              (3, 3, frozenset({"lo", "hi"})), (4, 2, frozenset({"mid"}))]
    # empty of pages first, then low, then normal, then any chunk holding a high page
    assert release_order(chunks, quotas) == [2, 1, 4, 0, 3]
    assert release_order([(5, 3, frozenset()), (6, 1, frozenset())], {}) == [6, 5]


def test_a_model_giving_memory_to_another_gives_its_low_priority_pages(stores):
    large = PageGeometry((2, 2, 2, 32, 16), "float32")  # 16 KiB pages: another model's pool
    prefix = unique_prefix()
    stores.prefixes.append(prefix)
    store = stores.make(StoreConfig(make_limits(prefix, 0, 16, 0), stores.disk_dir,
                                    disk_threads=2, chunk_bytes=2 * GEOMETRY.page_bytes))
    store.set_quotas({}, {"hi": Quota(priority="high"), "lo": Quota(priority="low")})
    put(store, range(8), "hi")  # the small model's first chunks hold the high class's pages
    put(store, range(10, 18), "lo")
    run(store.put_pages(large, [bytes([200 + i]) * 16 for i in range(4)],
                        [np.zeros(large.page_bytes, np.uint8)] * 4, None, "other"))
    index = store.pool(GEOMETRY).index
    assert all(key(i) in index for i in range(8))  # the chunks given back were low's
    assert sum(key(i) in index for i in range(10, 18)) == 0
