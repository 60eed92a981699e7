"""A namespace's max holds in the tier its pages move up into, and a lowered one is given
back at once: a read-up from disk or a promotion into device makes room under the max from
the namespace's own least valuable pages there, as its puts do, or leaves the page where it
is (a get still returns the right bytes); a namespace's max lowered at run time is given
back with no new put, its pages in use once let go (namespace_over_max_bytes in the stats).
NodeStore on tiny tiers; pure asyncio, no Ray."""

from __future__ import annotations

import asyncio

import numpy as np

from cluster.core.geometry import DEVICE, DISK, HOST
from policies.quota import Quota, past_max
from tests.unit._pages import DISK_SLOT_BYTES, PAGE_BYTES
from tests.unit._pool_harness import run
from tests.unit.test_elastic import LARGE, SMALL, elastic_store, key, page, put

P = PAGE_BYTES
MAX_3 = 2 * DISK_SLOT_BYTES  # 3 memory pages, 2 disk slots: one figure, held in each tier


def usage(store, namespace: str = "x") -> dict[int, int]:
    """The namespace's bytes in each tier."""
    return {tier: store.elastic.namespace_bytes(tier).get(namespace, 0)
            for tier in (DEVICE, HOST, DISK)}


def tier_of(store, i: int, geometry=SMALL) -> int:
    name = "s" if geometry == SMALL else "l"
    return store.pool(geometry).index[key(name, i)].tier


def get(store, ids, geometry=SMALL) -> list[int]:
    """The pages a get returns, each as the id its bytes were put with."""
    name = "s" if geometry == SMALL else "l"
    pages = run(store.map_pages(geometry, [key(name, i) for i in ids], np.copy))
    for i, got in zip(ids, pages, strict=False):
        assert np.array_equal(got, page(geometry, i)), f"page {i}: wrong bytes"
    return list(ids)[: len(pages)]


def tier_stats(store, tier: str = "host") -> dict:
    return store.stats()["memory"]["tiers"][tier]


def x_on_disk(stores):
    """x (max: 6 memory pages, 4 disk slots) with 6 pages in host (2..7, at its max) and 2
    on disk (0, 1: demoted by its own puts)."""
    store = elastic_store(stores, disk_pages=32,
                          namespaces={"x": Quota(max_bytes=4 * DISK_SLOT_BYTES)})
    for i in range(0, 8, 2):
        assert put(store, SMALL, range(i, i + 2), "x") == 2
    assert [tier_of(store, i) for i in range(8)] == [DISK] * 2 + [HOST] * 6
    return store


def x_in_device(stores):
    """x (max: 3 memory pages, 2 disk slots) with 3 pages in device (3, 4, 5) and 3 in
    host (0, 1, 2), at its max in both."""
    store = stores.make(stores.config(device_pages=4, host_pages=4, disk_pages=8))
    store.set_quotas({}, {"x": Quota(max_bytes=MAX_3)})
    for i in range(0, 6, 2):
        assert put(store, SMALL, range(i, i + 2), "x") == 2
    assert [tier_of(store, i) for i in range(6)] == [HOST] * 3 + [DEVICE] * 3
    return store


# ---- A: read-ups from disk ------------------------------------------------------------------


def test_a_read_up_makes_room_under_the_namespace_max_from_its_own_coldest_host_pages(stores):
    store = x_on_disk(stores)
    assert get(store, [0, 1]) == [0, 1]  # both read up, with their bytes
    assert usage(store)[HOST] == 6 * P  # at its max, not past it (8 pages before the fix)
    assert [tier_of(store, i) for i in (0, 1, 2, 3)] == [HOST, HOST, DISK, DISK]
    assert len(store.pool(SMALL).index) == 8  # the coldest went down: none was lost


def test_a_read_up_that_no_page_of_its_own_can_make_room_for_leaves_the_page_on_disk(stores):
    store = x_on_disk(stores)
    lease_id, located = run(store.acquire(SMALL, [key("s", i) for i in range(2, 8)]))
    assert len(located) == 6  # a reader holds all x's host pages
    assert get(store, [7, 0, 1]) == [7]  # page 7 from host; 0 stays on disk: the get ends
    assert run(store.touch(SMALL, [key("s", 0), key("s", 1)])) == 2  # read from disk, kept
    assert run(store.prefetch(SMALL, [key("s", 0), key("s", 1)])) == 0  # refused, no error
    assert usage(store)[HOST] == 6 * P and tier_of(store, 0) == tier_of(store, 1) == DISK
    store.release(lease_id)
    assert get(store, [7, 0, 1]) == [7, 0, 1]  # let go: now there is room of its own
    assert usage(store)[HOST] == 6 * P and len(store.pool(SMALL).index) == 8


def test_a_read_up_leaves_other_namespaces_pages_alone(stores):
    store = x_on_disk(stores)
    assert put(store, SMALL, range(20, 24), "y") == 4
    get(store, [0, 1])
    assert [tier_of(store, i) for i in range(20, 24)] == [HOST] * 4
    assert usage(store, "y")[HOST] == 4 * P and usage(store)[HOST] == 6 * P


# ---- B: promotions into device ------------------------------------------------------------


def test_a_promotion_makes_room_under_the_namespace_max_in_device(stores):
    store = x_in_device(stores)
    assert get(store, [0, 1, 2]) == [0, 1, 2]  # the bytes, from device and host
    assert usage(store)[DEVICE] <= 3 * P  # 4 pages before the fix
    assert usage(store)[HOST] <= 3 * P and usage(store)[DISK] <= MAX_3
    assert tier_of(store, 0) == tier_of(store, 1) == DEVICE  # promoted: room was made
    assert len(store.pool(SMALL).index) == 6  # x's own pages went down; none was lost


