"""The one place that calls actors' methods (`.remote()`): small wrappers around each actor's
handle.

Callers get ObjectRefs back (actors await them; the face's drivers ray.get them with a
timeout), so unit tests can swap a wrapper for a fake without Ray. Actor creation lives in
actors/spawn.py and actors/spawn_node.py: the actor classes import these wrappers, so this
module imports no actor class (the import graph stays acyclic).
"""

from __future__ import annotations

import asyncio

import ray

from cluster.core.config import CacheConfig
from cluster.core.dataplane.endpoint import Endpoint
from cluster.core.events import EventBatch
from cluster.core.geometry import PageGeometry
from cluster.core.keys import PageKey, shard_of

DIRECTORY_NAME = "raykv-directory-{shard}"
NODE_NAME = "raykv-node-{node_id}"
CONTROLLER_NAME = "raykv-controller"
CONTROL_LOOP_NAME = "raykv-control-loop"


def split_by_shard(keys: list[PageKey], num_shards: int) -> list[list[int]]:
    """Positions of `keys` owned by each shard, in chain order."""
    if num_shards == 1:
        return [list(range(len(keys)))]
    positions: list[list[int]] = [[] for _ in range(num_shards)]
    for position, key in enumerate(keys):
        positions[shard_of(key, num_shards)].append(position)
    return positions


def expand_runs(runs: list[list]) -> list:
    """[[locations, n], ...] -> one locations entry per page."""
    return [locations for locations, count in runs for _ in range(count)]


def merge_shard_prefixes(num_keys: int, positions: list[list[int]], answers: list[list]) -> list:
    """Per-shard prefix runs -> locations of each page of the global longest prefix.

    A shard stops at its own first miss, so the global prefix ends at the earliest position
    that some shard did not return.
    """
    pages = [expand_runs(runs) for runs in answers]
    if len(pages) == 1:
        return pages[0]
    found: list = [None] * num_keys
    for shard_positions, shard_pages in zip(positions, pages, strict=True):
        for position, locations in zip(shard_positions, shard_pages, strict=False):
            found[position] = locations
    prefix: list = []
    for locations in found:
        if not locations:
            break
        prefix.append(locations)
    return prefix


def _get_actor(name: str, config: CacheConfig):
    try:
        return ray.get_actor(name, namespace=config.ray_namespace)
    except ValueError:
        return None


class DirectoryHandle:
    """All directory shards, addressed by key."""

    def __init__(self, shards: list):
        self.shards = shards

    @staticmethod
    def lookup(config: CacheConfig) -> DirectoryHandle:
        """The running shards; ValueError when the service is not running."""
        shards = [ray.get_actor(DIRECTORY_NAME.format(shard=i), namespace=config.ray_namespace)
                  for i in range(config.num_directory_shards)]
        return DirectoryHandle(shards)

    @staticmethod
    def kill_found(config: CacheConfig) -> None:
        """Kill each directory shard that is still there; a missing one (killed, or gone with
        its node) is skipped, so that a stop still ends the rest."""
        for shard in range(config.num_directory_shards):
            actor = _get_actor(DIRECTORY_NAME.format(shard=shard), config)
            if actor is not None:
                ray.kill(actor, no_restart=True)

    @staticmethod
    def first_shard_config(ray_namespace: str):
        """A ref to the running service's config JSON, or None when none runs."""
        try:
            shard = ray.get_actor(DIRECTORY_NAME.format(shard=0), namespace=ray_namespace)
        except ValueError:
            return None
        return shard.get_config.remote()

    def apply(self, shard: int, batch: EventBatch):
        return self.shards[shard].apply.remote(batch)

    def replace_node(self, shard: int, batch: EventBatch):
        return self.shards[shard].replace_node.remote(batch)

    def prefix_refs(self, keys: list[PageKey]) -> tuple[list[list[int]], list]:
        """One call per shard, in parallel, each with its keys as one blob; merge the
        answers with merge_shard_prefixes."""
        positions = split_by_shard(keys, len(self.shards))
        refs = [shard.prefix_runs.remote(b"".join(keys[p] for p in shard_positions))
                for shard, shard_positions in zip(self.shards, positions, strict=True)]
        return positions, refs

    def record_demand(self, requests: list[list[PageKey]]) -> list:
        """Requests served without a match (each a chain of keys, all of them found): one
        call per shard that owns some of their keys, each request's keys there as one blob."""
        if not ray.is_initialized():  # the client's demand timer fired after ray.shutdown()
            return []                 # (see NodeHandle.touch: a call would auto-init Ray)
        positions = [split_by_shard(keys, len(self.shards)) for keys in requests]
        refs = []
        for shard_index, shard in enumerate(self.shards):
            blobs = [b"".join(keys[p] for p in request_positions[shard_index])
                     for keys, request_positions in zip(requests, positions, strict=True)]
            blobs = [blob for blob in blobs if blob]
            if blobs:
                refs.append(shard.record_demand.remote(blobs))
        return refs

    def hot_prefixes(self, limit: int) -> list:
        """Per shard, a ref to its most asked-for prefixes (a list of PrefixLoad)."""
        return [shard.hot_prefixes.remote(limit) for shard in self.shards]

    def drop_node(self, node_id: str) -> list:
        return [shard.drop_node.remote(node_id) for shard in self.shards]

    def stats(self) -> list:
        return [shard.stats.remote() for shard in self.shards]

    def ping(self) -> list:
        return [shard.ping.remote() for shard in self.shards]

    def ready(self) -> list:
        return [shard.ready.remote() for shard in self.shards]

    def get_config(self):
        return self.shards[0].get_config.remote()

    def flush_redis(self) -> list:
        return [shard.flush_redis.remote() for shard in self.shards]


