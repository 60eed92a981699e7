"""The engine tier's pure core: an engine's blocks from its KV events, mapped to raykv page
keys (cluster/core/engine_blocks.py), and its event stream's gaps, replays and restarts
(cluster/core/engine_stream.py)."""

from __future__ import annotations

import pytest

from cluster.core.engine_blocks import Cleared, EngineBlocks, Removed, Stored
from cluster.core.engine_stream import EngineStream
from cluster.core.keys import KeyChain
from cluster.core.spec import ModelSpec

PAGE = 8
CHAIN = KeyChain.of(ModelSpec("m", 2, 1, 8, "float32"), "default", PAGE)
PROMPT = [(i * 37 + 11) % 1000 for i in range(4 * PAGE + 3)]  # 4 full pages and 3 tokens
KEYS = CHAIN.keys(PROMPT)


def stored(first: int, count: int, block_size: int, parent: int | None = None,
           keyable: bool = True, tokens: list[int] = PROMPT) -> Stored:
    """Blocks `first` .. `first + count - 1` of `tokens` in blocks of `block_size`, hashed by
    index (hash i + 100 is block i), as vLLM reports them."""
    hashes = tuple(100 + i for i in range(first, first + count))
    span = tokens[first * block_size : (first + count) * block_size]
    return Stored(hashes, parent, tuple(span), block_size, keyable)


def test_a_page_is_held_once_all_its_blocks_are_stored():
    blocks = EngineBlocks(CHAIN)
    blocks.apply(stored(0, 3, 4))  # blocks 0-2: tokens 0..11, page 0 whole, page 1 half
    assert blocks.held_pages(KEYS) == 1
    blocks.apply(stored(3, 5, 4, parent=102))  # up to token 31: pages 0-3
    assert blocks.held_pages(KEYS) == 4
    assert blocks.held_pages(KEYS[:2]) == 2
    assert blocks.held_pages(CHAIN.keys([1] * PAGE)) == 0  # other tokens: not held


def test_a_removed_block_unholds_its_page_and_every_page_after():
    blocks = EngineBlocks(CHAIN)
    blocks.apply(stored(0, 8, 4))
    blocks.apply(Removed((103,)))  # the second half of page 1
    assert blocks.held_pages(KEYS) == 1
    blocks.apply(stored(3, 1, 4, parent=102))  # stored again
    assert blocks.held_pages(KEYS) == 4
    blocks.apply(Removed((100,)))  # the first block: nothing is reachable from the root
    assert blocks.held_pages(KEYS) == 0


def test_cleared_forgets_every_block():
    blocks = EngineBlocks(CHAIN)
    blocks.apply(stored(0, 8, 4))
    blocks.apply(Cleared())
    assert (blocks.held_pages(KEYS), blocks.num_blocks) == (0, 0)