def test_a_promotion_no_page_of_its_own_can_make_room_for_leaves_the_page_in_host(stores):
    store = x_in_device(stores)
    lease_id, _ = run(store.acquire(SMALL, [key("s", i) for i in (3, 4, 5)]))
    assert get(store, [0, 1, 2]) == [0, 1, 2]  # served from host, bytes and all
    assert [tier_of(store, i) for i in range(6)] == [HOST] * 3 + [DEVICE] * 3
    assert run(store.prefetch(SMALL, [key("s", 0)])) == 1  # refused: still in memory
    assert usage(store)[DEVICE] == 3 * P
    store.release(lease_id)
    run(store.prefetch(SMALL, [key("s", 0)]))
    assert tier_of(store, 0) == DEVICE and usage(store)[DEVICE] == 3 * P


# ---- C: a lowered namespace max -------------------------------------------------------------


def test_the_namespaces_past_their_max():
    quotas = {"x": Quota(max_bytes=4), "y": Quota(max_bytes=10), "z": Quota()}
    assert past_max({"x": 6, "y": 10, "z": 99, "w": 5}, quotas) == {"x": 2}


def test_a_lowered_namespace_max_is_given_back_on_the_node_loop(stores):
    store = elastic_store(stores, disk_pages=32)
    assert put(store, SMALL, range(8), "x") == 8
    assert put(store, SMALL, range(10, 14), "y") == 4

    async def lower() -> None:  # as the node actor applies a registry push: on its loop
        store.set_quotas({}, {"x": Quota(max_bytes=2 * P)})
        for _ in range(200):
            if store.stats()["memory"].get("namespace_max_released_pages"):
                return
            await asyncio.sleep(0.01)

    run(lower())  # no put of x since
    assert usage(store) == {DEVICE: 0, HOST: 2 * P, DISK: DISK_SLOT_BYTES}  # 1 slot fits 2P
    assert [tier_of(store, i) for i in (6, 7)] == [HOST, HOST]  # its hottest pages stay
    assert usage(store, "y")[HOST] == 4 * P  # y keeps its pages
    assert tier_stats(store)["namespace_over_max_bytes"] == {}
    assert store.stats()["memory"]["namespace_max_released_pages"] == 6


def test_a_lowered_namespace_max_is_given_back_before_the_next_put(stores):
    store = elastic_store(stores, disk_pages=32)
    assert put(store, SMALL, range(8), "x") == 8
    store.set_quotas({}, {"x": Quota(max_bytes=2 * P)})  # no loop running here
    assert tier_stats(store)["namespace_over_max_bytes"] == {"x": 6 * P}
    assert put(store, SMALL, range(10, 12), "y") == 2  # another namespace's put
    assert usage(store)[HOST] == 2 * P
    assert tier_stats(store)["namespace_over_max_bytes"] == {}


def test_a_lowered_namespace_max_held_by_pages_in_use_goes_once_they_are_let_go(stores):
    store = elastic_store(stores, disk_pages=32)
    assert put(store, SMALL, range(8), "x") == 8
    lease_id, located = run(store.acquire(SMALL, [key("s", i) for i in range(8)]))
    assert len(located) == 8  # a reader holds every page: none can go now
    store.set_quotas({}, {"x": Quota(max_bytes=2 * P)})
    run(store.shrink_idle(idle_s=3600))  # the node's tick tries
    assert tier_stats(store)["namespace_over_max_bytes"] == {"x": 6 * P}
    assert put(store, SMALL, range(8, 10), "x") == 0  # it takes no page there meanwhile
    store.release(lease_id)
    run(store.shrink_idle(idle_s=3600))  # the next tick gives the excess back
    assert usage(store)[HOST] == 2 * P
    assert tier_stats(store)["namespace_over_max_bytes"] == {}


def test_a_lowered_namespace_max_is_given_back_in_every_tier(stores):
    store = stores.make(stores.config(device_pages=4, host_pages=4, disk_pages=8))
    for i in range(0, 10, 2):
        assert put(store, SMALL, range(i, i + 2), "x") == 2
    assert usage(store) == {DEVICE: 4 * P, HOST: 4 * P, DISK: 2 * DISK_SLOT_BYTES}
    store.set_quotas({}, {"x": Quota(max_bytes=DISK_SLOT_BYTES)})  # 1 memory page, 1 slot
    run(store.shrink_idle(idle_s=3600))
    assert usage(store) == {DEVICE: P, HOST: P, DISK: DISK_SLOT_BYTES}
    assert tier_of(store, 9) == DEVICE  # the hottest stays on top
    assert all(not tier_stats(store, t)["namespace_over_max_bytes"]
               for t in ("device", "host", "disk"))


def test_a_lowered_namespace_max_is_given_back_across_models(stores):
    store = elastic_store(stores)
    assert put(store, SMALL, range(6), "x") == 6
    assert put(store, LARGE, range(3), "x") == 3  # 3 large pages: 6 small pages' worth
    store.set_quotas({}, {"x": Quota(max_bytes=4 * P)})
    run(store.shrink_idle(idle_s=3600))
    assert usage(store)[HOST] == 4 * P
    # each model gave in proportion to what x held in it: half of 8 pages' worth each
    assert store.pool(SMALL).ns_pages[(HOST, "x")] == 2
    assert store.pool(LARGE).ns_pages[(HOST, "x")] == 1
    assert tier_stats(store)["namespace_over_max_bytes"] == {}
