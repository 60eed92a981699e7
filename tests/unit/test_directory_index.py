"""DirectoryIndex: event batches applied at most once in any order, epoch fencing, membership,
longest-prefix match; plus the shard split/merge helpers of actors.handles."""

import random

import pytest

from actors.handles import merge_matches, split_by_shard
from cluster.core.directory_index import APPLIED, DUPLICATE, FENCED, RESYNC, DirectoryIndex
from cluster.core.keys import shard_of

DEVICE, HOST, DISK = 0, 1, 2


def key(i: int) -> bytes:
    return b"k" + i.to_bytes(15, "little")


KEYS = [key(i) for i in range(8)]


def stored(*keys, tier=DEVICE):
    return [(k, tier) for k in keys]


def removed(*keys):
    return [(k, None) for k in keys]


def joined(*nodes, epoch=1):
    """An index where each node registered (replace_node) with an empty inventory at seq 0."""
    index = DirectoryIndex()
    for node in nodes:
        assert index.replace_node(node, epoch, [], seq=0)
    return index


@pytest.fixture
def index():
    return joined("a")


# ---- apply / match ---------------------------------------------------------------------


def test_apply_then_match(index):
    assert index.apply("a", 1, 1, stored(*KEYS[:3])) == APPLIED
    assert index.match(KEYS[:3]) == [[("a", DEVICE)]] * 3
    assert index.match(KEYS) == [[("a", DEVICE)]] * 3
    assert index.match([]) == []
    assert index.stats() == {"num_keys": 3, "num_nodes": 1, "nodes": {"a": 3}}
    assert sorted(index.node_inventory("a")) == [(k, DEVICE) for k in sorted(KEYS[:3])]


def test_match_stops_at_first_miss(index):
    index.apply("a", 1, 1, stored(KEYS[0], KEYS[1], KEYS[3], KEYS[4]))
    assert index.match(KEYS[:5]) == [[("a", DEVICE)], [("a", DEVICE)]]
    assert index.match(KEYS[3:5]) == [[("a", DEVICE)], [("a", DEVICE)]]
    assert index.match([KEYS[2], KEYS[0]]) == []


def test_match_orders_locations_by_tier():
    index = joined("disk-node", "host-node", "dev-node")
    index.apply("disk-node", 1, 1, stored(KEYS[0], tier=DISK))
    index.apply("host-node", 1, 1, stored(KEYS[0], tier=HOST))
    index.apply("dev-node", 1, 1, stored(KEYS[0], tier=DEVICE))
    assert index.match([KEYS[0]]) == [[("dev-node", DEVICE), ("host-node", HOST),
                                       ("disk-node", DISK)]]


def test_a_later_batch_moves_a_page_between_tiers(index):
    index.apply("a", 1, 1, stored(KEYS[0], tier=DEVICE))
    index.apply("a", 1, 2, stored(KEYS[0], tier=DISK))
    assert index.match([KEYS[0]]) == [[("a", DISK)]]
    assert index.index[KEYS[0]] == {"a": (DISK, 2)}


def test_removal_forgets_only_that_node():
    index = joined("a", "b")
    index.apply("a", 1, 1, stored(KEYS[0]))
    index.apply("b", 1, 1, stored(KEYS[0], tier=HOST))
    assert index.apply("a", 1, 2, removed(KEYS[0])) == APPLIED
    assert index.match([KEYS[0]]) == [[("b", HOST)]]
    assert index.apply("b", 1, 2, removed(KEYS[0])) == APPLIED
    assert index.match([KEYS[0]]) == []
    assert KEYS[0] not in index.index  # no empty location dicts left behind


def test_store_and_remove_in_one_batch_last_change_wins(index):
    index.apply("a", 1, 1, stored(KEYS[0]) + removed(KEYS[0]) + removed(KEYS[1])
                + stored(KEYS[1], tier=HOST))
    assert index.match(KEYS[:1]) == []
    assert index.match(KEYS[1:2]) == [[("a", HOST)]]


# ---- duplicates and reordering ---------------------------------------------------------