class NodeHandle:
    """One node-cache actor."""

    def __init__(self, actor, node_id: str, is_local: bool = False):
        self.actor = actor
        self.node_id = node_id
        self.is_local = is_local

    @staticmethod
    def lookup(node_id: str, config: CacheConfig, is_local: bool = False) -> NodeHandle | None:
        actor = _get_actor(NODE_NAME.format(node_id=node_id), config)
        return None if actor is None else NodeHandle(actor, node_id, is_local)

    def descriptors(self, geometry: PageGeometry):
        return self.actor.descriptors.remote(geometry)

    def reserve(self, geometry: PageGeometry, keys: list[PageKey], namespace: str = "",
                tier: int | None = None):
        return self.actor.reserve.remote(geometry, keys, namespace, tier)

    def commit(self, reservation_id: int):
        return self.actor.commit.remote(reservation_id)

    def abort(self, reservation_id: int):
        return self.actor.abort.remote(reservation_id)

    def put_leased(self, geometry: PageGeometry, request):
        """Commit leased writes and top the slot lease up: a ref to (stamp, LeaseReply)
        (cluster/core/put_leases.py). None once this process has left Ray (the committer
        thread may outlive it: see touch)."""
        if not ray.is_initialized():
            return None
        return self.actor.put_leased.remote(geometry, request)

    def end_put_lease(self, lease_id: int):
        """None once this process has left Ray (the committer thread calls it: see touch)."""
        if not ray.is_initialized():
            return None
        return self.actor.end_put_lease.remote(lease_id)

    def acquire(self, geometry: PageGeometry, keys: list[PageKey], released: list[int] = ()):
        return self.actor.acquire.remote(geometry, keys, list(released))

    def release(self, lease_id: int):
        return self.actor.release.remote(lease_id)

    def put_pages(self, geometry: PageGeometry, keys: list[PageKey], pages: list,
                  namespace: str = ""):
        return self.actor.put_pages.remote(geometry, keys, pages, namespace)

    def dataplane(self):
        """A ref to the node's data-plane Endpoint (where its page server listens)."""
        return self.actor.dataplane.remote()

    def touch(self, geometry: PageGeometry, keys: list[PageKey], num_reads: int = 1,
              released: list[int] = ()):
        """Report pages read optimistically (without a lease), for eviction and hit counts,
        and the leases the client is done with. None when this process has left Ray: a
        client's touch timer may fire after ray.shutdown(), and a call then would make Ray
        start a new local cluster of its own (its auto-init), beside whatever the process
        starts next; the node, and its leases, went with the old one."""
        if not ray.is_initialized():
            return None
        return self.actor.touch.remote(geometry, keys, num_reads, list(released))

    def set_registry(self, registry):
        return self.actor.set_registry.remote(registry)

    def get_registry(self):
        return self.actor.get_registry.remote()

    def prefetch(self, geometry: PageGeometry, keys: list[PageKey], remote: dict | None = None):
        return self.actor.prefetch.remote(geometry, keys, remote)

    def namespaces(self, geometry: PageGeometry, keys: list[PageKey]):
        """Whose each of these pages is on that node (None: not held there)."""
        return self.actor.namespaces.remote(geometry, keys)

    def pull(self, geometry: PageGeometry, remote: dict, namespace: str = ""):
        """Copy pages from other nodes (node_id -> keys) into this node's host tier, over the
        data plane."""
        return self.actor.pull.remote(geometry, remote, namespace)

    def geometries(self, keys: list[PageKey]):
        """The page geometry of each key held there (None where not)."""
        return self.actor.geometries.remote(keys)

    def pin(self, geometry: PageGeometry, pin_id: bytes, keys: list[PageKey], ttl_s: float):
        """Pin the pages among `keys` stored there for `ttl_s` under `pin_id`: a ref to
        (the keys pinned, the pin replaced as (keys, seconds left) or None)."""
        return self.actor.pin.remote(geometry, pin_id, keys, ttl_s)

    def unpin(self, pin_id: bytes):
        """End the pin `pin_id` there: a ref to the keys it held."""
        return self.actor.unpin.remote(pin_id)

    def discard(self, geometry: PageGeometry, keys: list[PageKey]):
        """Drop these pages there (unpinned ones); returns how many."""
        return self.actor.discard.remote(geometry, keys)

    def ping(self):
        return self.actor.ping.remote()

    def open_pool(self, geometry: PageGeometry):
        """Check (and create) the pool for a geometry: ValueError past the node's limits."""
        return self.actor.open_pool.remote(geometry)

    def stats(self):
        return self.actor.stats.remote()

    def ready(self):
        return self.actor.ready.remote()

    def inventory(self):
        return self.actor.inventory.remote()

    def flush(self):
        return self.actor.flush.remote()

    def publish(self):
        """A ref to whether the directory acknowledged every change made there before it."""
        return self.actor.publish.remote()

    def shutdown(self):
        """Release the node's memory (its disk slabs stay for the next start)."""
        return self.actor.shutdown.remote()

    def purge(self):
        """Release the node's memory and remove its disk slabs."""
        return self.actor.purge.remote()

    def inject_fault(self, kind: str, **params):
        """Test-only: turn a fault on in the node actor (cluster/core/faults.py)."""
        return self.actor.inject_fault.remote(kind, **params)

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)