@pytest.mark.parametrize("block_size", [1, 2, 8, 16, 3, 5, 12])
def test_any_block_size_keys_the_pages_its_blocks_cover(block_size):
    """Sizes that divide the page, equal it, hold two pages, or cross page boundaries."""
    blocks = EngineBlocks(CHAIN)
    num_blocks = len(PROMPT) // block_size
    for index in range(num_blocks):  # one event per block, as a long prefill's steps come
        blocks.apply(stored(index, 1, block_size, parent=99 + index if index else None))
    assert blocks.held_pages(KEYS) == min(4, num_blocks * block_size // PAGE)
    # The block holding token 2 * PAGE goes: pages from the one holding its start are not
    # whole.
    removed = 2 * PAGE // block_size
    blocks.apply(Removed((100 + removed,)))
    assert blocks.held_pages(KEYS) == min(removed * block_size // PAGE,
                                          num_blocks * block_size // PAGE)


def test_blocks_that_are_not_plain_key_nothing_nor_do_blocks_under_them():
    blocks = EngineBlocks(CHAIN)
    blocks.apply(stored(0, 2, 4, keyable=False))  # a cache_salt or a LoRA adapter's
    blocks.apply(stored(2, 6, 4, parent=101))
    assert blocks.held_pages(KEYS) == 0


def test_an_orphan_keys_nothing_and_a_re_report_changes_nothing():
    blocks = EngineBlocks(CHAIN)
    blocks.apply(stored(2, 6, 4, parent=101))  # its parent never reported
    assert blocks.held_pages(KEYS) == 0
    blocks.apply(stored(0, 2, 4))
    assert blocks.held_pages(KEYS) == 1  # the orphans stay unkeyed (under-reported)
    blocks.apply(stored(0, 8, 4))  # vLLM re-reports a reused prefix from the root
    assert blocks.held_pages(KEYS) == 1  # blocks 2.. were known: kept as they were
    blocks.apply(Removed(tuple(range(102, 108))))
    blocks.apply(stored(2, 6, 4, parent=101))
    assert blocks.held_pages(KEYS) == 4


def test_a_malformed_stored_event_is_refused():
    with pytest.raises(ValueError, match="token ids"):
        EngineBlocks(CHAIN).apply(Stored((1, 2), None, (1, 2, 3), 2))


def batches(block_size: int = 4) -> list[list]:
    """The prompt's 8 blocks of 4 in 4 batches of 2 blocks."""
    return [[stored(2 * i, 2, block_size, parent=99 + 2 * i if i else None)] for i in range(4)]


def test_batches_in_order_are_applied():
    stream = EngineStream(CHAIN)
    assert [stream.on_batch(seq, events) for seq, events in enumerate(batches())] == [None] * 4
    assert (stream.held_pages(KEYS), stream.next_seq) == (4, 4)


def test_a_gap_asks_for_a_replay_that_fills_it():
    stream, sent = EngineStream(CHAIN), batches()
    stream.on_batch(0, sent[0])
    assert stream.on_batch(2, sent[2]) == 1  # batch 1 lost: replay from 1
    assert stream.on_batch(3, sent[3]) is None  # held while the replay is out
    assert stream.held_pages(KEYS) == 1
    stream.on_replay([(1, sent[1]), (2, sent[2])])
    assert (stream.held_pages(KEYS), stream.next_seq) == (4, 4)
    assert stream.counters["replays_filled"] == 1 and stream.counters["drops"] == 0


def test_live_copies_of_replayed_batches_are_ignored():
    stream, sent = EngineStream(CHAIN), batches()
    stream.on_batch(0, sent[0])
    assert stream.on_batch(2, sent[2]) == 1
    stream.on_replay([(1, sent[1]), (2, sent[2]), (3, sent[3])])  # 3 came first by replay
    assert stream.on_batch(3, sent[3]) is None  # then live: not a gap, not a restart
    assert stream.next_seq == 4 and stream.counters["gaps"] == 1
    assert stream.counters["restarts"] == 0 and stream.held_pages(KEYS) == 4


def test_a_gap_the_replay_cannot_fill_drops_the_blocks_and_rebuilds():
    stream, sent = EngineStream(CHAIN), batches()
    stream.on_batch(0, sent[0])
    stream.on_batch(1, sent[1])  # pages 0 and 1 held
    # Batch 2 (say, the removal of block 103, which unholds page 1) is lost for good.
    assert stream.on_batch(3, [Stored((200,), None, tuple([5] * 4), 4)]) == 2
    stream.on_replay([(3, [])])  # the publisher no longer has batch 2
    assert stream.counters["drops"] == 1 and stream.next_seq == 4
    assert stream.held_pages(KEYS) == 0  # nothing from before the hole is trusted
    stream.on_batch(4, [stored(0, 8, 4)])  # rebuilt from what follows
    assert stream.held_pages(KEYS) == 4


def test_a_failed_replay_drops_the_blocks_and_applies_what_was_held():
    stream, sent = EngineStream(CHAIN), batches()
    stream.on_batch(0, sent[0])
    assert stream.on_batch(2, [stored(0, 4, 4)]) == 1
    stream.on_replay_failed()
    assert stream.counters["drops"] == 1 and stream.next_seq == 3
    assert stream.held_pages(KEYS) == 2  # batch 2's blocks, applied after the drop


def test_a_late_joiner_asks_a_replay_from_zero():
    stream, sent = EngineStream(CHAIN), batches()
    assert stream.on_batch(3, sent[3]) == 0
    stream.on_replay(list(enumerate(sent)))
    assert stream.held_pages(KEYS) == 4 and stream.counters["drops"] == 0


def test_a_joiner_catches_up_unprompted_and_live_batches_wait_for_it():
    stream, sent = EngineStream(CHAIN), batches()
    assert stream.begin_replay() == 0
    assert stream.on_batch(3, sent[3]) is None  # held: the replay is out
    stream.on_replay(list(enumerate(sent[:3])))
    assert stream.held_pages(KEYS) == 4 and stream.next_seq == 4


def test_a_restart_resets_the_replica():
    stream, sent = EngineStream(CHAIN), batches()
    for seq, events in enumerate(sent):
        stream.on_batch(seq, events)
    assert stream.on_batch(0, [stored(0, 2, 4)]) is None  # numbers start over
    assert stream.counters["restarts"] == 1
    assert stream.held_pages(KEYS) == 1  # only the new engine's blocks
    # A restart seen late (the first batch seen is past 0) asks for the new engine's start.
    assert stream.on_batch(0, sent[0]) is None and stream.counters["restarts"] == 2
    assert stream.on_batch(5, []) == 1


def test_cleared_in_a_batch_resets_the_blocks():
    stream, sent = EngineStream(CHAIN), batches()
    stream.on_batch(0, sent[0])
    stream.on_batch(1, [Cleared(), stored(0, 2, 4)])
    assert stream.held_pages(KEYS) == 1


def test_live_batches_held_during_a_replay_are_bounded():
    stream, sent = EngineStream(CHAIN, max_held_batches=2), batches()
    stream.on_batch(0, sent[0])
    assert stream.on_batch(2, sent[2]) == 1
    stream.on_batch(3, sent[3])
    stream.on_batch(4, [])  # batch 2 goes: a hole at 1 and 2 the replay does not fill
    stream.on_replay([])
    assert stream.counters["drops"] == 1 and stream.next_seq == 5
