"""CacheView: what one client's operations need to reach the service."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from actors.handles import DirectoryHandle, NodeHandle, PeerCache
from actors.metrics import Metrics
from cluster.calls import Steps, Wait, Work, failed, when_answered
from cluster.core.dataplane.auth import Authority
from cluster.core.dataplane.endpoint import Endpoint
from cluster.core.dataplane.transport import TcpTransport, Transport
from cluster.core.geometry import PageGeometry
from cluster.core.keys import PageKey
from cluster.core.tiers.slot_table import TIER, as_places
from cluster.slabs import LocalSlabs
from cluster.touches import DemandBatch, Gate, MetricBatch, TouchBatch
from policies.cost_routing import DISK, REMOTE, TIER_SOURCES

MAX_TRANSFERS = 64  # recent timed reads kept for whoever measures rates (the engine drains)


@dataclass(slots=True)
class CacheView:
    """One model's pages as a client sees them: its node, the directory and the peers.

    `home` is the node actor this client writes through: its own node's when there is one
    (`slabs` then maps its shared memory), else a remote one (puts travel as Ray objects).
    Pages of other nodes come over `transport`, straight from their slabs.
    """

    geometry: PageGeometry
    home: NodeHandle
    directory: DirectoryHandle
    peers: PeerCache
    slabs: LocalSlabs | None = None
    namespace: str = ""
    transport: Transport = field(default_factory=TcpTransport)
    call_timeout_s: float = 10.0
    fetch_s: float = 0.0  # the last get's time fetching remote pages (0: none fetched)
    counters: dict[str, int] = field(default_factory=lambda: {
        "put_tokens": 0, "get_tokens": 0, "lookups": 0, "local_pages": 0, "remote_pages": 0,
        "optimistic_pages": 0, "held_pages": 0, "stale_hints": 0, "failed_calls": 0,
        "torn_reads": 0, "unmapped_pages": 0, "leased_pages": 0, "uncommitted_pages": 0,
        "disk_direct_pages": 0, "disk_direct_us": 0})
    touches: TouchBatch | None = None  # set in __post_init__ when the slabs are mapped
    demand: DemandBatch | None = None  # likewise: prefixes this node served whole
    # Send the directory's match along with the acquire (fetch.py): the last asked get found
    # its node's prefix short of the request, so this one may need other nodes' pages too.
    early_directory: bool = False
    authority: Authority | None = None  # what remote reads prove (None: they miss)
    puts: object = None  # cluster/puts.py's LeasedPuts, made by the client on first use
    # Recent timed reads, (source, bytes, seconds), for the rate estimates of cost-based
    # routing (policies/cost_routing.py); bounded, so a client nobody drains keeps a few.
    transfers: deque = field(default_factory=lambda: deque(maxlen=MAX_TRANSFERS))
    metrics: MetricBatch | None = None  # set in __post_init__: this client's calls, as metrics
    # What the batches above are sent through from the sender thread: the client's views
    # pass ray_gate.background_call (out of ray.shutdown()'s way); None: always sent (fakes).
    gate: Gate | None = None

    def __post_init__(self) -> None:
        gate = self.gate
        self.metrics = MetricBatch(lambda: Metrics(self.home.node_id), gate)
        if self.slabs is not None:
            self.touches = TouchBatch(lambda keys, reads, released: self.home.touch(
                self.geometry, keys, reads, released), gate)
            self.demand = DemandBatch(self.directory.record_demand, gate)

    @property
    def local(self) -> NodeHandle | None:
        return self.home if self.slabs is not None else None

    @property
    def page_tokens(self) -> int:
        return self.geometry.shape[3]

    def empty(self, num_tokens: int) -> torch.Tensor:
        shape = list(self.geometry.shape)
        shape[3] = num_tokens
        return torch.empty(shape, dtype=self.geometry.torch_dtype())

    def note_failures(self, results: list) -> None:
        self.counters["failed_calls"] += sum(isinstance(r, BaseException) for r in results)

    def note_copy(self, places: list, seconds: float, num_runs: int = 0) -> None:
        """A timed copy of pages out of this node's slabs: a rate sample when they all sat in
        one tier (a copy from several cannot tell their speeds apart). `num_runs`: how many
        runs of slots the copy took, when the caller knows (one run is one tier: no pass over
        the places on a get's path)."""
        places = as_places(places)
        if not len(places):
            return
        tier = int(places[0, TIER])
        if num_runs == 1 or (places[:, TIER] == tier).all():
            self.transfers.append((TIER_SOURCES[tier], len(places) * self.geometry.page_bytes,
                                   seconds))

    def note_disk(self, num_pages: int, seconds: float) -> None:
        """Pages read from this node's disk tier, timed as the get paid for them: an
        acquire's round trip that read them up (the call's own latency included: a request
        pays it too), or this client's own read of the slab files (fetch._read_disk)."""
        if num_pages:
            self.transfers.append((DISK, num_pages * self.geometry.page_bytes, seconds))

    def note_remote(self, num_pages: int, seconds: float) -> None:
        """A timed read of pages from other nodes' page servers."""
        if num_pages:
            self.transfers.append((REMOTE, num_pages * self.geometry.page_bytes, seconds))

    def note_touched(self, keys: list[PageKey]) -> None:
        """Pages read without a lease: told to this node in batches, fire and forget."""
        if self.touches is not None:
            self.touches.note(keys)

    def note_demand(self, keys: list[PageKey]) -> None:
        """A request this node served whole, without a directory match: the directory's
        demand tracker hears of it in a batch (touches.DemandBatch)."""
        if self.demand is not None:
            self.demand.note(keys)

    def release_later(self, lease_id: int) -> None:
        """Done with a lease of this node's: it goes with the next call (touches.py)."""
        self.touches.release(lease_id)

    def release_when_answered(self, acquire_ref) -> None:
        """An acquire this client stopped waiting for (past its timeout, a bounded client's
        deadline say): the node still pins the prefix when it answers, so the lease it
        answers with goes with the next call, as any lease this client is done with.
        Left alone, those pages stayed pinned until the lease lapsed (pin_lease_s, 30 s),
        where no eviction could take them: a host tier's worth, under a slowed disk."""
        when_answered(acquire_ref, lambda reply: reply[1] and self.release_later(reply[1]))

    def take_released(self) -> list[int]:
        return self.touches.take_released() if self.touches is not None else []

    def flush_touched(self) -> None:
        self.metrics.flush()
        if self.touches is not None:
            self.touches.flush()
            self.demand.flush()

    def endpoints(self, node_ids: list[str]) -> Steps[dict[str, Endpoint | None]]:
        """The data-plane endpoints of these nodes: cached, else asked of their actors."""
        known = {node_id: self.peers.endpoint(node_id) for node_id in node_ids}
        unknown = [node_id for node_id, endpoint in known.items() if endpoint is None]
        if not unknown:
            return known
        handles = yield Work(lambda: {node_id: self.peers.get(node_id) for node_id in unknown})
        asking = [node_id for node_id in unknown if handles[node_id] is not None]
        replies = yield Wait([handles[node_id].dataplane() for node_id in asking])
        self.note_failures(replies)
        for node_id, reply in zip(asking, replies, strict=True):
            if failed(reply):
                self.peers.forget(node_id)
                continue
            self.peers.remember_endpoint(node_id, reply)
            known[node_id] = reply
        return known
