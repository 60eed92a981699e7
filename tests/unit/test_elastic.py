"""The elastic memory of a node: every model's pool draws each tier from one budget, in
chunks; quotas (min, max, weight) per model and per namespace decide who gives memory back;
an idle model shrinks. NodeStore on tiny tiers; pure asyncio, no Ray."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.core.geometry import DEVICE, DISK, HOST, PageGeometry
from cluster.core.store import StoreConfig
from policies.quota import Guard, Holding, Quota, choose_donor, namespace_guard
from tests.unit._pages import PAGE_BYTES, unique_prefix
from tests.unit._pool_harness import make_limits, run

SMALL = PageGeometry((2, 2, 2, 16, 16), "float32")  # 8 KiB pages
LARGE = PageGeometry((2, 2, 2, 32, 16), "float32")  # 16 KiB pages


def key(model: str, i: int) -> bytes:
    return (model[:1].encode() + i.to_bytes(15, "little"))


def page(geometry: PageGeometry, i: int) -> np.ndarray:
    return np.full(geometry.page_bytes, i % 251, dtype=np.uint8)


def put(store, geometry: PageGeometry, ids, namespace: str = "") -> int:
    ids = list(ids)
    name = "s" if geometry == SMALL else "l"
    return run(store.put_pages(geometry, [key(name, i) for i in ids],
                               [page(geometry, i) for i in ids], None, namespace))


def held(store, tier: int = HOST) -> dict[str, int]:
    return dict(store.elastic.budgets[tier].holders)


def elastic_store(stores, host_pages: int = 16, disk_pages: int = 0, **quotas):
    """A store with no device tier and a host tier of `host_pages` small pages."""
    prefix = unique_prefix()
    stores.prefixes.append(prefix)
    limits = make_limits(prefix, 0, host_pages, disk_pages)
    store = stores.make(StoreConfig(limits, stores.disk_dir, disk_threads=2,
                                    chunk_bytes=2 * PAGE_BYTES))
    store.set_quotas({SMALL.name: quotas.get("small", Quota()),
                      LARGE.name: quotas.get("large", Quota())}, quotas.get("namespaces", {}))
    return store


# ---- the pure policy -----------------------------------------------------------------------


def test_the_model_holding_most_per_weight_gives():
    holdings = [Holding("a", 8, Quota(weight=1), 2), Holding("b", 8, Quota(weight=4), 2),
                Holding("c", 2, Quota(), 2)]
    assert choose_donor(holdings, "c", 2) == "a"
    assert choose_donor(holdings, "a", 2) is None  # a already holds the most: its own pages
    assert choose_donor([*holdings[:1], Holding("b", 8, Quota(), 2, releasable=False),
                         holdings[2]], "c", 2) == "a"


def test_min_and_max_bound_the_choice():
    holdings = [Holding("a", 8, Quota(min_bytes=8), 2), Holding("b", 2, Quota(max_bytes=3), 2),
                Holding("c", 6, Quota(), 2)]
    assert choose_donor(holdings, "b", 2) is None  # b would pass its max
    assert choose_donor(holdings, "c", 2) is None  # a is at its min, nobody else gives
    below = [Holding("a", 2, Quota(min_bytes=6), 2), Holding("b", 4, Quota(weight=0.5), 2)]
    assert choose_donor(below, "a", 2) == "b"  # below its min: it takes, share or not


def test_namespace_guard():
    quotas = {"x": Quota(max_bytes=4), "y": Quota(min_bytes=4), "z": Quota()}
    assert namespace_guard({"x": 4, "y": 4, "z": 10}, quotas, "x", 1) == Guard(
        "x", frozenset(), frozenset())
    guard = namespace_guard({"x": 2, "y": 4, "z": 10}, quotas, "w", 1)
    assert guard.only is None and guard.kept == {"y"} and guard.first == {"x", "z"}


# ---- the store -------------------------------------------------------------------------


def test_models_grow_in_chunks_from_one_budget(stores):
    store = elastic_store(stores)
    assert put(store, SMALL, range(6)) == 6
    assert held(store) == {SMALL.name: 6 * PAGE_BYTES}  # three chunks of two small pages
    assert put(store, LARGE, range(4)) == 4
    assert held(store) == {SMALL.name: 6 * PAGE_BYTES, LARGE.name: 4 * 2 * PAGE_BYTES}
    assert store.stats()["models"] == held(store)


def test_a_full_tier_is_shared_by_weight(stores):
    store = elastic_store(stores, small=Quota(weight=1), large=Quota(weight=1))
    assert put(store, SMALL, range(16)) == 16  # the small model takes the whole host tier
    assert held(store) == {SMALL.name: 16 * PAGE_BYTES}
    assert put(store, LARGE, range(4)) == 4  # the large one takes chunks back from it
    assert held(store) == {SMALL.name: 8 * PAGE_BYTES, LARGE.name: 8 * PAGE_BYTES}
    assert put(store, LARGE, range(4, 8)) == 4  # now at its share: it evicts its own
    assert held(store)[LARGE.name] == 8 * PAGE_BYTES
    assert store.elastic.counters["reclaimed_host"] == 4
    pool = store.pool(SMALL)
    assert sorted(pool.slots(HOST)._used) == sorted(e.slot for e in pool.index.values())


def test_weights_split_the_tier(stores):
    store = elastic_store(stores, small=Quota(weight=3), large=Quota(weight=1))
    put(store, SMALL, range(16))
    put(store, LARGE, range(8))
    assert held(store) == {SMALL.name: 12 * PAGE_BYTES, LARGE.name: 4 * PAGE_BYTES}


def test_nobody_goes_below_its_min(stores):
    store = elastic_store(stores, small=Quota(min_bytes=12 * PAGE_BYTES))
    put(store, SMALL, range(16))
    put(store, LARGE, range(8))
    assert held(store) == {SMALL.name: 12 * PAGE_BYTES, LARGE.name: 4 * PAGE_BYTES}


def test_nobody_grows_past_its_max(stores):
    store = elastic_store(stores, small=Quota(max_bytes=4 * PAGE_BYTES))
    assert put(store, SMALL, range(10)) == 4  # the put keeps the prefix that fits
    assert held(store) == {SMALL.name: 4 * PAGE_BYTES}
    assert store.pool(SMALL).local_prefix([key("s", i) for i in range(4)]) == 4


def test_reclaimed_pages_are_demoted_not_lost(stores):
    store = elastic_store(stores, disk_pages=32)
    put(store, SMALL, range(16))
    put(store, LARGE, range(4))
    tiers = [e.tier for e in store.pool(SMALL).index.values()]
    assert tiers.count(HOST) == 8 and tiers.count(DISK) == 8  # 8 went down to disk
    assert store.pool(SMALL).local_prefix([key("s", i) for i in range(16)]) == 16


def test_an_idle_model_shrinks(stores):
    store = elastic_store(stores, small=Quota(min_bytes=2 * PAGE_BYTES), disk_pages=32)
    put(store, SMALL, range(8))
    assert run(store.shrink_idle(idle_s=3600)) == 0  # not idle yet
    store.pool(SMALL).last_access_s -= 10
    assert run(store.shrink_idle(idle_s=5)) == 3  # 4 chunks held, down to its min: 1
    assert held(store) == {SMALL.name: 2 * PAGE_BYTES}
    assert store.elastic.budgets[HOST].free_bytes == 14 * PAGE_BYTES
    assert store.stats()["memory"]["idle_released_chunks"] == 3


def test_an_idle_model_keeps_its_min_when_its_chunks_are_already_empty(stores):
    # CI on 7cc4f4f: the node's demotion ahead had emptied the idle model's host chunks, and
    # the shrink gave back every empty chunk at once, its min with them (0 bytes held).
    store = elastic_store(stores, small=Quota(min_bytes=2 * PAGE_BYTES), disk_pages=32)
    put(store, SMALL, range(8))
    pool = store.pool(SMALL)
    run(pool.demote([k for k, e in pool.index.items() if e.tier == HOST], HOST))
    pool.last_access_s -= 10
    assert run(store.shrink_idle(idle_s=5)) == 3  # 4 empty chunks held, down to its min: 1
    assert held(store) == {SMALL.name: 2 * PAGE_BYTES}
    assert put(store, SMALL, range(8, 10)) == 2  # and the chunk kept is usable


def test_a_namespace_at_its_max_evicts_its_own_pages(stores):
    quotas = {"x": Quota(max_bytes=4 * PAGE_BYTES), "y": Quota()}
    store = elastic_store(stores, namespaces=quotas, small=Quota(max_bytes=8 * PAGE_BYTES))
    put(store, SMALL, range(4), "x")
    put(store, SMALL, range(10, 14), "y")
    assert put(store, SMALL, range(4, 6), "x") == 2
    usage = store.elastic.namespace_bytes(HOST)
    assert usage == {"x": 4 * PAGE_BYTES, "y": 4 * PAGE_BYTES}  # y kept all of its pages


def test_a_namespace_under_its_min_keeps_its_pages(stores):
    quotas = {"x": Quota(), "y": Quota(min_bytes=4 * PAGE_BYTES)}
    store = elastic_store(stores, namespaces=quotas, small=Quota(max_bytes=8 * PAGE_BYTES))
    put(store, SMALL, range(10, 14), "y")
    put(store, SMALL, range(4), "x")
    assert put(store, SMALL, range(4, 8), "x") == 4  # room comes from x's own pages
    assert store.elastic.namespace_bytes(HOST)["y"] == 4 * PAGE_BYTES


def test_quotas_change_at_run_time(stores):
    store = elastic_store(stores)
    put(store, SMALL, range(8))
    store.set_quotas({SMALL.name: Quota(max_bytes=8 * PAGE_BYTES)}, {}, {SMALL.name: "tiny"})
    assert put(store, SMALL, range(8, 12)) == 4
    assert held(store) == {SMALL.name: 8 * PAGE_BYTES}
    assert store.stats()["models"] == {"tiny": 8 * PAGE_BYTES}
    with pytest.raises(ValueError):
        Quota(min_bytes=8, max_bytes=4)


@pytest.mark.parametrize("tier", [DEVICE])
def test_an_absent_tier_holds_nothing(stores, tier):
    store = elastic_store(stores)
    put(store, SMALL, range(3))
    assert held(store, tier) == {}


def test_a_chunk_a_client_still_maps_ends_the_reclaim_that_released_it(stores):
    """A device chunk given back while a client maps it is retired, not free
    (tiers/device_chunks.py): the reclaim that released it stops there rather than take more
    chunks from the donor for room that this chunk will give once the client lets go."""
    from cluster.core.tiers.memory import ArenaMapping

    prefix = unique_prefix()
    stores.prefixes.append(prefix)
    store = stores.make(StoreConfig(make_limits(prefix, 16, 16, 0), stores.disk_dir,
                                    disk_threads=2, chunk_bytes=2 * PAGE_BYTES))
    store.set_quotas({SMALL.name: Quota(weight=1), LARGE.name: Quota(weight=1)}, {})
    assert put(store, SMALL, range(16)) == 16
    assert held(store, DEVICE) == {SMALL.name: 16 * PAGE_BYTES}
    arena = store.pool(SMALL).memory[DEVICE]
    mapping = ArenaMapping(arena.descriptor())  # a client, copying through every slot
    views = [mapping.view(slot) for slot in range(16)]
    assert put(store, LARGE, range(4)) == 4
    assert store.elastic.counters["reclaimed_device"] == 1  # one chunk, then it stopped
    assert held(store, DEVICE)[SMALL.name] == 14 * PAGE_BYTES
    assert store.stats()["memory"]["tiers"]["device"]["retired_bytes"] == 2 * PAGE_BYTES
    views.clear()
    mapping.device.catch_up()
    store.beat()  # the node's loop frees what no client maps any more
    assert store.elastic.budgets[DEVICE].retired_bytes == 0
