"""DirectoryIndex: event batches applied at most once in any order, epoch fencing, membership,
longest-prefix match, resync on lost or drifted state; plus the shard split/merge helpers of
actors.handles."""

import random

import pytest

from actors.handles import expand_runs, merge_shard_prefixes, split_by_shard
from cluster.core.directory_index import (
    APPLIED,
    DUPLICATE,
    FENCED,
    MAX_APPLIED_ABOVE_GAP,
    RESYNC,
    DirectoryIndex,
)
from cluster.core.events import EventBatch, key_digest
from cluster.core.keys import shard_of

DEVICE, HOST, DISK = 0, 1, 2


def key(i: int) -> bytes:
    return b"k" + i.to_bytes(15, "little")


KEYS = [key(i) for i in range(8)]


def stored(*keys, tier=DEVICE):
    return [(k, tier) for k in keys]


def removed(*keys):
    return [(k, None) for k in keys]


class Node:
    """A node's side, reduced to what a batch carries: batches are numbered in the order they
    are built, each stamped with the digest of what the node holds once it is applied. Tests
    build them in order and may deliver them in any order."""

    def __init__(self, node_id: str = "a", epoch: int = 1):
        self.node_id, self.epoch = node_id, epoch
        self.state: dict[bytes, int] = {}
        self.seq = 0

    def batch(self, changes=(), acked_upto: int = 0) -> EventBatch:
        self.seq += 1
        for k, tier in changes:
            if tier is None:
                self.state.pop(k, None)
            else:
                self.state[k] = tier
        digest = 0
        for k in self.state:
            digest ^= key_digest(k)
        return EventBatch(self.node_id, self.epoch, self.seq, list(changes), acked_upto,
                          digest, len(self.state))

    def join(self, index: DirectoryIndex, now_s: float = 0.0) -> None:
        assert index.replace_node(self.node_id, self.epoch, list(self.state.items()), self.seq,
                                  now_s)


def joined(*names, epoch=1):
    """An index where each node registered (replace_node) with an empty inventory at seq 0."""
    index = DirectoryIndex()
    nodes = [Node(name, epoch) for name in names]
    for node in nodes:
        node.join(index)
    return (index, *nodes)


def match(index, keys):
    return [list(locations) for locations in expand_runs(index.prefix_runs(keys))]


@pytest.fixture
def one():
    return joined("a")


# ---- apply / match ---------------------------------------------------------------------


def test_apply_then_match(one):
    index, a = one
    assert index.apply(a.batch(stored(*KEYS[:3]))) == APPLIED
    assert match(index, KEYS[:3]) == [[("a", DEVICE)]] * 3
    assert match(index, KEYS) == [[("a", DEVICE)]] * 3
    assert match(index, []) == []
    assert index.stats() == {"num_keys": 3, "num_nodes": 1, "nodes": {"a": 3},
                             "waiting_batches": 0, "tombstones": 0}
    assert sorted(index.node_inventory("a")) == [(k, DEVICE) for k in sorted(KEYS[:3])]


def test_match_stops_at_first_miss(one):
    index, a = one
    index.apply(a.batch(stored(KEYS[0], KEYS[1], KEYS[3], KEYS[4])))
    assert match(index, KEYS[:5]) == [[("a", DEVICE)], [("a", DEVICE)]]
    assert match(index, KEYS[3:5]) == [[("a", DEVICE)], [("a", DEVICE)]]
    assert match(index, [KEYS[2], KEYS[0]]) == []


def test_match_orders_locations_by_tier():
    index, disk, host, dev = joined("disk-node", "host-node", "dev-node")
    index.apply(disk.batch(stored(KEYS[0], tier=DISK)))
    index.apply(host.batch(stored(KEYS[0], tier=HOST)))
    index.apply(dev.batch(stored(KEYS[0], tier=DEVICE)))
    assert match(index, [KEYS[0]]) == [[("dev-node", DEVICE), ("host-node", HOST),
                                        ("disk-node", DISK)]]


def test_a_later_batch_moves_a_page_between_tiers(one):
    index, a = one
    index.apply(a.batch(stored(KEYS[0], tier=DEVICE)))
    index.apply(a.batch(stored(KEYS[0], tier=DISK)))
    assert match(index, [KEYS[0]]) == [[("a", DISK)]]
    assert index.index[KEYS[0]] == {"a": (DISK, 2)}


