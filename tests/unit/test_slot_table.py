"""The vectorised slot tables (cluster/core/tiers/slot_table.py) against the per-page loops
they replace: the same runs, the same unchanged prefix, hints that never name a wrong place."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.core.tiers.slot_table import (
    PlaceHints,
    SlotRun,
    as_places,
    num_unchanged,
    slot_runs,
)

places_lists = st.lists(st.tuples(st.integers(0, 1), st.integers(0, 40), st.integers(0, 3)),
                        max_size=40)
per_chunk_pairs = st.tuples(st.integers(1, 9), st.integers(1, 9))


def runs_page_by_page(places: list, slots_per_chunk: tuple) -> list[SlotRun]:
    """The old way: walk the pages, extend the current run while the next slot follows."""
    runs: list[SlotRun] = []
    for position, (tier, slot, _) in enumerate(places):
        last = runs[-1] if runs else None
        if (last is not None and last.tier == tier and last.first_slot + last.count == slot
                and slot // slots_per_chunk[tier] == last.first_slot // slots_per_chunk[tier]):
            runs[-1] = SlotRun(last.position, tier, last.first_slot, last.count + 1)
        else:
            runs.append(SlotRun(position, tier, slot, 1))
    return runs


@given(places=places_lists, per_chunk=per_chunk_pairs)
def test_runs_are_the_page_by_page_runs(places, per_chunk):
    assert slot_runs(as_places(places), per_chunk) == runs_page_by_page(places, per_chunk)


runs_of_slots = st.lists(st.tuples(st.integers(0, 1), st.integers(0, 40), st.integers(1, 12)),
                        min_size=1, max_size=3)


@given(runs=runs_of_slots, per_chunk=per_chunk_pairs, generation=st.integers(0, 3))
def test_runs_of_consecutive_slots_are_the_page_by_page_runs(runs, per_chunk, generation):
    """Tables made of runs (as puts reserve them), the one-run shortcut's case among them."""
    places = [(tier, first + k, generation) for tier, first, count in runs for k in range(count)]
    assert slot_runs(as_places(places), per_chunk) == runs_page_by_page(places, per_chunk)


def test_consecutive_slots_are_one_run_until_a_chunk_ends():
    places = as_places([(1, s, 0) for s in range(10, 16)] + [(0, 16, 0)])
    assert slot_runs(places, (100, 100)) == [SlotRun(0, 1, 10, 6), SlotRun(6, 0, 16, 1)]
    assert slot_runs(places, (100, 12)) == [SlotRun(0, 1, 10, 2), SlotRun(2, 1, 12, 4),
                                            SlotRun(6, 0, 16, 1)]


@given(places=places_lists, seed=st.integers(0, 2**32 - 1))
def test_unchanged_prefix_is_the_page_by_page_one(places, seed):
    rng = np.random.default_rng(seed)
    generations = [rng.integers(0, 4, 41).astype(np.uint64) for _ in range(2)]
    expected = len(places)
    for position, (tier, slot, generation) in enumerate(places):
        if int(generations[tier][slot]) != generation:
            expected = position
            break
    assert num_unchanged(as_places(places), generations) == expected


@given(tier=st.integers(0, 1), slots=st.lists(st.integers(0, 40), max_size=40),
       seed=st.integers(0, 2**32 - 1))
def test_unchanged_in_one_tier_is_the_page_by_page_one(tier, slots, seed):
    rng = np.random.default_rng(seed)
    generations = [rng.integers(0, 2, 41).astype(np.uint64) for _ in range(2)]
    noted = rng.integers(0, 2, len(slots))
    places = [(tier, slot, int(g)) for slot, g in zip(slots, noted, strict=True)]
    expected = next((p for p, (_, slot, g) in enumerate(places)
                     if int(generations[tier][slot]) != g), len(places))
    assert num_unchanged(as_places(places), generations) == expected


def test_an_empty_table():
    assert as_places([]).shape == (0, 3)
    assert slot_runs(as_places([]), (1, 1)) == [] and num_unchanged(as_places([]), []) == 0


keys = st.binary(min_size=2, max_size=2)
operations = st.lists(st.one_of(
    st.tuples(st.just("note"), st.lists(keys, max_size=6, unique=True), st.integers(0, 9)),
    st.tuples(st.just("forget"), st.lists(keys, max_size=4), st.just(0))), max_size=30)


@settings(max_examples=200)
@given(ops=operations, capacity=st.integers(1, 12), probe=st.lists(keys, max_size=8))
def test_hints_answer_what_was_noted_last_or_nothing(ops, capacity, probe):
    """Against an unbounded ordered dict: a hint is the last place noted for its key (never
    another key's), and while no more keys were noted than the table holds, none is lost."""
    hints, reference = PlaceHints(capacity), OrderedDict()
    noted = 0
    for step, (op, op_keys, time_s) in enumerate(ops):
        if op == "note":
            places = as_places([(step % 2, step * 10 + i, step) for i in range(len(op_keys))])
            hints.note(op_keys, places, float(time_s))
            for key, place in zip(op_keys, places.tolist(), strict=True):
                reference[key] = (tuple(place), float(time_s))
                reference.move_to_end(key)
            noted += len(op_keys)
        else:
            hints.forget(op_keys)
            for key in op_keys:
                reference.pop(key, None)
    got = hints.prefix(probe, 0.0)
    for key, place in zip(probe, got.tolist(), strict=False):
        assert reference[key][0] == tuple(place)
    if noted <= capacity:
        expected = []
        for key in probe:
            if key not in reference:
                break
            expected.append(reference[key][0])
        assert [tuple(p) for p in got.tolist()] == expected
    assert len(hints) <= capacity


def test_a_hint_older_than_the_cutoff_ends_the_prefix():
    hints = PlaceHints(8)
    hints.note([b"a", b"b"], as_places([(1, 1, 0), (1, 2, 0)]), 5.0)
    hints.note([b"c"], as_places([(1, 3, 0)]), 1.0)
    assert hints.prefix([b"a", b"b", b"c"], 2.0).tolist() == [[1, 1, 0], [1, 2, 0]]
    assert hints.prefix([b"c", b"a"], 2.0).shape == (0, 3)


@pytest.mark.parametrize("capacity", [1, 3])
def test_the_oldest_hints_make_room(capacity):
    hints = PlaceHints(capacity)
    for i in range(5):
        hints.note([bytes([i])], as_places([(1, i, 0)]), float(i))
    assert len(hints) == capacity
    assert hints.prefix([bytes([4])], 0.0).tolist() == [[1, 4, 0]]
    assert hints.prefix([bytes([4 - capacity])], 0.0).shape == (0, 3)


def fence_runs_one_by_one(slots: list[int]) -> list[tuple[int, int]]:
    """The fence's old loop: sorted distinct slots, extended one at a time."""
    runs: list[tuple[int, int]] = []
    for slot in sorted(set(slots)):
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


@given(slots=st.lists(st.integers(0, 60), max_size=40))
def test_the_fences_lock_runs_are_the_one_by_one_runs(slots):
    from cluster.core.tiers.fence import slot_runs as fence_runs

    assert fence_runs(slots) == fence_runs_one_by_one(slots)
    assert fence_runs(np.array(slots, dtype=np.int64)) == fence_runs_one_by_one(slots)
