"""The engine tier's subscriber: each vLLM replica's KV-cache events, read off its ZMQ sockets
into cluster/core/engine_stream.py, for raykv's router.

vLLM's wire format (vllm/distributed/kv_events.py, ZmqEventPublisher): the PUB socket sends
(topic, 8-byte big-endian sequence number, msgpack of KVEventBatch); the ROUTER replay socket
takes (b"", start sequence number) from a DEALER and answers every batch it still keeps from
there, as (b"", topic, seq, payload), then (b"", b"", -1, b""). A KVEventBatch is the array
[ts, events, data_parallel_rank], each event a map tagged by "type".

One background thread owns every socket (ZMQ sockets are not thread-safe) and applies the
events; the router only reads, under a lock, never waiting on a socket. On joining a replica
and on every gap it asks the replay socket, waiting at most `replay_timeout_s`: a replay that
does not come is a failed one (the stream drops what it cannot trust).

A replica's sockets are raykv's relay of vLLM's (cluster/serving/events_relay.py): CURVE servers
that admit the key pair the replica advertises beside them. A source advertised without keys
(a user's own kv_events_config) is read as vLLM serves it, in the clear.

pyzmq and msgspec come with vLLM: this module is imported only where vLLM replicas publish
events (the router imports it lazily).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
import zmq

from cluster.core.engine_blocks import Cleared, EngineEvent, Removed, Stored
from cluster.core.engine_stream import EngineStream
from cluster.core.keys import KeyChain, PageKey
from cluster.serving.events_relay import CurveKeys

log = logging.getLogger("raykv.router")
END_SEQ = -1
REPLAY_TIMEOUT_S = 2.0
POLL_S = 0.05  # how soon the thread sees a replica come or go
MAX_BATCHES_PER_TURN = 512  # per socket per turn: one busy replica cannot starve the others
GPU_MEDIA = (None, "GPU")  # the engine's own cache (vLLM tags offloaded blocks "CPU", ...)
_decoder = msgspec.msgpack.Decoder()


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where a replica publishes: what its `record_routing_stats` advertises. `epoch` changes
    when its engine starts over, so a new engine is never taken for the old one. `curve`: the
    keys its relay admits (None: vLLM's own sockets, no authentication)."""

    endpoint: str
    replay_endpoint: str | None = None
    epoch: str = ""
    curve: CurveKeys | None = None

    @staticmethod
    def of(advertised: Mapping) -> EventSource:
        return EventSource(str(advertised["endpoint"]), advertised.get("replay_endpoint"),
                           str(advertised.get("epoch", "")), CurveKeys.of(advertised.get("curve")))

    def socket(self, context: zmq.Context, kind: int) -> zmq.Socket:
        """A socket of `kind` for this source, with its keys set (before it connects)."""
        sock = context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.apply(sock)
        return sock


def decode_batch(payload: bytes) -> list[EngineEvent]:
    """vLLM's KVEventBatch bytes as the core's events: blocks of the engine's own GPU cache,
    first KV-cache group; a block with a LoRA adapter or extra hash keys is not plain."""
    batch = _decoder.decode(payload)
    events: list[EngineEvent] = []
    for raw in batch[1]:
        kind = raw.get("type")
        if kind == "AllBlocksCleared":
            events.append(Cleared())
        elif raw.get("medium") not in GPU_MEDIA or raw.get("group_idx") not in (None, 0):
            continue
        elif kind == "BlockStored":
            plain = raw.get("lora_id") is None and raw.get("lora_name") is None \
                and not any(extra is not None for extra in raw.get("extra_keys") or ())
            events.append(Stored(tuple(map(_hashable, raw["block_hashes"])),
                                 _hashable(raw.get("parent_block_hash")),
                                 tuple(raw["token_ids"]), int(raw["block_size"]), plain))
        elif kind == "BlockRemoved":
            events.append(Removed(tuple(map(_hashable, raw["block_hashes"]))))
    return events


def _readable(payload: bytes) -> list[EngineEvent]:
    """The batch's events; a batch that cannot be read clears the engine's blocks (what it
    changed is unknown: nothing before it is trusted)."""
    try:
        return decode_batch(payload)
    except Exception as error:
        log.warning("engine events: an unreadable batch (%s): the engine's blocks are dropped",
                    error)
        return [Cleared()]


def _hashable(block_hash):
    return tuple(block_hash) if isinstance(block_hash, list) else block_hash


@dataclass
class _Link:
    """One replica's sockets (the thread's alone) and the replay it waits for."""

    source: EventSource
    sub: zmq.Socket
    replay: zmq.Socket | None = None
    replay_deadline_s: float = 0.0
    replayed: list[tuple[int, Sequence[EngineEvent]]] = field(default_factory=list)


