"""Fakes of the actor handles (actors/handles.py) and a driver for the client's steps, so the
face's call logic runs in unit tests without Ray: a fake call returns a FakeRef holding a
value or an exception, and `drive` answers each Wait with them."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from actors.handles import split_by_shard
from cluster.calls import Wait
from cluster.core.dataplane.endpoint import Endpoint
from cluster.core.directory_index import DirectoryIndex
from cluster.core.geometry import PageGeometry
from cluster.core.keys import KEY_BYTES, shard_of
from cluster.core.put_leases import LeaseReply, LeaseRequest
from cluster.core.tiers.memory import SlabStamp
from cluster.core.tiers.slot_table import as_places


@dataclass
class FakeRef:
    value: object = None
    late: object = None  # what a call that timed out (value: a TimeoutError) answers after

    def result(self) -> object:
        return self.value

    def future(self) -> Future:
        """As ObjectRef.future(): done with the call's answer (when_answered's hook)."""
        answer = Future()
        answer.set_result(self.late if isinstance(self.value, TimeoutError) else self.value)
        return answer


def drive(steps, before_work=None):
    """run_sync without Ray: each Wait gets its refs' values (exceptions included); each Work
    runs inline, after `before_work()` when given (to force a race)."""
    reply = None
    try:
        while True:
            step = steps.send(reply)
            if isinstance(step, Wait):
                reply = [ref.result() for ref in step.refs]
            else:
                if before_work is not None:
                    before_work()
                reply = step.fn()
    except StopIteration as done:
        return done.value


@dataclass
class FakeNode:
    """A node actor: answers from `arenas` (real shared-memory arenas of the core) and a dict
    key -> (tier, slot); any method can be told to fail."""

    node_id: str
    arenas: list = field(default_factory=list)
    pages: dict = field(default_factory=dict)  # key -> (tier, slot)
    exported: dict = field(default_factory=dict)  # key -> page bytes (numpy), for other nodes
    epoch: int = 1
    is_local: bool = False
    fail: set = field(default_factory=set)
    calls: list = field(default_factory=list)
    put_tier: int = 1
    on_disk: set = field(default_factory=set)  # keys an acquire reads up from disk first

    def stamp(self) -> SlabStamp:
        """The epoch and the layout version of the arenas, as the node actor's replies."""
        return SlabStamp(self.epoch, sum(a.layout_version for a in self.arenas))

    def _call(self, name: str, value: object) -> FakeRef:
        """`name` in `fail`: the call raised; f"{name} late" in it: it timed out, and answers
        `value` after."""
        self.calls.append(name)
        if name in self.fail:
            return FakeRef(RuntimeError(f"{self.node_id} {name} failed"))
        if f"{name} late" in self.fail:
            return FakeRef(TimeoutError(f"{self.node_id} {name}: no answer in time"), value)
        return FakeRef(value)

    def acquire(self, geometry: PageGeometry, keys: list, released: list = ()):
        """(stamp, lease id, slot table, pages read up from disk: those in `on_disk`)."""
        self.released = getattr(self, "released", []) + list(released)
        located = []
        for key in keys:
            if key not in self.pages:
                break
            tier, slot = self.pages[key]
            located.append((tier, slot, self.arenas[tier].generation(slot)))
        num_disk = sum(key in self.on_disk for key in keys[: len(located)])
        return self._call("acquire", (self.stamp(), 7 if located else 0, as_places(located),
                                      num_disk))

    def release(self, lease_id: int):
        return self._call("release", None)

    def descriptors(self, geometry: PageGeometry):
        return self._call("descriptors", (self.stamp(), [a.descriptor() for a in self.arenas]))

    def dataplane(self):
        return self._call("dataplane", Endpoint("fake", self.node_id, 1, self.epoch))

    def pull(self, geometry: PageGeometry, remote: dict, namespace: str = ""):
        return self._call("pull", sum(len(keys) for keys in remote.values()))

    def touch(self, geometry: PageGeometry, keys: list, num_reads: int = 1,
              released: list = ()):
        self.touched = getattr(self, "touched", []) + list(keys)
        self.released = getattr(self, "released", []) + list(released)
        return self._call("touch", len(keys))

    # puts: reserve in `put_tier` (the host arena unless told), commit makes them visible
    def reserve(self, geometry: PageGeometry, keys: list, namespace: str = "",
                tier: int | None = None):
        put_tier = self.put_tier if tier is None else tier
        slots = []
        for key in keys:
            if key in self.pages:
                slots.append(None)
                continue
            slot = self.arenas[put_tier].alloc()
            if slot is None:
                break
            slots.append((put_tier, slot, self.arenas[put_tier].generation(slot)))
        self.reserved = dict(zip(keys, slots, strict=False))
        return self._call("reserve", (self.stamp(), 42, slots))

    def commit(self, reservation_id: int):
        placed = {k: s[:2] for k, s in self.reserved.items() if s is not None}
        if "commit" not in self.fail and "lapse" not in self.fail:
            self.pages.update(placed)
        return self._call("commit", 0 if "lapse" in self.fail else len(placed))

    def abort(self, reservation_id: int):
        for slot in getattr(self, "reserved", {}).values():
            if slot is not None:
                self.arenas[slot[0]].free(slot[1])
        self.reserved = {}
        return self._call("abort", None)

    # leased puts (cluster/core/put_leases.py): slots leased in `put_tier`, committed by key
    def put_leased(self, geometry: PageGeometry, request: LeaseRequest):
        leased = self.__dict__.setdefault("leased", set())
        committed = []
        for key, place in zip(request.keys, request.slots, strict=True):
            slot = tuple(place)[:2]  # (tier, slot, generation): the fake checks no generation
            ours = slot in leased and "lapse" not in self.fail
            leased.discard(slot)
            committed.append(ours and key not in self.pages)
            if committed[-1]:
                self.pages[key] = slot
            elif ours:
                self.arenas[slot[0]].free(slot[1])
        places = []
        for _ in range(request.want):
            slot = self.arenas[self.put_tier].alloc()
            if slot is None:
                break
            leased.add((self.put_tier, slot))
            places.append((self.put_tier, slot, self.arenas[self.put_tier].generation(slot)))
        return self._call("put_leased", (self.stamp(), LeaseReply(committed, 5, places, 30.0)))

    def publish(self):
        return self._call("publish", True)

    def end_put_lease(self, lease_id: int):
        return self._call("end_put_lease", 0)

    def put_pages(self, geometry: PageGeometry, keys: list, pages: list, namespace: str = ""):
        return self._call("put_pages", len(keys))


