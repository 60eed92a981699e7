"""The held-pages index (cluster/core/tiers/held_index.py): a writer publishing places, readers
mapping it read-only; torn entries, a full table and stale generations are misses."""

from __future__ import annotations

import os
import threading
import time
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.core.tiers.held_index import (
    CHECK,
    D0,
    PROBES,
    SEQ,
    HeldIndex,
    HeldView,
    capacity_for,
    digests,
)
from cluster.core.tiers.shm import SHM_DIR
from cluster.core.tiers.slot_table import num_unchanged


@pytest.fixture
def index():
    held = HeldIndex(f"raykvtest{uuid.uuid4().hex[:10]}", 64)
    yield held
    held.close()


def keys_of(count: int, tag: bytes = b"") -> list[bytes]:
    return [tag + i.to_bytes(4, "little") + b"k" * (12 - len(tag)) for i in range(count)]


def places_of(count: int, tier: int = 1, generation: int = 3) -> np.ndarray:
    return np.stack([np.full(count, tier), np.arange(count) + 10, np.full(count, generation)],
                    axis=1).astype(np.int64)


def test_published_pages_are_found_in_order(index):
    keys = keys_of(20)
    index.publish(keys, places_of(20))
    view = HeldView(index.path, 1.0)
    assert (view.prefix(keys) == places_of(20)).all()
    assert len(view.prefix(keys[:5] + [b"x" * 16] + keys[6:])) == 5  # a miss ends the prefix
    index.publish(keys[3:4], [(0, 99, 7)])  # moved (promoted): its entry now says so
    assert view.prefix(keys)[3].tolist() == [0, 99, 7]
    index.withdraw(keys[10:11])  # dropped or written to disk
    assert len(view.prefix(keys)) == 10
    assert len(index) == 19


def test_a_batch_is_written_at_its_end_with_the_last_change_of_each_key(index):
    keys = keys_of(6)
    index.publish(keys[:2], places_of(2))
    view = HeldView(index.path, 1.0)
    with index.batched():
        index.publish(keys[2:4], places_of(2, generation=5))
        index.withdraw(keys[:1])
        index.publish(keys[4:5], [(1, 40, 1)])
        index.withdraw(keys[4:5])  # published, then dropped: not in the index at the end
        index.publish(keys[5:6], [(1, 50, 1)])
        index.publish(keys[5:6], [(0, 51, 2)])  # moved again: its last place wins
        with index.batched():  # nested: one batch, written once at the outer end
            index.publish(keys[:1], [(1, 10, 4)])
        assert len(view.prefix(keys)) == 2 and len(index) == 2  # nothing written yet
    assert view.prefix(keys[:4]).tolist() == [[1, 10, 4], [1, 11, 3], [1, 10, 5], [1, 11, 5]]
    assert len(view.prefix(keys[4:])) == 0
    assert view.prefix(keys[5:]).tolist() == [[0, 51, 2]]
    assert len(index) == 5


def test_a_batch_holds_back_only_its_own_threads_changes(index):
    keys = keys_of(2)
    view = HeldView(index.path, 1.0)
    with index.batched():
        other = threading.Thread(target=index.publish, args=(keys[1:], places_of(1)))
        other.start()
        other.join()
        assert len(view.prefix(keys[1:])) == 1  # another thread's publish is written at once


def test_the_file_is_private_and_mapped_read_only(index):
    assert oct(os.stat(index.path).st_mode & 0o777) == "0o600"
    assert os.path.dirname(index.path) == SHM_DIR.rstrip("/")
    view = HeldView(index.path, 1.0)
    with pytest.raises(ValueError):  # a reader cannot write an entry
        view._table[0, SEQ] = 2


def test_entries_hold_digests_never_keys(index):
    """A reader without a namespace's secret cannot compute its keys; nor can it read them
    here (a key would let it acquire the page through the node)."""
    keys = [os.urandom(16) for _ in range(50)]
    index.publish(keys, places_of(50))
    with open(index.path, "rb") as file:
        raw = file.read()
    assert not any(key in raw for key in keys)
    assert not any(key[:8] in raw for key in keys)


def test_a_node_that_stopped_stamping_is_not_read(index):
    keys = keys_of(4)
    index.publish(keys, places_of(4))
    view = HeldView(index.path, 0.05)
    assert len(view.prefix(keys)) == 4
    time.sleep(0.1)
    assert len(view.prefix(keys)) == 0  # the node's tick stopped (dead, or stuck)
    index.beat()
    assert len(view.prefix(keys)) == 4


def test_a_torn_entry_is_a_miss_never_another_place(index):
    keys = keys_of(8)
    index.publish(keys, places_of(8))
    view = HeldView(index.path, 1.0)
    row = index._where[keys[2]]
    table = index._table
    seq = int(table[row, SEQ])
    table[row, SEQ] = seq + 1  # odd: the writer is in the middle of it
    assert len(view.prefix(keys)) == 2
    table[row, SEQ] = seq
    table[row, CHECK + 0] ^= np.uint64(1)  # a field torn under an even seq: the check word
    assert len(view.prefix(keys)) == 2
    table[row, CHECK] ^= np.uint64(1)
    table[row, 4] += np.uint64(1)  # the slot changed but not its check word
    assert len(view.prefix(keys)) == 2
    table[row, 4] -= np.uint64(1)
    assert len(view.prefix(keys)) == 8