class EngineEvents:
    """Every replica's engine, from its events (module docstring). `watch` says which
    replicas publish where; `held_pages` answers from what has arrived."""

    def __init__(self, chain: KeyChain, replay_timeout_s: float = REPLAY_TIMEOUT_S):
        self.chain = chain
        self.replay_timeout_s = replay_timeout_s
        self._lock = threading.Lock()
        self._wanted: dict[str, EventSource] = {}
        self._streams: dict[str, EngineStream] = {}
        self._following: dict[str, EventSource] = {}  # the source each stream is of
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, advertised: Mapping[str, Mapping]) -> None:
        """The replicas to follow (replica id -> what its routing stats advertise: endpoint,
        replay_endpoint, epoch); the others are forgotten."""
        sources = {r: EventSource.of(a) for r, a in advertised.items()}
        with self._lock:
            if sources != self._wanted:
                self._wanted = dict(sources)
        if self._thread is None and sources:
            self._thread = threading.Thread(target=self._run, name="raykv-engine-events",
                                            daemon=True)
            self._thread.start()

    def held_pages(self, keys: Sequence[PageKey], replica_ids: Iterable[str]) -> dict[str, int]:
        """Per replica followed: the leading pages of `keys` its engine holds whole."""
        with self._lock:
            return {r: self._streams[r].held_pages(keys) for r in replica_ids
                    if r in self._streams}

    def stats(self) -> dict[str, dict]:
        """Per replica: its stream's counters, next sequence number and blocks."""
        with self._lock:
            return {r: {**s.counters, "next_seq": s.next_seq, "replaying": s.replaying,
                        "blocks": s.blocks.num_blocks, "epoch": self._following[r].epoch}
                    for r, s in self._streams.items()}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        context = zmq.Context()
        links: dict[str, _Link] = {}
        try:
            while not self._stop.is_set():
                self._sync(context, links)
                poller = zmq.Poller()
                for link in links.values():
                    poller.register(link.sub, zmq.POLLIN)
                    if link.replay is not None:
                        poller.register(link.replay, zmq.POLLIN)
                ready = dict(poller.poll(POLL_S * 1000)) if links else {}
                if not links:
                    self._stop.wait(POLL_S)
                for replica_id, link in links.items():
                    self._service(replica_id, link, ready)
        except Exception:  # the router goes on without the engine tier
            log.exception("engine events: the subscriber stopped")
        finally:
            for link in links.values():
                _close(link)
            with self._lock:  # nothing followed any more: nothing is claimed held
                self._streams.clear()
                self._following.clear()
            context.term()

    def _sync(self, context: zmq.Context, links: dict[str, _Link]) -> None:
        """Sockets for the replicas wanted now: new ones joined (and replayed from their
        start), gone or restarted ones closed with their streams."""
        with self._lock:
            wanted = dict(self._wanted)
        for replica_id in [r for r, link in links.items() if wanted.get(r) != link.source]:
            _close(links.pop(replica_id))
            with self._lock:
                self._streams.pop(replica_id, None)
                self._following.pop(replica_id, None)
        for replica_id, source in wanted.items():
            if replica_id in links:
                continue
            sub = source.socket(context, zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(source.endpoint)
            links[replica_id] = link = _Link(source, sub)
            stream = EngineStream(self.chain)
            with self._lock:
                self._streams[replica_id] = stream
                self._following[replica_id] = source
                start = stream.begin_replay()
            self._ask_replay(context, link, start, replica_id)

    def _service(self, replica_id: str, link: _Link, ready: dict) -> None:
        if link.sub in ready:
            for _ in range(MAX_BATCHES_PER_TURN):
                try:
                    _, seq_bytes, payload = link.sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._live(replica_id, link, int.from_bytes(seq_bytes, "big"), payload)
        if link.replay is not None and link.replay in ready:
            self._read_replay(replica_id, link)
        if link.replay is not None and time.monotonic() > link.replay_deadline_s:
            log.warning("engine events: no replay from %s in %.1f s", link.source.replay_endpoint,
                        self.replay_timeout_s)
            self._end_replay(replica_id, link)

    def _live(self, replica_id: str, link: _Link, seq: int, payload: bytes) -> None:
        events = _readable(payload)
        with self._lock:
            stream = self._streams.get(replica_id)
            start = stream.on_batch(seq, events) if stream is not None else None
        if start is not None:
            self._ask_replay(link.sub.context, link, start, replica_id)

    def _ask_replay(self, context: zmq.Context, link: _Link, start: int,
                    replica_id: str) -> None:
        if link.replay is not None:
            link.replay.close(linger=0)
        if not link.source.replay_endpoint:
            link.replay = None
            with self._lock:
                self._streams[replica_id].on_replay_failed()
            return
        link.replay = link.source.socket(context, zmq.DEALER)
        link.replay.connect(link.source.replay_endpoint)
        link.replay.send_multipart((b"", start.to_bytes(8, "big")))
        link.replay_deadline_s = time.monotonic() + self.replay_timeout_s
        link.replayed = []

    def _read_replay(self, replica_id: str, link: _Link) -> None:
        while link.replay is not None:
            try:
                frames = link.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_SEQ:
                self._end_replay(replica_id, link)
                return
            link.replayed.append((seq, _readable(frames[3])))

    def _end_replay(self, replica_id: str, link: _Link) -> None:
        """The replay is over (its end marker, or its time is up): what came is applied."""
        link.replay.close(linger=0)
        link.replay = None
        with self._lock:
            stream = self._streams.get(replica_id)
            if stream is not None:
                stream.on_replay(link.replayed)
        link.replayed = []


def _close(link: _Link) -> None:
    link.sub.close(linger=0)
    if link.replay is not None:
        link.replay.close(linger=0)