class ControllerHandle:
    """The membership (and, later, policy) loop."""

    def __init__(self, actor):
        self.actor = actor

    @staticmethod
    def lookup(config: CacheConfig) -> ControllerHandle | None:
        actor = _get_actor(CONTROLLER_NAME, config)
        return None if actor is None else ControllerHandle(actor)

    def sync_members(self):
        return self.actor.sync_members.remote()

    def registry(self):
        return self.actor.registry.remote()

    def register_model(self, spec, quota):
        return self.actor.register_model.remote(spec, quota)

    def add_namespace(self, name: str, quota):
        return self.actor.add_namespace.remote(name, quota)

    def namespace_secret(self, name: str):
        return self.actor.namespace_secret.remote(name)

    def peer_key(self):
        """The data plane's connection credential (for a client's reads)."""
        return self.actor.peer_key.remote()

    def node_keys(self):
        """(peer key, node key): a node actor's data-plane credentials."""
        return self.actor.node_keys.remote()

    def purge(self):
        """Forget the master secret the service made (its pages are being purged)."""
        return self.actor.purge.remote()

    def stats(self):
        return self.actor.stats.remote()

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)


class ControlLoopHandle:
    """The rebalancing control loop (actors/control_loop.py)."""

    def __init__(self, actor):
        self.actor = actor

    @staticmethod
    def lookup(config: CacheConfig, name: str = CONTROL_LOOP_NAME) -> ControlLoopHandle | None:
        actor = _get_actor(name, config)
        return None if actor is None else ControlLoopHandle(actor)

    def start(self):
        return self.actor.start.remote()

    def step(self):
        """One pass now; a ref to its summary."""
        return self.actor.step.remote()

    def stats(self):
        return self.actor.stats.remote()

    def stop(self):
        return self.actor.stop.remote()

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)


class PeerCache:
    """Other nodes' actor handles and data-plane endpoints, looked up once (a GCS call, an
    actor call) and kept; a node whose actor is not found is looked up again next time, and a
    dead one can be forgotten."""

    def __init__(self, config: CacheConfig):
        self.config = config
        self._handles: dict[str, NodeHandle] = {}
        self._endpoints: dict[str, Endpoint] = {}

    def get(self, node_id: str) -> NodeHandle | None:
        handle = self._handles.get(node_id)
        if handle is None:
            handle = NodeHandle.lookup(node_id, self.config)
            if handle is not None:
                self._handles[node_id] = handle
        return handle

    async def aget(self, node_id: str) -> NodeHandle | None:
        """get() without blocking the event loop (get_actor is a blocking GCS call)."""
        if node_id in self._handles:
            return self._handles[node_id]
        return await asyncio.to_thread(self.get, node_id)

    def endpoint(self, node_id: str) -> Endpoint | None:
        """The node's data-plane endpoint if known (NodeHandle.dataplane tells it)."""
        return self._endpoints.get(node_id)

    def remember_endpoint(self, node_id: str, endpoint: Endpoint) -> None:
        self._endpoints[node_id] = endpoint

    def forget(self, node_id: str) -> None:
        self._handles.pop(node_id, None)
        self._endpoints.pop(node_id, None)