def test_a_full_probe_window_overwrites_an_entry_and_that_page_misses(index):
    """Keys that all land in one bucket: PROBES of them fit, the next takes an entry."""
    wanted = []
    mask = index.capacity - 1
    candidate = 0
    while len(wanted) < PROBES + 3:
        key = candidate.to_bytes(16, "little")
        candidate += 1
        if int(digests([key])[0, 0]) & mask == 5:
            wanted.append(key)
    view = HeldView(index.path, 1.0)
    for position, key in enumerate(wanted):
        index.publish([key], [(1, position, 1)])
    assert index.overwritten == 3 and len(index) == PROBES
    found = [len(view.prefix([key])) for key in wanted]
    assert sum(found) == PROBES  # the overwritten ones miss (asked for)
    for position, key in enumerate(wanted):
        got = view.prefix([key])
        if len(got):
            assert got[0].tolist() == [1, position, 1]  # never another key's place


def test_keys_at_home_and_down_their_window_are_found_in_one_lookup(index):
    """A lookup reads home entries first and whole windows only for the keys not there: a
    batch mixing both kinds comes back whole, in order, each key its own place."""
    mask, crowded, candidate = index.capacity - 1, [], 0
    while len(crowded) < 4:  # four keys of one bucket: three sit down its window
        key = candidate.to_bytes(16, "little")
        candidate += 1
        if int(digests([key])[0, 0]) & mask == 9:
            crowded.append(key)
    alone = keys_of(6, b"a")
    keys = [alone[0], crowded[0], crowded[1], alone[1], crowded[2], alone[2], crowded[3],
            *alone[3:]]
    index.publish(keys, places_of(len(keys)))
    view = HeldView(index.path, 1.0)
    assert (view.prefix(keys) == places_of(len(keys))).all()
    assert (view.prefix(keys[::-1]) == places_of(len(keys))[::-1]).all()
    index.withdraw(crowded[2:3])  # a miss down a window ends the prefix there
    assert len(view.prefix(keys)) == 4


def test_a_stale_generation_fails_the_readers_check(index):
    """The entry is only a hint: the slot was freed (generation moved) since it was published,
    so the reader's check after its copy turns the page into a miss."""
    keys = keys_of(6)
    generations = [np.zeros(8, dtype=np.uint64), np.full(64, 3, dtype=np.uint64)]
    index.publish(keys, places_of(6))
    view = HeldView(index.path, 1.0)
    places = view.prefix(keys)
    assert num_unchanged(places, generations) == 6
    generations[1][places[4, 1]] += 1  # freed (and perhaps reused)
    assert num_unchanged(places, generations) == 4


def test_capacity_is_a_power_of_two_with_room():
    for slots in (0, 1, 255, 256, 1000, 100_000):
        capacity = capacity_for(slots)
        assert capacity & (capacity - 1) == 0 and capacity >= 4 * slots and capacity >= 1024


def test_concurrent_writer_never_shows_a_reader_a_wrong_place():
    """A writer republishes keys at places that encode the key (slot = key number * 1000 +
    version) while readers look them up: every place a reader gets is its key's."""
    held = HeldIndex(f"raykvtest{uuid.uuid4().hex[:10]}", 32)
    keys = keys_of(40)
    stop = threading.Event()
    bad, reads = [], [0]

    def write():
        version = 0
        while not stop.is_set():
            version = (version + 1) % 1000
            chosen = np.random.default_rng(version).permutation(40)[:17]
            held.publish([keys[i] for i in chosen],
                         [(1, int(i) * 1000 + version, version) for i in chosen])
            held.withdraw([keys[int(i)] for i in chosen[:3]])
            held.beat()

    def read():
        view = HeldView(held.path, 5.0)
        while not stop.is_set():
            for start in range(0, 40, 8):
                places = view.prefix(keys[start:start + 8])
                reads[0] += len(places)
                for offset, (tier, slot, generation) in enumerate(places.tolist()):
                    if tier != 1 or slot // 1000 != start + offset or slot % 1000 != generation:
                        bad.append((start + offset, tier, slot, generation))

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(1.5)
    stop.set()
    for thread in threads:
        thread.join()
    held.close()
    assert reads[0] > 100 and bad == []


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.booleans(), st.integers(0, 5)),
                min_size=1, max_size=120))
def test_the_index_matches_a_dict_of_what_was_published_or_misses(operations):
    """Any sequence of publishes and withdrawals: every lookup answers the last place
    published for its key, or misses (withdrawn, or its entry overwritten); never another."""
    held = HeldIndex(f"raykvtest{uuid.uuid4().hex[:10]}", 1)
    try:
        keys = keys_of(31, b"h")
        truth: dict[int, tuple[int, int, int]] = {}
        for number, publish, generation in operations:
            if publish:
                truth[number] = (1, number, generation)
                held.publish([keys[number]], [truth[number]])
            else:
                truth.pop(number, None)
                held.withdraw([keys[number]])
        view = HeldView(held.path, 5.0)
        for number, key in enumerate(keys):
            got = view.prefix([key]).tolist()
            if number not in truth:
                assert got == []
            else:
                assert got in ([], [list(truth[number])])
        assert int(held._table[:, D0].astype(bool).sum()) == len(held)
    finally:
        held.close()