def test_duplicate_batches_are_ignored(index):
    assert index.apply("a", 1, 1, stored(KEYS[0])) == APPLIED
    assert index.apply("a", 1, 2, removed(KEYS[0])) == APPLIED
    assert index.apply("a", 1, 1, stored(KEYS[0])) == DUPLICATE  # below the watermark
    assert index.match([KEYS[0]]) == []
    assert index.apply("a", 1, 4, stored(KEYS[1])) == APPLIED
    assert index.apply("a", 1, 4, stored(KEYS[2])) == DUPLICATE  # above it, already applied
    assert index.match(KEYS[1:3]) == [[("a", DEVICE)]]
    assert index.nodes["a"].watermark == 2
    assert index.nodes["a"].applied == {4}


def test_reordered_removal_is_not_undone_by_an_older_store(index):
    assert index.apply("a", 1, 2, removed(KEYS[0])) == APPLIED  # seq 2 arrives first
    assert index.apply("a", 1, 1, stored(KEYS[0])) == APPLIED  # seq 1 stored it earlier
    assert index.match([KEYS[0]]) == []
    assert KEYS[0] not in index.index
    assert index.nodes["a"].watermark == 2
    assert index.nodes["a"].applied == set()


def test_reordered_store_is_not_undone_by_an_older_removal(index):
    index.apply("a", 1, 1, stored(KEYS[0]))
    index.apply("a", 1, 3, stored(KEYS[0], tier=HOST))  # seq 3 re-stored it
    index.apply("a", 1, 2, removed(KEYS[0]))  # seq 2 removed it before that
    assert index.match([KEYS[0]]) == [[("a", HOST)]]


def test_reordered_tier_moves_keep_the_newest(index):
    index.apply("a", 1, 3, stored(KEYS[0], tier=DISK))
    index.apply("a", 1, 2, stored(KEYS[0], tier=HOST))
    index.apply("a", 1, 1, stored(KEYS[0], tier=DEVICE))
    assert index.match([KEYS[0]]) == [[("a", DISK)]]
    assert index.nodes["a"].watermark == 3


def test_any_arrival_order_gives_the_same_result():
    batches = [(1, stored(*KEYS[:4])), (2, removed(KEYS[1]) + stored(KEYS[4], tier=HOST)),
               (3, stored(KEYS[1], tier=DISK) + removed(KEYS[2])), (4, removed(KEYS[4])),
               (5, stored(KEYS[2], tier=HOST))]
    expected = joined("a")
    for seq, changes in batches:
        expected.apply("a", 1, seq, changes)
    rng = random.Random(7)
    for _ in range(30):
        order = batches + batches[:2]  # with duplicates
        rng.shuffle(order)
        index = joined("a")
        results = [index.apply("a", 1, seq, changes) for seq, changes in order]
        assert sorted(results) == [APPLIED] * 5 + [DUPLICATE] * 2
        assert index.index == expected.index
        assert index.match(KEYS[:4]) == [[("a", DEVICE)], [("a", DISK)], [("a", HOST)],
                                         [("a", DEVICE)]]
        assert index.nodes["a"].watermark == 5


# ---- epochs and membership -------------------------------------------------------------


def test_unknown_node_is_asked_to_resync():
    index = DirectoryIndex()
    assert index.apply("a", 1, 1, stored(KEYS[0])) == RESYNC
    assert index.index == {} and index.nodes == {}
    assert index.replace_node("a", 1, [(KEYS[0], HOST)], seq=1)
    assert index.apply("a", 1, 2, stored(KEYS[1])) == APPLIED
    assert index.match(KEYS[:2]) == [[("a", HOST)], [("a", DEVICE)]]


def test_stale_epoch_is_fenced():
    index = joined("a", epoch=5)
    index.apply("a", 5, 1, stored(KEYS[0]))
    before = {k: dict(v) for k, v in index.index.items()}
    assert index.apply("a", 4, 2, stored(KEYS[1])) == FENCED
    assert index.apply("a", 4, 3, removed(KEYS[0])) == FENCED
    assert index.index == before
    assert index.nodes["a"].epoch == 5
    assert index.nodes["a"].watermark == 1


