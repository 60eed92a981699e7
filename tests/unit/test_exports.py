"""The export cache (actors/exports.py) over a real NodeStore, with a fake publish in place of
ray.put: a page is published once while it stays recent, the budget bounds what is kept, and
only the longest local prefix is exported."""

from __future__ import annotations

import asyncio

import numpy as np

from actors.exports import ExportCache
from tests.unit._pages import GEOMETRY, PAGE_BYTES, key, page_bytes
from tests.unit._pool_harness import run, store_put


class FakeObjectStore:
    def __init__(self) -> None:
        self.objects: list[np.ndarray] = []

    def publish(self, view: np.ndarray) -> int:
        self.objects.append(np.copy(view))  # ray.put copies the slot's bytes
        return len(self.objects) - 1


def make(stores, budget_pages: int):
    store = stores.make(device_pages=4, host_pages=4)
    objects = FakeObjectStore()
    return store, ExportCache(store, budget_pages * PAGE_BYTES, objects.publish), objects


def test_export_publishes_each_page_once_while_recent(stores):
    store, cache, objects = make(stores, budget_pages=8)
    run(store_put(store, [0, 1, 2]))
    handles = run(cache.export(GEOMETRY, [key(0), key(1), key(2), key(9)]))
    assert handles == [0, 1, 2]  # the longest local prefix, one object per page
    for i, handle in enumerate(handles):
        assert np.array_equal(objects.objects[handle], page_bytes(i).numpy())
    assert run(cache.export(GEOMETRY, [key(0), key(1)])) == [0, 1]
    assert len(objects.objects) == 3
    assert cache.counters == {"export_calls": 2, "exported_pages": 3, "export_hits": 2}
    assert store.leases == {}  # the pins of the copy were released


def test_a_partly_cached_prefix_publishes_only_the_rest(stores):
    store, cache, objects = make(stores, budget_pages=8)
    run(store_put(store, [0, 1, 2]))
    run(cache.export(GEOMETRY, [key(0)]))
    assert run(cache.export(GEOMETRY, [key(0), key(1), key(2)])) == [0, 1, 2]
    assert cache.counters["exported_pages"] == 3 and cache.counters["export_hits"] == 1


def test_the_budget_evicts_the_least_recently_exported(stores):
    store, cache, objects = make(stores, budget_pages=2)
    run(store_put(store, [0, 1, 2]))
    run(cache.export(GEOMETRY, [key(0)]))
    run(cache.export(GEOMETRY, [key(1)]))
    run(cache.export(GEOMETRY, [key(0)]))  # 0 is recent again
    run(cache.export(GEOMETRY, [key(2)]))  # over budget: 1 goes
    assert list(cache.recent) == [key(0), key(2)]
    assert cache.used_bytes == 2 * PAGE_BYTES
    run(cache.export(GEOMETRY, [key(1)]))
    assert len(objects.objects) == 4  # 1 published again


def test_nothing_local_exports_nothing(stores):
    store, cache, objects = make(stores, budget_pages=2)
    assert run(cache.export(GEOMETRY, [key(5)])) == []
    assert objects.objects == []


def test_concurrent_exports_of_the_same_pages_publish_once(stores):
    store, cache, objects = make(stores, budget_pages=8)
    run(store_put(store, [0, 1]))

    async def both():
        return await asyncio.gather(cache.export(GEOMETRY, [key(0), key(1)]),
                                    cache.export(GEOMETRY, [key(0), key(1)]))

    first, second = run(both())
    assert first == second == [0, 1]
    assert len(objects.objects) == 2
