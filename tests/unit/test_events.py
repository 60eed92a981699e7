"""The node's event stream (cluster/core/events.py) against the directory's index: batches are
resent until acknowledged, a directory that lost acknowledged batches (a stale Redis copy) or
drifted asks for a resync, and memory stays bounded. Pure: no Ray."""

from __future__ import annotations

import random

from cluster.core.directory_index import DirectoryIndex
from cluster.core.events import APPLIED, DUPLICATE, FENCED, RESYNC, EventStream
from cluster.core.keys import shard_of


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Link:
    """A node's stream wired to directory shards through a channel that can fail."""

    def __init__(self, num_shards: int = 1, max_unacked: int = 64):
        self.stream = EventStream("n1", 100, num_shards, max_unacked)
        self.shards = [DirectoryIndex() for _ in range(num_shards)]
        self.held: dict[bytes, int] = {}  # what the node holds
        self.down = False

    def change(self, i: int, tier: int | None) -> None:
        if tier is None:
            self.held.pop(key(i), None)
        else:
            self.held[key(i)] = tier
        self.stream.record(key(i), tier)

    def flush(self, heartbeat: bool = False, deliver=None) -> list[str]:
        """What the node actor's flush does, over this channel."""
        statuses = []
        for index in self.stream.resync_needed():
            inventory = self.stream.split_inventory(list(self.held.items()))[index]
            batch = self.stream.resync(index, inventory)
            if self.down:
                self.stream.shards[index].needs_resync = True
                continue
            ok = self.shards[index].replace_node(batch.node_id, batch.epoch, batch.changes,
                                                 batch.seq)
            self.stream.on_resync(index, batch.seq, ok)
        outgoing = self.stream.outgoing(heartbeat)
        for index, batch in (deliver(outgoing) if deliver else outgoing):
            if self.down:
                self.stream.on_failure(index)
                continue
            status = self.shards[index].apply(batch)
            self.stream.on_status(index, batch.seq, status)
            statuses.append(status)
        return statuses

    def directory_view(self) -> dict[bytes, int]:
        found = {}
        for shard in self.shards:
            found.update(dict(shard.node_inventory("n1")))
        return found


def test_first_flush_sends_the_inventory_then_batches():
    link = Link()
    link.change(1, 0)
    assert link.stream.resync_needed() == [0]
    assert link.flush() == []  # the inventory went with replace_node
    assert link.directory_view() == {key(1): 0}
    link.change(2, 1)
    assert link.flush() == [APPLIED]
    assert link.directory_view() == {key(1): 0, key(2): 1}
    assert link.stream.stats()["unacked_batches"] == 0


def test_a_failed_send_is_resent_with_the_same_seq_until_acknowledged():
    link = Link()
    link.flush()
    link.down = True
    link.change(1, 0)
    link.flush()
    link.change(2, 0)
    link.flush(heartbeat=True)
    assert [b.seq for b in link.stream.shards[0].unacked.values()] == [2, 3]
    link.down = False
    assert link.flush(heartbeat=True) == [APPLIED, APPLIED]
    assert link.directory_view() == {key(1): 0, key(2): 0}
    assert link.stream.shards[0].acked_upto == 3
    assert link.stream.counters["resent"] == 2


def test_delivered_holds_once_every_change_before_the_marks_is_acknowledged():
    """What a client's flush (the node's publish) waits for: the changes recorded before the
    marks, not those recorded after them; none while a send failed or a resync is due."""
    link = Link(num_shards=2)
    link.change(1, 0)
    marks = link.stream.marks()
    assert not link.stream.delivered(marks)  # the first flush (the inventory) is due
    link.flush()
    assert link.stream.delivered(marks)
    link.change(2, 0)
    link.change(3, 0)
    marks = link.stream.marks()
    assert not link.stream.delivered(marks)
    link.down = True
    link.flush()
    assert not link.stream.delivered(marks)  # sent, not acknowledged
    link.down = False
    link.flush(heartbeat=True)
    assert link.stream.delivered(marks)
    link.change(4, 0)  # after the marks: not waited for
    assert link.stream.delivered(marks)
    assert not link.stream.delivered(link.stream.marks())