def test_newer_epoch_purges_old_locations():
    index = joined("a", "b")
    index.apply("a", 1, 1, stored(*KEYS[:3]))
    index.apply("b", 1, 1, stored(KEYS[0], tier=HOST))
    assert index.apply("a", 2, 1, stored(KEYS[5])) == RESYNC  # restarted: seqs start again
    assert index.match(KEYS[:3]) == [[("b", HOST)]]
    assert index.match(KEYS[5:6]) == []
    assert "a" not in index.nodes
    assert index.replace_node("a", 2, [(KEYS[5], DEVICE)], seq=1)
    assert index.match(KEYS[5:6]) == [[("a", DEVICE)]]
    assert index.nodes["a"].epoch == 2
    assert index.nodes["a"].keys == {KEYS[5]}
    assert index.apply("a", 1, 2, stored(KEYS[1])) == FENCED  # the old incarnation
    assert index.replace_node("a", 1, [(KEYS[1], DEVICE)], seq=9) is False
    assert index.match(KEYS[1:2]) == []


def test_drop_node():
    index = joined("a", "b")
    index.apply("a", 1, 1, stored(*KEYS[:3]))
    index.apply("b", 1, 1, stored(KEYS[0], tier=DISK))
    assert index.drop_node("a") == 3
    assert index.match(KEYS[:3]) == [[("b", DISK)]]
    assert set(index.index) == {KEYS[0]}
    assert "a" not in index.nodes
    assert index.node_inventory("a") == []
    assert index.drop_node("a") == 0
    assert index.drop_node("never-seen") == 0
    assert index.apply("a", 1, 2, stored(KEYS[4])) == RESYNC  # must rejoin with an inventory
    assert index.match(KEYS[4:5]) == []


def test_replace_node_installs_inventory():
    index = joined("a", "b")
    index.apply("a", 1, 1, stored(*KEYS[:4]))
    index.apply("b", 1, 1, stored(KEYS[0], tier=HOST))
    assert index.replace_node("a", 1, [(KEYS[0], DISK), (KEYS[6], HOST)], seq=7)
    assert index.match([KEYS[0]]) == [[("b", HOST), ("a", DISK)]]
    assert index.match(KEYS[1:2]) == []
    assert index.match(KEYS[6:7]) == [[("a", HOST)]]
    assert index.nodes["a"].watermark == 7
    assert index.apply("a", 1, 7, removed(KEYS[6])) == DUPLICATE  # covered by the inventory
    assert index.apply("a", 1, 8, removed(KEYS[6])) == APPLIED
    assert index.match(KEYS[6:7]) == []


def test_replace_node_from_a_stale_epoch_is_fenced():
    index = joined("a", epoch=5)
    index.apply("a", 5, 1, stored(KEYS[0]))
    assert index.replace_node("a", 4, [(KEYS[1], HOST)], seq=3) is False
    assert index.match(KEYS[:1]) == [[("a", DEVICE)]]
    assert index.match(KEYS[1:2]) == []
    assert index.nodes["a"].epoch == 5
    assert index.replace_node("a", 6, [(KEYS[1], HOST)], seq=1) is True
    assert index.match(KEYS[:1]) == []
    assert index.match(KEYS[1:2]) == [[("a", HOST)]]


def test_heartbeats_keep_a_node_alive():
    index = DirectoryIndex()
    index.replace_node("a", 1, [], seq=0, now_s=10.0)
    index.replace_node("b", 1, [], seq=0, now_s=10.0)
    assert index.apply("a", 1, 1, [], now_s=14.0) == APPLIED  # an empty batch is a heartbeat
    assert index.expired_nodes(now_s=15.0, timeout_s=4.0) == ["b"]
    assert index.expired_nodes(now_s=14.0, timeout_s=4.0) == []
    assert index.apply("a", 1, 1, [], now_s=20.0) == DUPLICATE  # still proof of life
    assert index.nodes["a"].last_seen_s == 20.0
    assert index.apply("a", 1, 2, [], now_s=5.0) == APPLIED
    assert index.nodes["a"].last_seen_s == 20.0  # never goes back