def test_removal_forgets_only_that_node():
    index, a, b = joined("a", "b")
    index.apply(a.batch(stored(KEYS[0])))
    index.apply(b.batch(stored(KEYS[0], tier=HOST)))
    assert index.apply(a.batch(removed(KEYS[0]))) == APPLIED
    assert match(index, [KEYS[0]]) == [[("b", HOST)]]
    assert index.apply(b.batch(removed(KEYS[0]))) == APPLIED
    assert match(index, [KEYS[0]]) == []
    assert KEYS[0] not in index.index  # no empty location dicts left behind


def test_store_and_remove_in_one_batch_last_change_wins(one):
    index, a = one
    assert index.apply(a.batch(stored(KEYS[0]) + removed(KEYS[0]) + removed(KEYS[1])
                               + stored(KEYS[1], tier=HOST))) == APPLIED
    assert match(index, KEYS[:1]) == []
    assert match(index, KEYS[1:2]) == [[("a", HOST)]]


# ---- duplicates and reordering ---------------------------------------------------------


def test_duplicate_batches_are_ignored(one):
    index, a = one
    b1, b2, b3, b4 = (a.batch(stored(KEYS[0])), a.batch(removed(KEYS[0])),
                      a.batch(stored(KEYS[1])), a.batch(stored(KEYS[2])))
    assert index.apply(b1) == APPLIED
    assert index.apply(b2) == APPLIED
    assert index.apply(b1) == DUPLICATE  # below the watermark
    assert match(index, [KEYS[0]]) == []
    assert index.apply(b4) == APPLIED  # seq 3 is still in flight
    assert index.apply(b4) == DUPLICATE  # above the watermark, already applied
    assert index.nodes["a"].watermark == 2
    assert index.nodes["a"].applied == {4}
    assert index.apply(b3) == APPLIED
    assert match(index, KEYS[1:3]) == [[("a", DEVICE)]] * 2
    assert index.nodes["a"].watermark == 4 and index.nodes["a"].applied == set()


def test_reordered_removal_is_not_undone_by_an_older_store(one):
    index, a = one
    b1, b2 = a.batch(stored(KEYS[0])), a.batch(removed(KEYS[0]))
    assert index.apply(b2) == APPLIED  # seq 2 arrives first
    assert index.apply(b1) == APPLIED  # seq 1 stored it earlier
    assert match(index, [KEYS[0]]) == []
    assert KEYS[0] not in index.index
    assert index.nodes["a"].watermark == 2
    assert index.nodes["a"].applied == set()


def test_reordered_store_is_not_undone_by_an_older_removal(one):
    index, a = one
    b1, b2, b3 = (a.batch(stored(KEYS[0])), a.batch(removed(KEYS[0])),
                  a.batch(stored(KEYS[0], tier=HOST)))
    for batch in (b1, b3, b2):
        assert index.apply(batch) == APPLIED
    assert match(index, [KEYS[0]]) == [[("a", HOST)]]


def test_reordered_tier_moves_keep_the_newest(one):
    index, a = one
    batches = [a.batch(stored(KEYS[0], tier=t)) for t in (DEVICE, HOST, DISK)]
    for batch in reversed(batches):
        assert index.apply(batch) == APPLIED
    assert match(index, [KEYS[0]]) == [[("a", DISK)]]
    assert index.nodes["a"].watermark == 3


def test_any_arrival_order_gives_the_same_result():
    changes = [stored(*KEYS[:4]), removed(KEYS[1]) + stored(KEYS[4], tier=HOST),
               stored(KEYS[1], tier=DISK) + removed(KEYS[2]), removed(KEYS[4]),
               stored(KEYS[2], tier=HOST)]
    expected, node = joined("a")
    batches = [node.batch(c) for c in changes]
    for batch in batches:
        assert expected.apply(batch) == APPLIED
    rng = random.Random(7)
    for _ in range(30):
        order = batches + batches[:2]  # with duplicates
        rng.shuffle(order)
        index, _ = joined("a")
        results = [index.apply(batch) for batch in order]
        assert sorted(results) == [APPLIED] * 5 + [DUPLICATE] * 2
        assert index.index == expected.index
        assert match(index, KEYS[:4]) == [[("a", DEVICE)], [("a", DISK)], [("a", HOST)],
                                          [("a", DEVICE)]]
        assert index.nodes["a"].watermark == 5
        assert index.nodes["a"].digest == expected.nodes["a"].digest


