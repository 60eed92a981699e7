"""The node's side of the directory's event stream: sequencing, resends, digests and resync.

Every change of what a node holds (`key -> tier`, or None when it is gone) goes to the shard
that owns the key, in numbered batches:

    record(key, tier)  ->  pending[shard]      (only the latest state of a key matters)
    outgoing()         ->  batch seq=n+1 of pending, plus every batch not yet acknowledged
    on_status(APPLIED | DUPLICATE)  ->  acknowledged      (resent until then, same seq)
    on_status(RESYNC)  ->  resync(): the shard's whole inventory in one batch (replace_node)

A batch carries `acked_upto` (every seq up to it was acknowledged) and a digest of the keys the
node holds in that shard once the batch is applied. A directory that recovered from a stale
copy (Redis write-behind lags) sees its watermark below `acked_upto`; one whose index drifted
sees another digest. Either answers RESYNC, so a lost batch is repaired within one heartbeat
rather than never. Memory stays bounded: past `max_unacked` batches (a directory down for
long) the shard's backlog is dropped and replaced by one resync when it answers again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from cluster.core.keys import PageKey, shard_of

APPLIED, DUPLICATE, FENCED, RESYNC = "applied", "duplicate", "fenced", "resync"
MAX_UNACKED_BATCHES = 64


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One numbered batch of a node's changes for one shard."""

    node_id: str
    epoch: int
    seq: int
    changes: list[tuple[PageKey, int | None]]
    acked_upto: int = 0
    digest: int = 0  # XOR of the keys held in the shard after this batch (see key_digest)
    num_keys: int = 0


def key_digest(key: PageKey) -> int:
    return int.from_bytes(key, "little")


@dataclass(slots=True)
class _Shard:
    seq: int = 0
    acked_upto: int = 0
    acked_above: set[int] = field(default_factory=set)
    unacked: dict[int, EventBatch] = field(default_factory=dict)
    pending: dict[PageKey, int | None] = field(default_factory=dict)
    present: set[PageKey] = field(default_factory=set)
    digest: int = 0
    needs_resync: bool = True  # the first message to a shard is the node's inventory

    def hold(self, key: PageKey, tier: int | None) -> None:
        if tier is None and key in self.present:
            self.present.discard(key)
            self.digest ^= key_digest(key)
        elif tier is not None and key not in self.present:
            self.present.add(key)
            self.digest ^= key_digest(key)

    def hold_many(self, keys: Iterable[PageKey], tier: int | None) -> None:
        """pending[key] = tier and hold(key, tier) for each of `keys`, in order: set
        operations, as the digest is an XOR (its order does not matter) and most of a run
        changes nothing there (pages moved between tiers)."""
        keys = keys if isinstance(keys, list | tuple) else list(keys)
        self.pending.update(dict.fromkeys(keys, tier))
        present = self.present
        if tier is None:
            changed = present.intersection(keys)
            present.difference_update(changed)
        else:
            changed = set(keys) - present
            present.update(changed)
        digest = self.digest
        for key in changed:
            digest ^= int.from_bytes(key, "little")  # key_digest(key)
        self.digest = digest

    def ack(self, seq: int) -> None:
        self.unacked.pop(seq, None)
        if seq > self.acked_upto:
            self.acked_above.add(seq)
        while self.acked_upto + 1 in self.acked_above:
            self.acked_upto += 1
            self.acked_above.discard(self.acked_upto)


