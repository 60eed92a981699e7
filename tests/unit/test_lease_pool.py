"""A client's slot lease accounting (cluster/core/lease_pool.py): pure, exact."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.core.lease_pool import LeasePool

NOW_S = 100.0
LEASE_S = 30.0


def pool_with(places: list[tuple[int, int, int]], lease_id: int = 5,
              min_pages: int = 2, max_pages: int = 8) -> LeasePool:
    pool = LeasePool(min_pages, max_pages, margin_s=LEASE_S / 4)
    pool.granted(lease_id, places, NOW_S, LEASE_S)
    return pool


def test_an_empty_pool_takes_nothing_and_asks_for_twice_the_put_within_the_cap():
    pool = LeasePool(2, 8, margin_s=1.0)
    assert pool.want() == 2
    assert pool.take(3, NOW_S) is None
    assert pool.want() == 6  # twice the put that found too few
    assert pool.take(5, NOW_S) is None
    assert pool.want() == 8  # capped at max_pages


def test_puts_that_outrun_the_top_ups_grow_the_lease_by_a_put_each_time_within_the_cap():
    pool = pool_with([(1, s, 0) for s in range(4)], min_pages=2, max_pages=12)
    assert pool.take(2, NOW_S).tolist() == [[1, 0, 0], [1, 1, 0]]
    assert pool.take(2, NOW_S).tolist() == [[1, 2, 0], [1, 3, 0]]
    assert pool.want() == 4  # twice the put: no shortage yet
    assert pool.take(2, NOW_S) is None  # a third put before the top-up: the lease ran dry
    assert pool.want() == 6  # a burst of three puts fits next time
    assert pool.take(2, NOW_S) is None
    assert pool.want() == 8
    for _ in range(3):
        pool.take(2, NOW_S)
    assert pool.want() == 12  # capped at max_pages
    late = LeasePool(2, 12, margin_s=1.0)
    assert late.take(2, NOW_S) is None  # no lease yet: not a burst, twice the put only
    assert late.want() == 4


def test_take_hands_out_slots_in_slot_order_and_keeps_the_rest():
    pool = pool_with([(1, 12, 0), (1, 10, 3), (1, 11, 3), (0, 4, 1)])
    taken = pool.take(3, NOW_S + 1)
    assert taken.tolist() == [[0, 4, 1], [1, 10, 3], [1, 11, 3]]  # by tier, then slot
    assert pool.free.tolist() == [[1, 12, 0]]
    assert pool.want() == 2 * 3 - 1  # the target rose to twice the put


def test_a_lease_near_its_end_is_not_taken_from_and_asks_for_a_call():
    pool = pool_with([(1, 0, 0), (1, 1, 0)])
    late_s = NOW_S + LEASE_S - LEASE_S / 4 + 0.01  # within the margin of the deadline
    assert pool.take(1, late_s) is None
    assert len(pool.free) == 2  # kept: a renewal makes them ours again
    assert pool.needs_call(late_s)
    pool.granted(5, [], late_s, LEASE_S)  # the renewal (same lease id)
    assert pool.take(1, late_s).tolist() == [[1, 0, 0]]


def test_a_new_lease_id_means_the_old_slots_are_gone():
    pool = pool_with([(1, 0, 0), (1, 1, 0)], lease_id=5)
    pool.granted(9, [(1, 7, 2)], NOW_S + 1, LEASE_S)
    assert pool.lease_id == 9
    assert pool.free.tolist() == [[1, 7, 2]]


def test_written_pages_go_out_once_in_the_order_written():
    pool = pool_with([(1, s, 0) for s in range(4)])
    first = pool.take(2, NOW_S)
    second = pool.take(1, NOW_S)
    pool.wrote([b"a", b"b"], first)
    pool.wrote([b"c"], second)
    assert pool.num_written() == 3 and pool.needs_call(NOW_S)
    keys, places = pool.take_written()
    assert keys == [b"a", b"b", b"c"]
    assert places.tolist() == [[1, 0, 0], [1, 1, 0], [1, 2, 0]]
    assert pool.num_written() == 0
    keys, places = pool.take_written()
    assert keys == [] and places.shape == (0, 3)


def test_wrote_refuses_a_mismatch():
    pool = pool_with([(1, 0, 0)])
    with pytest.raises(AssertionError, match="2 keys for 1 slots"):
        pool.wrote([b"a", b"b"], pool.take(1, NOW_S))


def test_given_back_slots_are_free_again_in_order_and_dropped_ones_are_not():
    pool = pool_with([(1, s, 0) for s in range(4)])
    taken = pool.take(2, NOW_S)
    pool.give_back(taken)
    assert pool.free[:, 1].tolist() == [0, 1, 2, 3]
    pool.lapsed()  # the lease is gone: its free slots with it
    assert len(pool.free) == 0 and pool.take(1, NOW_S) is None


def test_a_full_pool_asks_for_nothing_until_its_end_nears():
    pool = pool_with([(1, s, 0) for s in range(2)], min_pages=2, max_pages=2)
    assert pool.want() == 0
    assert not pool.needs_call(NOW_S + 1)
    assert pool.needs_call(NOW_S + LEASE_S)


def test_no_lease_bytes_no_slots():
    pool = LeasePool(0, 0, margin_s=1.0)
    assert pool.take(1, NOW_S) is None and pool.want() == 0
    assert not pool.needs_call(NOW_S)
    assert isinstance(pool.free, np.ndarray)


def test_revoked_slots_are_dropped_at_their_generation_only():
    pool = pool_with([(1, 7, 2), (1, 8, 2), (1, 9, 2)])
    # slot 8 revoked; slot 9 revoked at generation 2 and leased again at generation 3
    pool.granted(5, [(1, 9, 3)], NOW_S + 1, LEASE_S, revoked=[(1, 8, 2), (1, 9, 2)])
    assert pool.free.tolist() == [[1, 7, 2], [1, 9, 3]]
    pool.revoked([(1, 7, 9)])  # another generation than the one held: kept
    assert pool.free.tolist() == [[1, 7, 2], [1, 9, 3]]


def test_keep_free_drops_the_moved_slots_only():
    pool = pool_with([(1, 7, 2), (1, 8, 2), (1, 9, 2)])
    pool.keep_free(np.array([True, False, True]))
    assert pool.free.tolist() == [[1, 7, 2], [1, 9, 2]]


def test_a_renewal_alone_asks_for_no_more_slots_until_a_put_finds_too_few():
    pool = pool_with([(1, 0, 0)], min_pages=4, max_pages=8)
    assert pool.want() == 3 and pool.top_up() == 0  # idle: the node may have taken them back
    assert not pool.needs_call(NOW_S + 1)
    assert pool.take(2, NOW_S + 1) is None  # a put that finds too few
    assert pool.needs_call(NOW_S + 1) and pool.top_up() == 5  # twice the put, and one more
    pool.granted(5, [(1, 1, 0)], NOW_S + 1, LEASE_S)  # fewer than asked: still short
    assert pool.short and pool.top_up() == 4
    pool.granted(5, [(1, s, 0) for s in range(2, 6)], NOW_S + 2, LEASE_S)
    assert not pool.short and pool.top_up() == 0
    pool.wrote([b"a"], pool.take(1, NOW_S + 2))
    assert pool.top_up() == 1  # a commit tops up as it goes