# ---- epochs and membership -------------------------------------------------------------


def test_unknown_node_is_asked_to_resync():
    index, a = DirectoryIndex(), Node("a")
    assert index.apply(a.batch(stored(KEYS[0], tier=HOST))) == RESYNC
    assert index.index == {} and index.nodes == {}
    a.join(index)
    assert index.apply(a.batch(stored(KEYS[1]))) == APPLIED
    assert match(index, KEYS[:2]) == [[("a", HOST)], [("a", DEVICE)]]


def test_stale_epoch_is_fenced():
    index, a = joined("a", epoch=5)
    index.apply(a.batch(stored(KEYS[0])))
    before = {k: dict(v) for k, v in index.index.items()}
    old = Node("a", epoch=4)
    assert index.apply(old.batch(stored(KEYS[1]))) == FENCED
    assert index.apply(old.batch(removed(KEYS[0]))) == FENCED
    assert index.index == before
    assert index.nodes["a"].epoch == 5
    assert index.nodes["a"].watermark == 1


def test_newer_epoch_purges_old_locations():
    index, a, b = joined("a", "b")
    index.apply(a.batch(stored(*KEYS[:3])))
    index.apply(b.batch(stored(KEYS[0], tier=HOST)))
    restarted = Node("a", epoch=2)  # seqs start again
    assert index.apply(restarted.batch(stored(KEYS[5]))) == RESYNC
    assert match(index, KEYS[:3]) == [[("b", HOST)]]
    assert match(index, KEYS[5:6]) == []
    assert "a" not in index.nodes
    restarted.join(index)
    assert match(index, KEYS[5:6]) == [[("a", DEVICE)]]
    assert index.nodes["a"].epoch == 2
    assert index.nodes["a"].keys == {KEYS[5]}
    assert index.apply(a.batch(stored(KEYS[1]))) == FENCED  # the old incarnation
    assert index.replace_node("a", 1, [(KEYS[1], DEVICE)], seq=9) is False
    assert match(index, KEYS[1:2]) == []


def test_drop_node():
    index, a, b = joined("a", "b")
    index.apply(a.batch(stored(*KEYS[:3])))
    index.apply(b.batch(stored(KEYS[0], tier=DISK)))
    assert index.drop_node("a") == 3
    assert match(index, KEYS[:3]) == [[("b", DISK)]]
    assert set(index.index) == {KEYS[0]}
    assert "a" not in index.nodes
    assert index.node_inventory("a") == []
    assert index.drop_node("a") == 0
    assert index.drop_node("never-seen") == 0
    assert index.apply(a.batch(stored(KEYS[4]))) == RESYNC  # must rejoin with an inventory
    assert match(index, KEYS[4:5]) == []


def test_replace_node_installs_inventory():
    index, a, b = joined("a", "b")
    index.apply(a.batch(stored(*KEYS[:4])))
    index.apply(b.batch(stored(KEYS[0], tier=HOST)))
    a.state = {KEYS[0]: DISK, KEYS[6]: HOST}
    a.seq = 7
    a.join(index)
    assert match(index, [KEYS[0]]) == [[("b", HOST), ("a", DISK)]]
    assert match(index, KEYS[1:2]) == []
    assert match(index, KEYS[6:7]) == [[("a", HOST)]]
    assert index.nodes["a"].watermark == 7
    late = EventBatch("a", 1, 7, removed(KEYS[6]))
    assert index.apply(late) == DUPLICATE  # covered by the inventory
    assert index.apply(a.batch(removed(KEYS[6]))) == APPLIED
    assert match(index, KEYS[6:7]) == []


