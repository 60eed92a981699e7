"""Operators' pins: a TTL on the monotonic clock with no thread, the cap on pinned bytes
(refused whole), pins sharing pages, and eviction passing pinned pages by in a NodeStore.
The operator's pure helpers (naming a node, who holds what, what a warm-up pulls)."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.core.geometry import HOST
from cluster.core.pins import PinRefused, PinSet, check_ttl
from cluster.operator import holders_of, pull_plan, resolve_node
from tests.unit._pages import GEOMETRY, key
from tests.unit._pool_harness import run


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def pages(*ids: int, num_bytes: int = 10) -> dict:
    return {key(i): num_bytes for i in ids}


def test_a_pin_holds_its_pages_until_its_ttl_ends():
    clock = Clock()
    pins = PinSet(clock)
    assert pins.pin(b"p", pages(1, 2), ttl_s=5, cap_bytes=100) is None
    assert pins.holds(key(1)) and pins.holds(key(2)) and not pins.holds(key(3))
    clock.now_s += 4.9
    assert pins.holds(key(1))
    clock.now_s += 0.1  # at the deadline: swept at the next check, no thread needed
    assert not pins.holds(key(1)) and not pins.holds(key(2))
    assert pins.stats() == {"pins": 0, "pinned_pages": 0, "pinned_bytes": 0, "expired_pins": 1}


def test_unpin_ends_a_pin_early_and_pinning_again_restarts_its_ttl():
    clock = Clock()
    pins = PinSet(clock)
    pins.pin(b"p", pages(1), ttl_s=5, cap_bytes=100)
    clock.now_s += 4
    replaced = pins.pin(b"p", pages(1, 2), ttl_s=5, cap_bytes=100)
    assert replaced is not None and list(replaced.pages) == [key(1)]
    assert pins.remaining_s(replaced) == pytest.approx(1.0)
    clock.now_s += 4  # 8 s after the first pin, 4 after the second
    assert pins.holds(key(1)) and pins.holds(key(2))
    assert sorted(pins.unpin(b"p")) == sorted([key(1), key(2)])
    assert not pins.holds(key(1)) and pins.unpin(b"p") == []
    assert pins.pinned_bytes == 0


def test_pins_sharing_pages_count_them_once_and_keep_them_while_either_lives():
    clock = Clock()
    pins = PinSet(clock)
    pins.pin(b"system", pages(1, 2), ttl_s=10, cap_bytes=40)
    pins.pin(b"chat", pages(1, 2, 3), ttl_s=2, cap_bytes=40)
    assert pins.pinned_bytes == 30  # page 1 and 2 once
    clock.now_s += 3  # the chat's pin ended; the system prompt's holds its pages
    assert pins.holds(key(1)) and pins.holds(key(2)) and not pins.holds(key(3))
    assert pins.pinned_bytes == 20


def test_a_pin_past_the_cap_is_refused_whole():
    pins = PinSet(Clock())
    pins.pin(b"a", pages(1, 2, 3), ttl_s=10, cap_bytes=50)
    with pytest.raises(PinRefused, match="past its cap of 50 bytes"):
        pins.pin(b"b", pages(3, 4, 5, 6), ttl_s=10, cap_bytes=50)  # 30 + 30 new > 50
    assert not pins.holds(key(4)) and pins.pinned_bytes == 30  # nothing half-pinned
    with pytest.raises(PinRefused):  # a refused re-pin keeps the pin it would replace
        pins.pin(b"a", pages(1, 2, 3, 4, 5, 6), ttl_s=10, cap_bytes=50)
    assert pins.holds(key(3)) and pins.pinned_bytes == 30
    pins.pin(b"a", pages(4, 5, 6, 7, 8), ttl_s=10, cap_bytes=50)  # replaced: its own room
    assert pins.pinned_bytes == 50 and not pins.holds(key(1))


@pytest.mark.parametrize("ttl_s", [0, -1, float("inf"), float("nan"), True, "5"])
def test_a_ttl_is_a_positive_finite_number(ttl_s):
    with pytest.raises(ValueError, match="ttl_s"):
        check_ttl(ttl_s)


def test_no_pages_ends_the_pin():
    pins = PinSet(Clock())
    pins.pin(b"a", pages(1), ttl_s=10, cap_bytes=50)
    assert pins.pin(b"a", {}, ttl_s=10, cap_bytes=50) is not None
    assert not pins.holds(key(1)) and pins.pins == {}


# ---- pins in a node's store ---------------------------------------------------------------


def put(store, ids, namespace: str = "") -> int:
    ids = list(ids)
    return run(store.put_pages(GEOMETRY, [key(i) for i in ids],
                               [np.full(GEOMETRY.page_bytes, i % 251, np.uint8) for i in ids],
                               None, namespace))


def test_eviction_passes_pinned_pages_by_and_takes_them_once_the_pin_ends(stores):
    store = stores.make(stores.config(device_pages=0, host_pages=4, disk_pages=0))
    put(store, range(4))
    pinned, replaced = store.pin(GEOMETRY, b"p", [key(0), key(1), key(99)], ttl_s=60)
    assert pinned == [key(0), key(1)] and replaced is None  # 99 is not stored here
    put(store, range(10, 14))  # four new pages: only the two unpinned ones could go
    pool = store.pool(GEOMETRY)
    assert pool.local_prefix([key(0), key(1)]) == 2
    assert pool.local_prefix([key(2)]) == 0 and pool.local_prefix([key(3)]) == 0
    assert store.stats()["pins"]["pinned_pages"] == 2
    assert store.unpin(b"p") == [key(0), key(1)]
    put(store, range(20, 24))
    assert pool.local_prefix([key(0)]) == 0  # evicted once unpinned


def test_the_node_caps_pins_at_a_fraction_of_its_memory(stores):
    config = stores.config(device_pages=0, host_pages=4, disk_pages=0)
    store = stores.make(config)  # max_pinned_fraction 0.5: two of the four pages
    put(store, range(4))
    assert store.pin_cap_bytes() == 2 * GEOMETRY.slot_bytes
    with pytest.raises(PinRefused):
        store.pin(GEOMETRY, b"p", [key(i) for i in range(3)], ttl_s=60)
    assert store.stats()["pins"]["pinned_pages"] == 0
    assert store.pin(GEOMETRY, b"p", [key(0), key(1)], ttl_s=60)[0] == [key(0), key(1)]


def test_a_pinned_page_is_not_discarded_by_the_control_loop(stores):
    store = stores.make(stores.config(device_pages=0, host_pages=4, disk_pages=0))
    put(store, range(2))
    store.pin(GEOMETRY, b"p", [key(0)], ttl_s=60)
    assert store.discard(GEOMETRY, [key(0), key(1)]) == 1
    assert store.pool(GEOMETRY).index[key(0)].tier == HOST


# ---- the operator's pure helpers ------------------------------------------------------------


def test_a_node_is_named_by_its_id_or_a_unique_prefix():
    known = ["abcdef123456", "abcdef999999", "0123456789ab"]
    assert resolve_node("0123456789ab", known) == "0123456789ab"
    assert resolve_node("012345", known) == "0123456789ab"
    with pytest.raises(ValueError, match="names several nodes"):
        resolve_node("abcdef", known)
    with pytest.raises(ValueError, match="is not a raykv node.*0123456789ab"):
        resolve_node("nowhere", known)
    with pytest.raises(ValueError, match="is not a raykv node"):
        resolve_node("01", known)  # too short to name one


def test_holders_and_the_pull_plan_follow_the_directory():
    located = [(("a", 1), ("b", 2)), (("b", 1),), (("a", 2), ("a", 1))]
    assert holders_of(located) == {"a": [0, 2], "b": [0, 1]}
    keys = (b"k0", b"k1", b"k2", b"k3")  # k3 is not stored anywhere
    assert pull_plan(located, keys, "b") == {"a": [b"k2"]}
    assert pull_plan(located, keys, "c") == {"a": [b"k0", b"k2"], "b": [b"k1"]}