# ---- tombstone garbage collection ------------------------------------------------------


def test_tombstone_gc_keeps_reordered_removals_correct(index):
    many = [key(1000 + i) for i in range(5000)]
    assert index.apply("a", 1, 1, stored(*many)) == APPLIED
    assert index.apply("a", 1, 3, removed(*many)) == APPLIED  # seq 2 still in flight
    log = index.nodes["a"]
    assert len(log.tombstones) == 5000  # > 4096, but none is at or below the watermark
    assert index.apply("a", 1, 2, stored(*many, tier=HOST)) == APPLIED  # must not resurrect
    assert index.match(many[:1]) == []
    assert len(index.index) == 0
    assert log.watermark == 3
    assert log.tombstones == {}  # collected once the watermark passed them
    assert index.apply("a", 1, 2, stored(*many)) == DUPLICATE
    assert index.apply("a", 1, 4, stored(many[0])) == APPLIED
    assert index.match(many[:2]) == [[("a", DEVICE)]]


def test_tombstones_below_the_threshold_are_kept(index):
    index.apply("a", 1, 1, removed(*KEYS))
    assert index.nodes["a"].tombstones == {k: 1 for k in KEYS}
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
    return [(f"n{i}", DEVICE)]


def test_merge_matches_full_hit():
    positions = [[0, 3], [1, 4], [2, 5]]
    results = [[loc(0), loc(3)], [loc(1), loc(4)], [loc(2), loc(5)]]
    assert merge_matches(6, positions, results) == [loc(i) for i in range(6)]


def test_merge_matches_ends_at_the_earliest_miss_of_any_shard():
    positions = [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    # shard 0 has all; shard 1 misses at position 4; shard 2 misses at position 8
    results = [[loc(0), loc(3), loc(6)], [loc(1)], [loc(2), loc(5)]]
    assert merge_matches(9, positions, results) == [loc(i) for i in range(4)]


def test_merge_matches_ignores_later_hits_after_a_miss():
    positions = [[0, 1], [2], [3, 4]]
    results = [[loc(0), loc(1)], [], [loc(3), loc(4)]]  # shard 1 misses its first key
    assert merge_matches(5, positions, results) == [loc(0), loc(1)]


def test_merge_matches_miss_at_position_zero_and_empty():
    assert merge_matches(3, [[1], [0], [2]], [[loc(1)], [], [loc(2)]]) == []
    assert merge_matches(0, [[], [], []], [[], [], []]) == []


def test_split_then_merge_agrees_with_one_index():
    keys = [key(i) for i in range(30)]
    whole, shards = joined("a"), [joined("a") for _ in range(3)]
    held = keys[:17] + keys[18:]  # key 17 missing
    whole.apply("a", 1, 1, stored(*held))
    for shard, index in enumerate(shards):
        index.apply("a", 1, 1, stored(*[k for k in held if shard_of(k, 3) == shard]))
    positions = split_by_shard(keys, 3)
    results = [index.match([keys[p] for p in shard_positions])
               for index, shard_positions in zip(shards, positions, strict=True)]
    merged = merge_matches(len(keys), positions, results)
    assert merged == whole.match(keys)
    assert len(merged) == 17


def test_match_runs_compress_a_prefix_by_shared_locations():
    index = DirectoryIndex()
    keys = [bytes([i]) * 16 for i in range(5)]
    index.replace_node("a", 1, [(k, 1) for k in keys[:4]], 1)
    index.replace_node("b", 1, [(k, 0) for k in keys[2:5]], 1)
    runs = index.match_runs(keys)
    assert runs == [[(("a", 1),), 2], [(("b", 0), ("a", 1)), 2], [(("b", 0),), 1]]
    assert index.match(keys) == [[("a", 1)]] * 2 + [[("b", 0), ("a", 1)]] * 2 + [[("b", 0)]]
    index.drop_node("b")
    assert index.match_runs(keys) == [[(("a", 1),), 4]]