def test_replace_node_from_a_stale_epoch_is_fenced():
    index, a = joined("a", epoch=5)
    index.apply(a.batch(stored(KEYS[0])))
    assert index.replace_node("a", 4, [(KEYS[1], HOST)], seq=3) is False
    assert match(index, KEYS[:1]) == [[("a", DEVICE)]]
    assert match(index, KEYS[1:2]) == []
    assert index.nodes["a"].epoch == 5
    assert index.replace_node("a", 6, [(KEYS[1], HOST)], seq=1) is True
    assert match(index, KEYS[:1]) == []
    assert match(index, KEYS[1:2]) == [[("a", HOST)]]


def test_heartbeats_keep_a_node_alive():
    index, a, _ = DirectoryIndex(), Node("a"), None
    a.join(index, now_s=10.0)
    Node("b").join(index, now_s=10.0)
    beat = a.batch()
    assert index.apply(beat, now_s=14.0) == APPLIED  # an empty batch is a heartbeat
    assert index.expired_nodes(now_s=15.0, timeout_s=4.0) == ["b"]
    assert index.expired_nodes(now_s=14.0, timeout_s=4.0) == []
    assert index.apply(beat, now_s=20.0) == DUPLICATE  # still proof of life
    assert index.nodes["a"].last_seen_s == 20.0
    assert index.apply(a.batch(), now_s=5.0) == APPLIED
    assert index.nodes["a"].last_seen_s == 20.0  # never goes back


# ---- lost and drifted state: resync instead of a gap that never fills ---------------------


def test_acknowledged_batches_missing_here_ask_for_a_resync():
    """A shard that recovered from a stale copy (write-behind) lacks batches it acknowledged:
    their seqs are at or below the node's acked_upto, but above the shard's watermark."""
    index, a = joined("a")
    for i in range(3):
        assert index.apply(a.batch(stored(KEYS[i]))) == APPLIED
    stale = DirectoryIndex()  # what Redis held: the node at seq 1
    assert stale.replace_node("a", 1, [(KEYS[0], DEVICE)], seq=1)
    assert stale.apply(a.batch(stored(KEYS[3]), acked_upto=3)) == RESYNC
    assert "a" not in stale.nodes and stale.index == {}  # nothing half-trusted is kept
    a.join(stale)
    assert match(stale, KEYS[:4]) == [[("a", DEVICE)]] * 4
    assert stale.apply(a.batch(stored(KEYS[4]), acked_upto=a.seq)) == APPLIED


def test_a_digest_mismatch_asks_for_a_resync(one):
    index, a = one
    assert index.apply(a.batch(stored(*KEYS[:3]))) == APPLIED
    index._forget("a", KEYS[1])  # the index lost a location (a bug, or a lost batch)
    index.nodes["a"].discard_key(KEYS[1])
    assert index.apply(a.batch()) == RESYNC  # the next heartbeat tells
    a.join(index)
    assert match(index, KEYS[:3]) == [[("a", DEVICE)]] * 3


def test_digest_is_checked_only_once_every_earlier_batch_is_in(one):
    index, a = one
    b1, b2 = a.batch(stored(KEYS[0])), a.batch(stored(KEYS[1]))
    assert index.apply(b2) == APPLIED  # b1's changes are missing: digests differ, no verdict
    assert index.apply(b1) == APPLIED
    assert index.apply(a.batch()) == APPLIED


def test_a_gap_that_never_fills_is_bounded(one):
    index, a = one
    a.batch(stored(KEYS[0]))  # seq 1 is lost for good
    statuses = [index.apply(a.batch(stored(key(100 + i))))
                for i in range(MAX_APPLIED_ABOVE_GAP + 1)]
    assert statuses[:-1] == [APPLIED] * MAX_APPLIED_ABOVE_GAP
    assert statuses[-1] == RESYNC and "a" not in index.nodes


# ---- tombstones ------------------------------------------------------------------------


def test_tombstones_keep_reordered_removals_correct_and_are_collected(one):
    index, a = one
    many = [key(1000 + i) for i in range(5000)]
    b1, b2, b3 = (a.batch(stored(*many)), a.batch(stored(*many, tier=HOST)),
                  a.batch(removed(*many)))
    assert index.apply(b1) == APPLIED
    assert index.apply(b3) == APPLIED  # seq 2 still in flight
    log = index.nodes["a"]
    assert len(log.tombstones) == 5000  # none is at or below the watermark yet
    assert index.apply(b2) == APPLIED  # must not resurrect
    assert match(index, many[:1]) == []
    assert len(index.index) == 0
    assert log.watermark == 3
    assert log.tombstones == {}  # collected once the watermark passed them
    assert index.apply(b2) == DUPLICATE
    assert index.apply(a.batch(stored(many[0]))) == APPLIED
    assert match(index, many[:2]) == [[("a", DEVICE)]]


