"""One engine's event stream, in order: sequence gaps, replays, restarts.

vLLM's publisher numbers its batches 0, 1, 2... per process and keeps the last ones for
replay (ZmqEventPublisher: a ROUTER socket resends every kept batch from a sequence number,
then an end marker). A subscriber that sees batch n+2 after n has lost n+1:

    live:    0 1 2 . 4 5         a gap at 3: hold 4, 5; ask for a replay from 3
    replay:        3 4 5 END     fills it: apply 3, 4, 5 in order, go on from 6
    replay:          7 8 END     cannot fill it (3..6 are gone from the publisher's buffer):
                                 the blocks known so far are dropped (a lost removal must
                                 never leave a block looking held) and rebuilt from 7 on

A lost event is reconciled, never trusted. A publisher that starts over (its numbers go back:
a restarted engine) or reports AllBlocksCleared resets the blocks; a subscriber that joins
late asks for a replay from 0, as after any gap.

Pure: no ZMQ (cluster/serving/engine_events.py moves the bytes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cluster.core.engine_blocks import EngineBlocks, EngineEvent
from cluster.core.keys import KeyChain, PageKey

# Live batches held while a replay is out; past this the oldest go (a hole the replay cannot
# fill then drops the blocks: bounded memory over completeness).
MAX_HELD_BATCHES = 4096


class EngineStream:
    """One replica's engine, from its numbered event batches (module docstring)."""

    def __init__(self, chain: KeyChain, max_held_batches: int = MAX_HELD_BATCHES):
        self.blocks = EngineBlocks(chain)
        self.next_seq = 0
        self.replaying = False
        self._last_live_seq: int | None = None
        self._held: dict[int, Sequence[EngineEvent]] = {}
        self._max_held = max_held_batches
        self.counters = {"batches": 0, "gaps": 0, "replays_filled": 0, "drops": 0,
                         "restarts": 0}

    def on_batch(self, seq: int, events: Sequence[EngineEvent]) -> int | None:
        """A batch from the live socket. Returns the sequence number to ask a replay from
        when it reveals a gap (then call `on_replay` or `on_replay_failed`), else None."""
        if self._last_live_seq is not None and seq <= self._last_live_seq:
            self.restart()  # the numbers went back: a new publisher
        self._last_live_seq = seq
        if seq < self.next_seq and not self.replaying:
            return None  # a live copy of a batch the replay brought first
        if self.replaying:
            self._hold(seq, events)
            return None
        if seq == self.next_seq:
            self._apply(seq, events)
            return None
        self.counters["gaps"] += 1
        self._hold(seq, events)
        self.replaying = True
        return self.next_seq

    def begin_replay(self) -> int:
        """Ask for everything from `next_seq` on unprompted (a subscriber that just joined:
        an idle engine sends nothing that would show the gap). Returns where to replay from."""
        self.replaying = True
        return self.next_seq

    def on_replay(self, batches: Iterable[tuple[int, Sequence[EngineEvent]]]) -> None:
        """The replay's batches (all it sent before its end marker), in any order."""
        if not self.replaying:
            return
        self.replaying = False
        merged = {seq: events for seq, events in batches if seq >= self.next_seq}
        filled = self.next_seq in merged
        merged.update(self._held)
        self._held = {}
        self.counters["replays_filled"] += filled
        for seq in sorted(merged):
            if seq != self.next_seq:  # a hole nothing filled: its events are lost
                self._drop()
                self.next_seq = seq
            self._apply(seq, merged[seq])

    def on_replay_failed(self) -> None:
        """No replay came (no replay socket, or none in time): the gap stays a gap."""
        self.on_replay(())

    def restart(self) -> None:
        """The engine starts over: nothing it held is known to be held."""
        self.counters["restarts"] += 1
        self.blocks.clear()
        self.next_seq = 0
        self.replaying = False
        self._last_live_seq = None
        self._held = {}

    def held_pages(self, keys: Sequence[PageKey]) -> int:
        """Leading pages of `keys` the engine holds whole (EngineBlocks.held_pages)."""
        return self.blocks.held_pages(keys)

    def _hold(self, seq: int, events: Sequence[EngineEvent]) -> None:
        self._held[seq] = events
        if len(self._held) > self._max_held:
            del self._held[min(self._held)]

    def _apply(self, seq: int, events: Sequence[EngineEvent]) -> None:
        for event in events:
            self.blocks.apply(event)
        self.next_seq = seq + 1
        self.counters["batches"] += 1

    def _drop(self) -> None:
        self.counters["drops"] += 1
        self.blocks.clear()