class EventStream:
    """Sequenced, acknowledged event batches from one node to every directory shard."""

    def __init__(self, node_id: str, epoch: int, num_shards: int,
                 max_unacked: int = MAX_UNACKED_BATCHES):
        self.node_id = node_id
        self.epoch = epoch
        self.max_unacked = max_unacked
        self.shards = [_Shard() for _ in range(num_shards)]
        self.fenced = False
        self.counters = {"batches": 0, "resent": 0, "resyncs": 0, "dropped_backlogs": 0}

    def record(self, key: PageKey, tier: int | None) -> None:
        shard = self.shards[shard_of(key, len(self.shards))]
        shard.pending[key] = tier
        shard.hold(key, tier)

    def record_many(self, keys: Iterable[PageKey], tier: int | None) -> None:
        """record(key, tier) for each of `keys`, in order (one call for a run of pages)."""
        shards = self.shards
        if len(shards) == 1:
            shards[0].hold_many(keys, tier)
            return
        for key in keys:
            shard = shards[shard_of(key, len(shards))]
            shard.pending[key] = tier
            shard.hold(key, tier)

    def marks(self) -> list[int]:
        """Per shard, the batch that will carry every change recorded so far (the next one
        when some are not batched yet); `delivered(marks)` tells when all have been
        acknowledged."""
        return [shard.seq + bool(shard.pending) for shard in self.shards]

    def delivered(self, marks: list[int]) -> bool:
        """Whether every shard acknowledged its batches up to `marks` (from `marks()`): the
        directory then holds every change recorded before them."""
        return all(not shard.needs_resync and shard.acked_upto >= mark
                   for shard, mark in zip(self.shards, marks, strict=True))

    def resync_needed(self) -> list[int]:
        return [i for i, shard in enumerate(self.shards) if shard.needs_resync]

    def outgoing(self, heartbeat: bool = False) -> list[tuple[int, EventBatch]]:
        """Batches to send now: new changes (or an empty heartbeat) and earlier unacknowledged
        ones, oldest first. Shards waiting for a resync send nothing here."""
        out = []
        for index, shard in enumerate(self.shards):
            if shard.needs_resync or not (shard.pending or heartbeat):
                continue
            if shard.pending or not shard.unacked:
                self._new_batch(shard, list(shard.pending.items()))
                shard.pending = {}
            else:
                self.counters["resent"] += len(shard.unacked)
            out.extend((index, batch) for batch in shard.unacked.values())
        return out

    def _new_batch(self, shard: _Shard, changes: list) -> EventBatch:
        shard.seq += 1
        batch = EventBatch(self.node_id, self.epoch, shard.seq, changes, shard.acked_upto,
                           shard.digest, len(shard.present))
        shard.unacked[shard.seq] = batch
        self.counters["batches"] += 1
        return batch

    def on_status(self, index: int, seq: int, status: str) -> None:
        """The shard's answer to batch `seq`."""
        shard = self.shards[index]
        if status in (APPLIED, DUPLICATE):
            shard.ack(seq)
        elif status == RESYNC:
            shard.needs_resync = True
        elif status == FENCED:
            self.fenced = True

    def on_failure(self, index: int) -> None:
        """A send failed (dead or slow directory): keep the batch for a resend, within bounds."""
        shard = self.shards[index]
        if len(shard.unacked) > self.max_unacked:
            shard.unacked.clear()
            shard.pending.clear()
            shard.needs_resync = True
            self.counters["dropped_backlogs"] += 1

    def resync(self, index: int, inventory: list[tuple[PageKey, int]]) -> EventBatch:
        """A batch of the shard's whole inventory (send it with replace_node); it supersedes
        every earlier batch and pending change of the shard."""
        shard = self.shards[index]
        shard.pending.clear()
        shard.unacked.clear()
        shard.present = {key for key, _ in inventory}
        shard.digest = 0
        for key in shard.present:
            shard.digest ^= key_digest(key)
        shard.seq += 1
        self.counters["resyncs"] += 1
        return EventBatch(self.node_id, self.epoch, shard.seq, inventory, shard.seq,
                          shard.digest, len(shard.present))

    def on_resync(self, index: int, seq: int, accepted: bool) -> None:
        shard = self.shards[index]
        if accepted:
            shard.needs_resync = False
            shard.acked_upto = max(shard.acked_upto, seq)
            shard.acked_above = {s for s in shard.acked_above if s > shard.acked_upto}
        else:
            self.fenced = True

    def split_inventory(self, inventory: list[tuple[PageKey, int]]) -> list[list]:
        per_shard: list[list] = [[] for _ in self.shards]
        for key, tier in inventory:
            per_shard[shard_of(key, len(self.shards))].append((key, tier))
        return per_shard

    def stats(self) -> dict:
        return {"unacked_batches": sum(len(s.unacked) for s in self.shards),
                "pending_events": sum(len(s.pending) for s in self.shards),
                "resync_needed": self.resync_needed(), "fenced": self.fenced, **self.counters}
