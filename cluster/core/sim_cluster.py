"""A discrete-event model of a raykv cluster serving a block trace.

    SimNode       one node's device, host and disk tiers, in blocks, each ordered by one of
                  raykv's eviction policies (policies/eviction.py, the Pool's registry), moved
                  as the Pool moves pages: a put fills the top tier and spills into host, room
                  is made by demoting victims a tier down (disk's victims are dropped), a hit
                  is promoted to the device tier; every change goes out as a directory event
    SimDirectory  raykv's sharded directory: one DirectoryIndex per shard, fed by each node's
                  EventStream batches; a lookup splits the keys by shard (shard_of) and merges
                  the shards' prefixes with the client's own functions (passed in)
    SimCluster    N nodes, their engine queues (sim_events.py) and, when `shared`, the
                  directory, so that any node can fetch a page that another holds (over the
                  NIC, and from the holder's disk where that is its best copy); without it
                  each node sees its own cache only (the local baselines)

Per request (`serve`): the control loop's passes due by its arrival run (each at its own
time, after the completions due by then); due completions put their pages; the router picks a
node (and may cut its plan: fetch only the leading pages, recompute the rest); the node's plan
is which pages of the prompt's full blocks it reads, and from where; TTFT = queue wait + fetch
(per source: latency + bytes / bandwidth) + prefill of the rest (sim_profiles.py). A page read
from another node is acquired there, as the live page server does (an access; read up from
disk and promoted).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import filterfalse, repeat

from cluster.core.demand import PrefixDemand
from cluster.core.directory_index import APPLIED, DirectoryIndex
from cluster.core.events import EventStream
from cluster.core.geometry import DEVICE, DISK, HOST
from cluster.core.keys import PageKey
from cluster.core.sim_events import Clock, EngineQueue
from cluster.core.sim_holders import HoldersCache
from cluster.core.sim_profiles import HardwareProfile, ModelCost
from cluster.core.trace_format import BLOCK_TOKENS
from policies.eviction import make_policy
from policies.queue_wait import BusyMeter

Split = Callable[[list, int], list]  # actors.handles.split_by_shard
Merge = Callable[[int, list, list], list]  # actors.handles.merge_shard_prefixes
REMOTE = 3  # a plan's source kind for a page read from another node's memory (device, host)
REMOTE_DISK = 4  # ... from another node's disk: its best copy anywhere is on a disk
SOURCE_NAMES = ("device", "host", "disk", "remote", "remote_disk")


def _never(_key: PageKey) -> bool:
    return False


class SimNode:
    """One node's tiers (see module doc). `on_events(keys, tier or None)`: the Pool's
    `on_event(key, tier)` for each of `keys` (EventStream.record_many)."""

    def __init__(self, capacities_blocks: Sequence[int], eviction: str,
                 on_events: Callable[[Sequence[PageKey], int | None], None] | None = None
                 ) -> None:
        self.capacities = list(capacities_blocks)
        self.tier_of: dict[PageKey, int] = {}
        self.counts = [0, 0, 0]
        self.policies = [make_policy(eviction, max(1, c)) for c in self.capacities]
        self.on_events = on_events
        self.evictions = [0, 0, 0]

    def local_prefix(self, keys: Sequence[PageKey]) -> int:
        count = 0
        tier_of = self.tier_of
        for key in keys:
            if key not in tier_of:
                break
            count += 1
        return count

    def put(self, keys: Sequence[PageKey]) -> int:
        """Store the pages not held yet: top tier first, the rest spilling into host."""
        tier_of = self.tier_of
        fresh = list(filterfalse(tier_of.__contains__, dict.fromkeys(keys)))  # in C
        stored = 0
        for tier in (DEVICE, HOST):
            capacity = self.capacities[tier]
            if not fresh or capacity == 0:
                continue
            # Fresh pages are in no tier, so no policy can name one: nothing to pin.
            self._make_room(tier, min(len(fresh), capacity), _never)
            room = capacity - self.counts[tier]
            self._place(fresh[:room], tier, chained=True)
            stored += min(room, len(fresh))
            fresh = fresh[room:]
        return stored

    def acquire(self, keys: Sequence[PageKey]) -> list[int]:
        """A hit on `keys` (held here): their tiers before, then each is accessed and the ones
        below the top memory tier (device, else host) are moved up to it, disk pages read up
        as the Pool reads them. The request's own pages are pinned, as the Pool pins them:
        no demotion that their promotion causes, in any tier, takes one of them."""
        tier_of, policies = self.tier_of, self.policies
        tiers = [tier_of[k] for k in keys]
        for key, tier in zip(keys, tiers, strict=True):
            policies[tier].on_access(key)
        top = DEVICE if self.capacities[DEVICE] else HOST
        lower = [k for k, t in zip(keys, tiers, strict=True) if t > top]
        capacity = self.capacities[top]
        if lower and capacity:
            self._make_room(top, min(len(lower), capacity), frozenset(keys).__contains__)
            moved = lower[: capacity - self.counts[top]]
            self._unplace(moved)
            self._place(moved, top)
        return tiers

    def discard(self, keys: Sequence[PageKey]) -> int:
        """Drop the pages of `keys` held here (the control loop's drop); how many."""
        held = [k for k in dict.fromkeys(keys) if k in self.tier_of]
        self._unplace(held)
        if held and self.on_events:
            self.on_events(held, None)
        return len(held)

    def _place(self, keys: list[PageKey], tier: int, chained: bool = False) -> None:
        """Into `tier` (with room for them), in order. `chained`: the new pages of one put,
        each inserted with the one before as its parent, as Pool.commit does (moves: None)."""
        if not keys:
            return
        self.tier_of.update(dict.fromkeys(keys, tier))
        self.policies[tier].on_insert_many(keys, None, chained)
        self.counts[tier] += len(keys)
        if self.on_events:
            self.on_events(keys, tier)

    def _unplace(self, keys: list[PageKey]) -> None:
        """Out of whatever tier holds each (no event: the caller tells where it went)."""
        tier_of, counts, policies = self.tier_of, self.counts, self.policies
        for key in keys:
            tier = tier_of.pop(key)
            counts[tier] -= 1
            policies[tier].on_remove(key)

    def _make_room(self, tier: int, num_pages: int, is_pinned: Callable[[PageKey], bool]
                   ) -> None:
        shortfall = self.counts[tier] + num_pages - self.capacities[tier]
        if shortfall <= 0:
            return
        policy = self.policies[tier]
        victims = policy.victims(shortfall, is_pinned)
        policy.on_remove_many(victims)  # the tier's policy holds only the tier's pages
        self.counts[tier] -= len(victims)
        self.evictions[tier] += len(victims)
        self._demote(victims, tier + 1, is_pinned)

    def _demote(self, keys: list[PageKey], tier: int,
                is_pinned: Callable[[PageKey], bool] = _never) -> None:
        """Into the next tier that exists (making room there, `is_pinned` kept), else dropped.
        The keys left their tier: tier_of still names it until they are placed or dropped
        here."""
        if not keys:
            return
        while tier <= DISK and self.capacities[tier] == 0:
            tier += 1
        if tier > DISK:
            room = 0
        else:
            # The demoted pages left the tier above, so this tier's policy cannot name one;
            # a hit's own pages below (pinned) must stay where they are.
            self._make_room(tier, min(len(keys), self.capacities[tier]), is_pinned)
            room = self.capacities[tier] - self.counts[tier]
            self._place(keys[:room], tier)
        if room < len(keys):
            dropped = keys[room:]
            tier_of = self.tier_of
            for key in dropped:
                del tier_of[key]
            if self.on_events:
                self.on_events(dropped, None)


class SimDirectory:
    """The directory's shards, with key operations and calls counted per shard."""

    def __init__(self, num_shards: int, split: Split, merge: Merge) -> None:
        self.shards = [DirectoryIndex() for _ in range(num_shards)]
        self.split, self.merge = split, merge
        self.demand = [PrefixDemand() for _ in range(num_shards)]  # as each shard's actor
        self.key_ops = [0] * num_shards  # keys looked up + changes applied
        self.calls = [0] * num_shards  # lookups + batches
        self.holders = HoldersCache(self.shards)  # the control loop's holders() answers

    def join(self, stream: EventStream) -> None:
        """A node's first message to every shard: its (empty) inventory."""
        for index, shard in enumerate(self.shards):
            batch = stream.resync(index, [])
            accepted = shard.replace_node(stream.node_id, stream.epoch, [], batch.seq)
            stream.on_resync(index, batch.seq, accepted)

    def sync(self, stream: EventStream) -> None:
        for index, batch in stream.outgoing():
            self.holders.before_apply(index, stream.node_id, batch.changes)
            status = self.shards[index].apply(batch)
            stream.on_status(index, batch.seq, status)
            self.key_ops[index] += len(batch.changes)
            self.calls[index] += 1
            if status != APPLIED:
                raise RuntimeError(f"shard {index} answered {status} to batch {batch.seq}")

    def locate(self, keys: list[PageKey], now_s: float = 0.0) -> list:
        """Each page of the longest prefix held anywhere: its (node_id, tier) places. Each
        shard records its keys' match in its demand tracker, as the directory actor does."""
        positions = self.split(keys, len(self.shards))
        answers = []
        for index, shard_positions in enumerate(positions):
            if not shard_positions:
                answers.append([])
                continue
            self.key_ops[index] += len(shard_positions)
            self.calls[index] += 1
            shard_keys = [keys[p] for p in shard_positions]
            runs = self.shards[index].prefix_runs(shard_keys)
            self.demand[index].record(shard_keys, sum(n for _, n in runs), now_s)
            answers.append(runs)
        return self.merge(len(keys), positions, answers)


@dataclass(frozen=True, slots=True)
class Route:
    """A router's answer when it also decides how much of the cached prefix to fetch: the
    node, and the leading pages of its plan that it reads (the rest are recomputed)."""

    node: int
    fetch_pages: int


@dataclass(slots=True)
class SimRequest:
    arrival_s: float
    keys: list  # page keys of the prompt's full blocks
    input_tokens: int
    num_blocks: int  # every block of the prompt, the partial last one included


@dataclass(slots=True)
class Tally:
    ttft_s: list = field(default_factory=list)
    hit_tokens: int = 0
    input_tokens: int = 0
    request_hit_sum: float = 0.0  # sum over requests of hit tokens / input tokens
    remote_bytes: int = 0
    # device, host, disk, remote (another node's memory), remote_disk (SOURCE_NAMES)
    hits_by_source: list = field(default_factory=lambda: [0, 0, 0, 0, 0])


class SimCluster:
    """N nodes under one profile; `shared`: raykv's directory and cross-node fetches."""

    def __init__(self, profile: HardwareProfile, model: ModelCost, num_nodes: int,
                 eviction: str, directory: SimDirectory | None = None) -> None:
        self.profile, self.model = profile, model
        self.page_bytes = BLOCK_TOKENS * model.kv_bytes_per_token
        self.capacities = [profile.device_kv_bytes // self.page_bytes,
                           profile.host_kv_bytes // self.page_bytes,
                           profile.disk_kv_bytes // self.page_bytes]
        self.node_ids = [str(i) for i in range(num_nodes)]
        self.index_of = {node_id: i for i, node_id in enumerate(self.node_ids)}
        self.directory = directory
        self.streams = []
        self.nodes = []
        for node_id in self.node_ids:
            on_events = None
            if directory is not None:
                stream = EventStream(node_id, 1, len(directory.shards))
                directory.join(stream)
                self.streams.append(stream)
                on_events = stream.record_many
            self.nodes.append(SimNode(self.capacities, eviction, on_events))
        self.queues = [EngineQueue() for _ in self.node_ids]
        self._queue_lens = [0] * num_nodes  # requests queued or running, kept by events
        # heap: (finish_s, node, service_s, request id: serve's count of requests before it)
        self._finishes: list[tuple[float, int, float, int]] = []
        self.num_served = 0  # the next request's id (`serve` numbers requests from 0)
        # Told of each request's end, in the order they end: on_finished(request id, node,
        # finish_s). The sim models prefill only, so a request ends when its prefill does,
        # which is when the live router hears of it (Serve's on_request_completed).
        self.on_finished: list[Callable[[int, int, float], None]] = []
        # Per node: its compute seconds per request, measured as its requests finish (the
        # live replica's RateMeter; the raykv router reads them: policies/queue_wait.py)
        self.busy = [BusyMeter() for _ in self.node_ids]
        self.clock = Clock()
        self.tally = Tally()
        self.gets = [0] * num_nodes  # per node: requests it served pages to (its own, remote)
        self.control: Callable | None = None  # control(cluster, now_s), e.g. SimControlLoop

    @property
    def shared(self) -> bool:
        return self.directory is not None

    def locate(self, keys: list[PageKey], now_s: float = 0.0) -> list | None:
        return self.directory.locate(keys, now_s) if self.directory is not None else None

    def plan(self, node: int, keys: list[PageKey], located: list | None) -> list[int]:
        """Where node `node` reads each page of its cached prefix: a tier of its own
        (DEVICE, HOST, DISK), REMOTE (another node's device or host copy) or REMOTE_DISK
        (only other nodes' disks hold it)."""
        here = self.nodes[node].tier_of
        if located is None:
            return [here[k] for k in keys[: self.nodes[node].local_prefix(keys)]]
        out = list(map(here.get, keys[: len(located)], repeat(None)))
        if None in out:
            last, kind = None, REMOTE
            for index, places in enumerate(located):
                if out[index] is None:
                    if places is not last:  # a run's pages share one answer: once a run
                        last = places
                        kind = REMOTE if any(t != DISK for _, t in places) else REMOTE_DISK
                    out[index] = kind
        return out

    def holders(self, node: int, keys: list[PageKey], sources: Sequence[int],
                located: list) -> dict[int, list[PageKey]]:
        """The nodes the remote pages of a plan are read from, each with its pages: per page,
        the holder of its best copy (the lowest tier; the first named of equals)."""
        out: dict[int, list[PageKey]] = {}
        last, holder = None, 0
        for key, source, places in zip(keys, sources, located, strict=False):
            if source < REMOTE:
                continue
            if places is not last:
                last = places
                holder = self.index_of[min(places, key=lambda place: place[1])[0]]
            out.setdefault(holder, []).append(key)
        out.pop(node, None)  # the directory's answer is this node's own (cannot be: remote)
        return out

    def fetch_s(self, sources: Sequence[int]) -> float:
        """Each source's pages in one transfer: its latency + bytes / its bandwidth."""
        p = self.profile
        paths = ((DEVICE, 0.0, p.hbm_bytes_per_s),
                 (HOST, p.host_latency_s, p.host_to_device_bytes_per_s),
                 (DISK, p.disk_latency_s, p.disk_bytes_per_s),
                 (REMOTE, p.nic_latency_s, p.nic_bytes_per_s),
                 # read off the holder's disk, then over the NIC: both latencies, the slower
                 (REMOTE_DISK, p.disk_latency_s + p.nic_latency_s,
                  min(p.disk_bytes_per_s, p.nic_bytes_per_s)))
        total_s = 0.0
        if not sources:
            return total_s
        for source, latency_s, bytes_per_s in paths:
            count = sources.count(source)
            if count:
                total_s += latency_s + count * self.page_bytes / bytes_per_s
        return total_s

    def service_s(self, sources: Sequence[int], input_tokens: int) -> float:
        hit_tokens = min(len(sources) * BLOCK_TOKENS, max(0, input_tokens - 1))
        return self.fetch_s(sources) + self.profile.prefill_s(self.model, hit_tokens,
                                                              input_tokens)

    def queue_lengths(self, now_s: float) -> list[int]:
        """Per node: requests queued or running at `now_s` (EngineQueue.queue_len of each,
        kept incrementally: a router asks for all N at every arrival). Each request finished
        by then is measured by its node's BusyMeter, in the order they finished."""
        finishes, lens, busy, listeners = (self._finishes, self._queue_lens, self.busy,
                                           self.on_finished)
        while finishes and finishes[0][0] <= now_s:
            finish_s, node, service_s, request_id = heapq.heappop(finishes)
            lens[node] -= 1
            busy[node].finished(service_s)
            for listener in listeners:
                listener(request_id, node, finish_s)
        return list(lens)

    def busy_s_per_request(self) -> list[float]:
        """Per node: its compute seconds per request as measured so far (0.0 before its
        first finished request; call queue_lengths(now) first to measure up to now)."""
        return [meter.busy_s_per_request for meter in self.busy]

    def complete(self, now_s: float) -> None:
        """Put the pages of every prefill finished by `now_s`, on its node."""
        for node, keys in self.clock.advance(now_s):
            self.nodes[node].put(keys)
            self.sync_node(node)

    def sync_node(self, node: int) -> None:
        if self.directory is not None:
            self.directory.sync(self.streams[node])

    def serve(self, request: SimRequest, choose: Callable) -> float:
        """One request through `choose(cluster, request, located) -> node or Route`; its
        TTFT. A plain node reads every page of its plan."""
        if self.control is not None:  # its passes due by now, each at its own time
            self.control(self, request.arrival_s)
        self.complete(request.arrival_s)
        located = self.locate(request.keys, request.arrival_s)
        choice = choose(self, request, located)
        node, fetch_pages = ((choice.node, choice.fetch_pages) if isinstance(choice, Route)
                             else (choice, None))
        sources = self.plan(node, request.keys, located)[:fetch_pages]
        local = [k for k, s in zip(request.keys, sources, strict=False) if s < REMOTE]
        servers = (self.holders(node, request.keys, sources, located)
                   if len(local) < len(sources) else {})
        self._count_gets(node, local, servers)
        if local:
            self.nodes[node].acquire(local)
            self.sync_node(node)
        for server, keys in servers.items():  # the page server acquires what it serves
            self.nodes[server].acquire(keys)
            self.sync_node(server)
        service_s = self.service_s(sources, request.input_tokens)
        _, finish_s = self.queues[node].admit(request.arrival_s, service_s, request.num_blocks)
        self.clock.schedule(finish_s, (node, request.keys))
        heapq.heappush(self._finishes, (finish_s, node, service_s, self.num_served))
        self.num_served += 1
        self._queue_lens[node] += 1
        self._count(request, sources, finish_s - request.arrival_s)
        return finish_s - request.arrival_s

    def _count_gets(self, node: int, local: list, servers: dict) -> None:
        if local:
            self.gets[node] += 1
        for server in servers:
            self.gets[server] += 1

    def _count(self, request: SimRequest, sources: list[int], ttft_s: float) -> None:
        tally = self.tally
        tally.ttft_s.append(ttft_s)
        tally.input_tokens += request.input_tokens
        tally.hit_tokens += len(sources) * BLOCK_TOKENS
        if request.input_tokens:
            tally.request_hit_sum += len(sources) * BLOCK_TOKENS / request.input_tokens
        by_source = tally.hits_by_source
        for source in set(sources):
            by_source[source] += sources.count(source)
        tally.remote_bytes += (sources.count(REMOTE) + sources.count(REMOTE_DISK)) \
            * self.page_bytes

    def finish(self) -> None:
        """Complete every prefill still running (their puts land)."""
        for node, keys in self.clock.drain():
            self.nodes[node].put(keys)
            self.sync_node(node)