class FakeDirectory:
    """Shards answering from real DirectoryIndex objects; a shard can be told to fail."""

    def __init__(self, num_shards: int = 1):
        self.indexes = [DirectoryIndex() for _ in range(num_shards)]
        self.failing: set[int] = set()

    def place(self, node_id: str, keys: list, tier: int) -> None:
        for shard, index in enumerate(self.indexes):
            mine = [(k, tier) for k in keys if shard_of(k, len(self.indexes)) == shard]
            inventory = index.node_inventory(node_id) + mine
            index.replace_node(node_id, 1, inventory, seq=len(inventory))

    def record_demand(self, requests: list) -> list:
        self.demand = getattr(self, "demand", []) + [list(keys) for keys in requests]
        return []

    def prefix_refs(self, keys: list):
        self.matches = getattr(self, "matches", 0) + 1
        positions = split_by_shard(keys, len(self.indexes))
        refs = []
        for shard, (index, shard_positions) in enumerate(zip(self.indexes, positions,
                                                             strict=True)):
            if shard in self.failing:
                refs.append(FakeRef(TimeoutError("shard down")))
                continue
            blob = b"".join(keys[p] for p in shard_positions)
            refs.append(FakeRef(index.prefix_runs(
                [blob[i : i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)])))
        return positions, refs


class FakePeers:
    def __init__(self, nodes: dict):
        self.nodes = nodes
        self.forgotten: list[str] = []
        self.endpoints: dict = {}

    def get(self, node_id: str):
        return self.nodes.get(node_id)

    def endpoint(self, node_id: str):
        return self.endpoints.get(node_id)

    def remember_endpoint(self, node_id: str, endpoint) -> None:
        self.endpoints[node_id] = endpoint

    def forget(self, node_id: str) -> None:
        self.forgotten.append(node_id)
        self.endpoints.pop(node_id, None)


class FakeTransport:
    """Serves each read from the `exported` pages of the node its endpoint names: a node
    with "serve" in its `fail` set is unreachable (None)."""

    def __init__(self, nodes: dict):
        self.nodes = nodes
        self.reads: list = []

    def read(self, reads: list, timeout_s: float) -> list:
        counts = []
        for read in reads:
            self.reads.append(read)
            node = self.nodes.get(read.endpoint.host)
            if node is None or "serve" in node.fail:
                counts.append(None)
                continue
            count = 0
            for key, dest in zip(read.keys, read.dests, strict=True):
                if key not in node.exported:
                    break
                _scatter(node.exported[key], dest)
                count += 1
            counts.append(count)
        return counts

    def close(self) -> None:
        pass


def _scatter(page, buffers) -> None:
    raw, offset = memoryview(page.reshape(-1).view("uint8")), 0
    for buffer in buffers:
        buffer[:] = raw[offset : offset + len(buffer)]
        offset += len(buffer)