def test_a_lost_acknowledgement_is_harmless():
    link = Link()
    link.flush()
    link.change(1, 0)
    (_, batch), = link.stream.outgoing()
    assert link.shards[0].apply(batch) == APPLIED  # applied, but the answer is lost
    assert link.flush(heartbeat=True) == [DUPLICATE]  # the resend is acknowledged
    assert link.stream.shards[0].unacked == {}


def test_a_directory_recovered_from_a_stale_copy_resyncs_on_the_next_batch():
    """Write-behind to Redis lags: the directory restarts with the node at an older seq.
    Without acked_upto its gap would never fill and the pages put meanwhile never be found."""
    link = Link()
    link.flush()
    for i in range(3):
        link.change(i, 0)
        link.flush()
    stale = DirectoryIndex()  # what Redis held: the first page only, at seq 2
    assert stale.replace_node("n1", 100, [(key(0), 0)], seq=2)
    link.shards[0] = stale
    link.change(3, 0)
    assert link.flush() == [RESYNC]  # and the resync went out in the same flush
    link.flush()
    assert link.directory_view() == {key(i): 0 for i in range(4)}
    assert stale.nodes["n1"].applied == set() and stale.nodes["n1"].tombstones == {}


def test_a_restart_with_no_state_resyncs_on_the_next_heartbeat():
    link = Link()
    link.flush()
    link.change(1, 2)
    link.flush()
    link.shards[0] = DirectoryIndex()
    assert link.flush(heartbeat=True) == [RESYNC]
    link.flush()
    assert link.directory_view() == {key(1): 2}


def test_a_long_outage_drops_the_backlog_for_one_resync():
    link = Link(max_unacked=4)
    link.flush()
    link.down = True
    for i in range(20):
        link.change(i, 0)
        link.flush(heartbeat=True)
    shard = link.stream.shards[0]
    assert len(shard.unacked) <= 5 and shard.pending == {}
    assert link.stream.counters["dropped_backlogs"] >= 1
    link.down = False
    link.flush(heartbeat=True)
    assert link.directory_view() == {key(i): 0 for i in range(20)}
    assert shard.unacked == {} and not shard.needs_resync


def test_fenced_epoch_is_reported():
    link = Link()
    link.flush()
    newer = EventStream("n1", 200, 1)
    newer.record(key(9), 0)
    inventory = newer.resync(0, [(key(9), 0)])
    assert link.shards[0].replace_node("n1", 200, inventory.changes, inventory.seq)
    link.change(1, 0)
    assert link.flush() == [FENCED]
    assert link.stream.fenced


def test_batches_go_to_the_shard_that_owns_each_key():
    link = Link(num_shards=3)
    link.flush()
    for i in range(30):
        link.change(i, i % 3)
    link.flush()
    for index, shard in enumerate(link.shards):
        assert all(shard_of(k, 3) == index for k in shard.index)
    assert link.directory_view() == {key(i): i % 3 for i in range(30)}


def test_random_loss_duplication_and_reordering_converge():
    """Batches dropped, duplicated and reordered on the wire; with heartbeats the directory
    ends up holding exactly what the node holds, and nothing waits above a gap."""
    rng = random.Random(3)

    def lossy(outgoing):
        delivered = [b for b in outgoing if rng.random() > 0.3]
        delivered += [b for b in outgoing if rng.random() < 0.2]
        rng.shuffle(delivered)
        return delivered

    link = Link(num_shards=2)
    link.flush()
    for step in range(300):
        i = rng.randrange(40)
        link.change(i, None if rng.random() < 0.3 else rng.randrange(3))
        link.flush(heartbeat=step % 5 == 0, deliver=lossy)
    for _ in range(5):  # the channel heals
        link.flush(heartbeat=True)
    assert link.directory_view() == link.held
    for shard in link.shards:
        log = shard.nodes["n1"]
        assert log.applied == set() and log.tombstones == {}