def test_in_order_removals_leave_no_tombstones(one):
    index, a = one
    index.apply(a.batch(removed(*KEYS)))
    assert index.nodes["a"].tombstones == {}
    assert index.nodes["a"].watermark == 1


# ---- shard split / merge ---------------------------------------------------------------


def test_split_by_shard_keeps_chain_order():
    keys = [key(i) for i in range(40)]
    positions = split_by_shard(keys, 3)
    assert len(positions) == 3
    assert sorted(p for shard in positions for p in shard) == list(range(40))
    for shard, shard_positions in enumerate(positions):
        assert shard_positions == sorted(shard_positions)
        assert all(shard_of(keys[p], 3) == shard for p in shard_positions)
    assert split_by_shard(keys, 1) == [list(range(40))]
    assert split_by_shard([], 3) == [[], [], []]


def loc(i):
    return ((f"n{i}", DEVICE),)


def runs(*ids):
    return [[loc(i), 1] for i in ids]


def test_merge_full_hit():
    positions = [[0, 3], [1, 4], [2, 5]]
    answers = [runs(0, 3), runs(1, 4), runs(2, 5)]
    assert merge_shard_prefixes(6, positions, answers) == [loc(i) for i in range(6)]


def test_merge_ends_at_the_earliest_miss_of_any_shard():
    positions = [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    # shard 0 has all; shard 1 misses at position 4; shard 2 misses at position 8
    answers = [runs(0, 3, 6), runs(1), runs(2, 5)]
    assert merge_shard_prefixes(9, positions, answers) == [loc(i) for i in range(4)]


def test_merge_ignores_later_hits_after_a_miss():
    positions = [[0, 1], [2], [3, 4]]
    answers = [runs(0, 1), [], runs(3, 4)]  # shard 1 misses its first key
    assert merge_shard_prefixes(5, positions, answers) == [loc(0), loc(1)]


def test_merge_miss_at_position_zero_and_empty():
    assert merge_shard_prefixes(3, [[1], [0], [2]], [runs(1), [], runs(2)]) == []
    assert merge_shard_prefixes(0, [[], [], []], [[], [], []]) == []


def test_merge_of_one_shard_expands_its_runs():
    assert merge_shard_prefixes(3, [[0, 1, 2]], [[[loc(0), 2], [loc(1), 1]]]) == [
        loc(0), loc(0), loc(1)]


def test_split_then_merge_agrees_with_one_index():
    keys = [key(i) for i in range(30)]
    whole, node = joined("a")
    shards = [joined("a")[0] for _ in range(3)]
    held = keys[:17] + keys[18:]  # key 17 missing
    whole.apply(node.batch(stored(*held)))
    for shard, index in enumerate(shards):
        part = [k for k in held if shard_of(k, 3) == shard]
        assert index.replace_node("a", 1, stored(*part), seq=1)
    positions = split_by_shard(keys, 3)
    answers = [index.prefix_runs([keys[p] for p in shard_positions])
               for index, shard_positions in zip(shards, positions, strict=True)]
    merged = merge_shard_prefixes(len(keys), positions, answers)
    assert [list(m) for m in merged] == match(whole, keys)
    assert len(merged) == 17


def test_prefix_runs_compress_a_prefix_by_shared_locations():
    index = DirectoryIndex()
    keys = [bytes([i]) * 16 for i in range(5)]
    index.replace_node("a", 1, [(k, 1) for k in keys[:4]], 1)
    index.replace_node("b", 1, [(k, 0) for k in keys[2:5]], 1)
    assert index.prefix_runs(keys) == [[(("a", 1),), 2], [(("b", 0), ("a", 1)), 2],
                                       [(("b", 0),), 1]]
    assert match(index, keys) == [[("a", 1)]] * 2 + [[("b", 0), ("a", 1)]] * 2 + [[("b", 0)]]
    index.drop_node("b")
    assert index.prefix_runs(keys) == [[(("a", 1),), 4]]
