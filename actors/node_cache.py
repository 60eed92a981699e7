"""NodeCacheActor: a thin async Ray shell around one node's NodeStore and EventStream.

It owns the node's tiers, serves same-node clients through shared memory (reserve/commit,
acquire/release), serves other nodes' readers through its data plane (a page server on the
node's address: cluster/core/dataplane/), pulls pages from other nodes the same way, and ships
its `stored`/`removed` events to the directory shards through an EventStream (sequenced,
resent until acknowledged, resynced on request: cluster/core/events.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import time

import numpy as np
import ray

from actors.devices import expose_node_gpus
from actors.handles import ControllerHandle, DirectoryHandle
from actors.metrics import Metrics, NodePublisher
from actors.node_pull import PagePuller
from cluster.core.config import CacheConfig
from cluster.core.dataplane.auth import Guard
from cluster.core.dataplane.connections import shared_pool
from cluster.core.dataplane.endpoint import Endpoint
from cluster.core.dataplane.server import Listen
from cluster.core.dataplane.source import StoreSource
from cluster.core.dataplane.transport import make_transport
from cluster.core.events import APPLIED, EventStream
from cluster.core.faults import NodeFaults, apply_fault
from cluster.core.geometry import PageGeometry
from cluster.core.keys import PageKey
from cluster.core.loops import BackgroundLoops
from cluster.core.pool import PoolLimits
from cluster.core.put_leases import LeaseRequest
from cluster.core.registry import Registry
from cluster.core.store import NodeStore, StoreConfig, shm_bytes_per_node
from cluster.core.tiers.gpus import describe_budget, measure_gpus, vram_budget
from cluster.core.tiers.memory import SlabStamp, check_shm_room, cupy_available, num_cuda_devices
from cluster.core.tiers.node_slot import NodeSlot, claim_node_slot
from cluster.core.tiers.report import describe_tiers

log = logging.getLogger("raykv.node")
CREDENTIALS_WAIT_S = 60.0


def store_config(config: CacheConfig, slot: NodeSlot) -> StoreConfig:
    """The store's settings; on a GPU node the device tier is VRAM, device_bytes per GPU
    (without a GPU, or without cupy, one CPU stand-in of device_bytes)."""
    num_gpus = num_cuda_devices() if config.device_bytes and cupy_available() else 0
    device_bytes = config.device_bytes * max(1, num_gpus)
    limits = PoolLimits(device_bytes, config.host_bytes, config.disk_bytes, config.eviction,
                        config.disk_codec, num_gpus > 0, slot.shm_prefix, max(1, num_gpus))
    return StoreConfig(limits, slot.disk_dir, config.pin_lease_s, config.disk_threads,
                       config.max_geometries, config.reserve_lease_s, config.chunk_bytes,
                       config.disk_durability, config.max_pinned_fraction)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class NodeCacheActor:
    """One per node: the node's tiers, index and event stream."""

    def __init__(self, config_json: str, node_id: str):
        self.config = CacheConfig.model_validate_json(config_json)
        self.node_id = node_id
        self.epoch = time.time_ns()  # grows across restarts: the directory fences older ones
        self.slot = claim_node_slot(self.config.disk_dir)  # held until this process ends
        self.gpu_ids = expose_node_gpus()  # before anything initializes CUDA
        self.stream = EventStream(node_id, self.epoch, self.config.num_directory_shards)
        self.store = NodeStore(store_config(self.config, self.slot), self.stream.record)
        self.transport = make_transport(self.config.transport)
        self.server = None  # the page server, started with the loop (ready)
        self.directory = DirectoryHandle.lookup(self.config)
        self.loops = BackgroundLoops()
        self._flush_lock = asyncio.Lock()
        self._pending_flush: asyncio.Future | None = None
        self._pending_grow: asyncio.Future | None = None
        self._started: asyncio.Future | None = None
        self._closing = False  # shutdown began: calls after the fact are misses (touch)
        self._last_beat_s = 0.0
        self.registry: Registry | None = None
        self.publisher = NodePublisher(Metrics(node_id))
        self.recovered_pages = 0
        self.vram: list = []  # raykv's share of each GPU (cluster/core/tiers/gpus.py)
        self.counters = {"pulled_pages": 0, "failed_sends": 0, "discarded_pages": 0}
        self.puller = PagePuller(self.config, self.store, self.transport, self.counters)
        self.faults = NodeFaults()  # test-only: off (see inject_fault)

    async def ready(self) -> dict:
        """Check shared memory, recover disk pages, register with the directory, start the
        event loop. Every public method awaits this first, so an actor that Ray restarted on
        its own (max_restarts) recovers before it serves anything."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)
        return {"node_id": self.node_id, "epoch": self.epoch,
                "recovered_pages": self.recovered_pages}

    async def _start(self) -> None:
        limits = store_config(self.config, self.slot).limits
        check_shm_room(shm_bytes_per_node(limits))
        if limits.use_cuda:  # refuse, naming the fix, before taking any VRAM
            self.vram = vram_budget(self.config.device_bytes, measure_gpus())
            log.warning("raykv node %s VRAM: %s", self.node_id[:12], describe_budget(self.vram))
        self.recovered_pages = await asyncio.to_thread(self.store.recover_disk)
        loop = asyncio.get_running_loop()
        source = StoreSource(self.store, loop, self._transfer_timeout_s())
        self.puller.keys = await self._node_keys()  # (peer key, node key)
        guard = Guard(*self.puller.keys, lambda name: self._namespace_secret_from(loop, name))
        listen = Listen(ray.util.get_node_ip_address(), self.config.page_port, guard)
        self.server = self.transport.serve(source, listen, self._transfer_timeout_s(),
                                           self.epoch)
        log.warning("raykv node %s: %s; data plane %s://%s:%d", self.node_id[:12],
                    describe_tiers(limits, self.slot.disk_dir, self.gpu_ids),
                    self.server.endpoint.transport, *self.server.endpoint.address)
        await self.flush()
        self.loops.every("events", self.config.event_flush_s, self._tick)
        # Clients read the held-pages indexes while these stamps keep coming: a loop of its
        # own, so that a slow directory flush does not make them stop trusting a live node.
        self.loops.every("held", self.config.event_flush_s, self._beat)
        self.loops.every("ahead", self.config.event_flush_s, self._ahead)

    def _transfer_timeout_s(self) -> float:
        return self.config.call_timeout_s

    async def _node_keys(self) -> tuple[bytes, bytes]:
        """(peer key, node key) from the controller, which may be starting or restarting."""
        deadline_s = time.monotonic() + CREDENTIALS_WAIT_S
        while True:
            controller = ControllerHandle.lookup(self.config)
            try:
                if controller is not None:
                    return await asyncio.wait_for(controller.node_keys(),
                                                  self.config.call_timeout_s)
            except (ray.exceptions.RayError, asyncio.TimeoutError) as error:
                if time.monotonic() > deadline_s:
                    raise RuntimeError(f"no data-plane credentials from the controller: "
                                       f"{error}") from error
            if time.monotonic() > deadline_s:
                raise RuntimeError("no raykv controller to get data-plane credentials from")
            await asyncio.sleep(0.5)

    def _namespace_secret_from(self, loop: asyncio.AbstractEventLoop, name: str) -> bytes | None:
        """A namespace's secret, asked of the controller (from a page server's thread); None
        for a namespace it does not know, or when it does not answer (the read is refused)."""
        future = asyncio.run_coroutine_threadsafe(self._namespace_secret(name), loop)
        try:
            return future.result(self.config.call_timeout_s)
        except Exception as error:  # a refusal, never a crash of the connection thread
            log.warning("namespace %r: no secret from the controller: %s", name[:64], error)
            return None

    async def _namespace_secret(self, name: str) -> bytes:
        controller = ControllerHandle.lookup(self.config)
        if controller is None:
            raise RuntimeError("no raykv controller")
        return await asyncio.wait_for(controller.namespace_secret(name),
                                      self.config.call_timeout_s)

    async def _beat(self) -> None:
        self.store.beat()

    async def _ahead(self) -> None:
        """Work done between requests, off their paths: new host pages hashed (so that their
        demotion only writes), then the host tier's headroom freed by demoting its coldest
        pages (hashed by then, as a rule: those writes only write too)."""
        await self.store.checksum_ahead()
        if self.config.demote_ahead:
            await self.store.demote_ahead()

    async def _tick(self) -> None:
        self.store.expire()
        beat = time.monotonic() - self._last_beat_s >= self.config.heartbeat_s
        if await self.flush(heartbeat=beat) and beat:
            self._last_beat_s = time.monotonic()
        if beat:
            await self.store.shrink_idle(self.config.idle_shrink_s)
            self.publisher.publish(self.store.stats())

    def _directory_timeout_s(self) -> float:
        return max(0.5, self.config.call_timeout_s / 4)

    async def flush(self, heartbeat: bool = False) -> bool:
        """Resync shards that asked for it, then send new and unacknowledged batches (and a
        heartbeat); True when any shard answered."""
        async with self._flush_lock:
            answered = [await self._resync(index) for index in self.stream.resync_needed()]
            outgoing = self.stream.outgoing(heartbeat)
            if self.faults.events is not None:
                outgoing = self._lose_batches(outgoing)
            replies = await self._send([self.directory.apply(i, b) for i, b in outgoing])
            for (index, batch), reply in zip(outgoing, replies, strict=True):
                if isinstance(reply, BaseException):
                    self.stream.on_failure(index)
                else:
                    self.stream.on_status(index, batch.seq, reply)
                    answered.append(True)
            # A shard that answered RESYNC gets the inventory now, not a tick later.
            answered += [await self._resync(i) for i in self.stream.resync_needed()
                         if i in {index for index, _ in outgoing}]
        return any(answered)

    def _lose_batches(self, outgoing: list) -> list:
        """Test-only (event_batches fault): drop and reorder this flush's batches. A batch
        that timed out is resent; one that vanished is believed delivered, so only the
        directory's acked_upto and digest checks (a resync) can repair it."""
        sent, timed_out, vanished = self.faults.events.mangle(outgoing)
        for index, _ in timed_out:
            self.stream.on_failure(index)
        for index, batch in vanished:
            self.stream.on_status(index, batch.seq, APPLIED)
        return sent

    async def _resync(self, index: int) -> bool:
        inventory = self.stream.split_inventory(self.store.inventory())[index]
        batch = self.stream.resync(index, inventory)
        (reply,) = await self._send([self.directory.replace_node(index, batch)])
        if isinstance(reply, BaseException):
            self.stream.shards[index].needs_resync = True
            return False
        self.stream.on_resync(index, batch.seq, bool(reply))
        return True

    async def _send(self, refs: list) -> list:
        """Await each ref within the directory timeout; failures come back as exceptions."""
        timeout_s = self._directory_timeout_s()
        replies = await asyncio.gather(*(asyncio.wait_for(ref, timeout_s) for ref in refs),
                                       return_exceptions=True)
        failures = [r for r in replies if isinstance(r, BaseException)]
        if failures:
            self.counters["failed_sends"] += len(failures)
            log.warning("%d directory sends failed (will resend): %s", len(failures),
                        failures[0])
        return replies

    # ---- same-node clients (shared memory) -----------------------------------------------

    # Replies carry a SlabStamp: the epoch (a client whose mapping is from an earlier
    # incarnation of this actor, whose slabs are gone, must map the new slabs) and the pool's
    # layout version (device chunks granted or released since: map them again) before it
    # touches any slot of the reply.

    def _stamp(self, geometry: PageGeometry) -> SlabStamp:
        return SlabStamp(self.epoch, self.store.layout_version(geometry))

    async def descriptors(self, geometry: PageGeometry):
        """(stamp, [ArenaDescriptor per memory tier]): what a same-node client maps."""
        await self.ready()
        descriptors = self.store.descriptors(geometry)
        return SlabStamp(self.epoch, sum(d.layout_version for d in descriptors)), descriptors

    async def open_pool(self, geometry: PageGeometry) -> int:
        """Create (or find) the pool of a geometry; ValueError past max_geometries."""
        await self.ready()
        return self.store.pool(geometry).geometry.page_bytes

    async def reserve(self, geometry: PageGeometry, keys: list[PageKey], namespace: str = "",
                      tier: int | None = None):
        """(stamp, reservation_id, slots): see NodeStore.reserve (tier None: the fastest with
        room); each slot as (tier, slot, generation), which the client's copy checks under the
        slot's write fence. Then, after answering, the next memory chunk is readied ahead of
        the puts that will need it."""
        await self.ready()
        reservation_id, slots = await self.store.reserve(geometry, keys, tier, namespace)
        places = self.store.pool(geometry).places(slots)
        self._grow_soon(geometry)
        return self._stamp(geometry), reservation_id, places

    def _grow_soon(self, geometry: PageGeometry) -> None:
        if self._pending_grow is None or self._pending_grow.done():
            self._pending_grow = asyncio.ensure_future(self.store.grow_ahead(geometry))

    async def commit(self, reservation_id: int) -> int:
        """Make a reservation's pages visible here. The directory hears of them in a flush
        started after this answers (or the next tick's, every event_flush_s, when one is
        already under way): read-your-writes holds through this node at once (a client's next
        acquire here finds them), and across nodes a moment later."""
        await self.ready()
        committed = self.store.commit(reservation_id)
        if committed:  # tell the directory now, in the background, not on the put's path
            self._flush_soon()
        return committed

    async def put_leased(self, geometry: PageGeometry, request: LeaseRequest):
        """(stamp, LeaseReply): commit a client's leased writes, and lease it more free
        slots (cluster/core/put_leases.py); the directory hears of the commits as it does of
        a reservation's."""
        await self.ready()
        reply = await self.store.put_leased(geometry, request)
        if any(reply.committed):
            self._flush_soon()
        self._grow_soon(geometry)  # the next top-up takes only slots readied ahead
        return self._stamp(geometry), reply

    async def end_put_lease(self, lease_id: int) -> int:
        await self.ready()
        return self.store.end_put_lease(lease_id)

    async def publish(self) -> bool:
        """Tell the directory now of every change made here so far (a flush, after the one
        under way): True once every shard has acknowledged them, so that any client's
        lookup finds the pages committed before this call (KVClient.flush)."""
        await self.ready()
        marks = self.stream.marks()
        await self.flush()
        return self.stream.delivered(marks)

    def _flush_soon(self) -> None:
        if self._pending_flush is None or self._pending_flush.done():
            self._pending_flush = asyncio.ensure_future(self.flush())

    async def abort(self, reservation_id: int) -> None:
        await self.ready()
        self.store.abort(reservation_id)

    async def acquire(self, geometry: PageGeometry, keys: list[PageKey],
                      released: list[int] = ()):
        """Pin the longest local prefix of `keys`: (stamp, lease_id, places, num_disk), with
        places an int64 [N, 3] slot table of (tier, slot, generation) rows (slot_table.py)
        and num_disk how many of them were read up from disk for it. The caller's `released`
        leases (earlier gets', done) end first."""
        await self.ready()
        for done in released:
            self.store.release(done)
        lease_id, located = await self.store.acquire(geometry, keys)
        lease = self.store.leases.get(lease_id)
        places = np.fromiter(itertools.chain.from_iterable(located), dtype=np.int64,
                             count=3 * len(located)).reshape(-1, 3)
        return self._stamp(geometry), lease_id, places, lease.num_disk if lease else 0

    async def release(self, lease_id: int) -> None:
        await self.ready()
        self.store.release(lease_id)

    async def touch(self, geometry: PageGeometry, keys: list[PageKey], num_reads: int = 1,
                    released: list[int] = ()) -> int:
        """Accesses that clients read without a lease (optimistic reads, generation-checked):
        the eviction policy and the hit counters hear of them, after the fact; `num_reads`
        gets made them (the requests this node served). `released`: leases the client is
        done with."""
        await self.ready()
        if self._closing:
            return 0
        for done in released:
            self.store.release(done)
        try:
            return await self.store.touch(geometry, keys, num_reads)
        except Exception:
            # A shutdown (a purge, a stop) closed the tiers under it: what it would have
            # moved is gone anyway. Clients send touches without waiting for the answer, so
            # an error here would only be Ray's "unhandled error" on their console.
            if self._closing:
                return 0
            raise

    # ---- other nodes (the data plane) and clients without shared memory (Ray objects) ----

    async def dataplane(self) -> Endpoint:
        """Where this node's page server listens (transport, node address, port, epoch)."""
        await self.ready()
        return self.server.endpoint

    async def put_pages(self, geometry: PageGeometry, keys: list[PageKey], pages: list,
                        namespace: str = "") -> int:
        await self.ready()
        stored = await self.store.put_pages(geometry, keys, pages, None, namespace)
        await self.flush()
        return stored

    async def prefetch(self, geometry: PageGeometry, keys: list[PageKey],
                       remote: dict[str, list[PageKey]] | None = None) -> int:
        """Pull `remote` pages into the host tier and promote local ones; returns pages ready."""
        await self.ready()
        if remote:
            await self.pull(geometry, remote)
        return await self.store.prefetch(geometry, keys)

    async def pull(self, geometry: PageGeometry, remote: dict[str, list[PageKey]],
                   namespace: str = "") -> int:
        """Copy pages from other nodes (node_id -> keys) into this node's host tier, through
        the data plane (actors/node_pull.py); returns pages pulled. A page already being
        pulled for another request is awaited, not fetched twice; a dead or silent peer is a
        miss.
        """
        await self.ready()
        pulled = await self.puller.pull(geometry, remote, namespace)
        # Ready the host tier's next chunk now, off this pull's path, as a reserve does:
        # otherwise the next pull (a replication, a prefetch, an adoption) faults a whole
        # chunk in on its own path (tens of ms for 64 MiB).
        self._grow_soon(geometry)
        return pulled

    # ---- models, namespaces and their quotas ----------------------------------------------

    async def set_registry(self, registry: Registry) -> None:
        """Apply the service's models and namespaces and their quotas (pushed by the
        controller whenever they change)."""
        await self.ready()
        if self.registry is not None and registry.version < self.registry.version:
            return  # an older push overtaken by a newer one
        quotas, names = registry.pool_quotas()
        self.store.set_quotas(quotas, registry.namespaces, names)
        self.registry = registry

    async def get_registry(self) -> Registry | None:
        return self.registry

    # ---- rebalancing (the control loop) --------------------------------------------------

    async def geometries(self, keys: list[PageKey]) -> list[PageGeometry | None]:
        """The page geometry of each key held here (None where it is not): what a node that
        replicates a prefix needs to pull it."""
        await self.ready()
        return [self.store.geometry_of(key) for key in keys]

    async def namespaces(self, geometry: PageGeometry, keys: list[PageKey]) -> list[str | None]:
        """Whose each page held here is (None where it is not held; "" when not known)."""
        await self.ready()
        pool = self.store.pools.get(geometry)
        entries = [pool.index.get(key) if pool is not None else None for key in keys]
        return [None if entry is None else entry.namespace for entry in entries]

    async def discard(self, geometry: PageGeometry, keys: list[PageKey]) -> int:
        """Drop these pages here (a copy lives on elsewhere); pinned ones stay."""
        await self.ready()
        dropped = self.store.discard(geometry, keys)
        self.counters["discarded_pages"] += dropped
        await self.flush()
        return dropped

    # ---- operators' pins (cluster/operator.py) ----------------------------------------------

    async def pin(self, geometry: PageGeometry, pin_id: bytes, keys: list[PageKey],
                  ttl_s: float):
        """Keep the pages among `keys` stored here for `ttl_s`: see NodeStore.pin. Raises
        PinRefused (a ValueError) past the node's cap, pinning nothing."""
        await self.ready()
        return self.store.pin(geometry, pin_id, keys, ttl_s)

    async def unpin(self, pin_id: bytes) -> list[PageKey]:
        await self.ready()
        return self.store.unpin(pin_id)

    # ---- test-only fault injection (cluster/core/faults.py) -------------------------------

    async def inject_fault(self, kind: str, **params) -> dict:
        """Turn on a fault (slow_disk, full_disk, event_batches) or all off (clear); returns
        the faults now on. Off by default; for tests and `raykv bench faults` only."""
        await self.ready()
        apply_fault(self.faults, kind, params)
        self.store.set_disk_faults(self.faults.disk)
        log.warning("raykv node %s: fault %s %s", self.node_id[:12], kind, params)
        return self.faults.describe()

    # ---- introspection -------------------------------------------------------------------

    async def inventory(self) -> list[tuple[PageKey, int]]:
        await self.ready()
        return self.store.inventory()

    async def stats(self) -> dict:
        await self.ready()
        return {"node_id": self.node_id, "epoch": self.epoch, "disk_dir": self.slot.disk_dir,
                "pid": os.getpid(), "gpus": list(self.gpu_ids), **self.store.stats(),
                "vram": [{"uuid": s.uuid, "device_bytes": s.device_bytes,
                          "max_gpu_memory_utilization": s.max_gpu_memory_utilization}
                         for s in self.vram],
                "num_pools": len(self.store.pools), **self.counters,
                "dataplane": self._dataplane_stats(),
                "events": self.stream.stats(), "loops": self.loops.running(),
                "faults": self.faults.describe()}

    def _dataplane_stats(self) -> dict:
        server = self.server.stats() if self.server is not None else {}
        return {**server, "client": {**shared_pool().counters,
                                     "open": shared_pool().num_open}}

    async def shutdown(self) -> None:
        """Stop serving pages, close every data-plane connection, release the shared-memory
        slabs. Disk slabs stay for the next start."""
        self._closing = True
        self.loops.cancel_all()
        if self.server is not None:
            self.server.close()
        self.transport.close()
        self.store.close()

    async def purge(self) -> None:
        """shutdown(), then remove this node's slot directory (slab files, manifests) and its
        lock file."""
        await self.shutdown()
        await asyncio.to_thread(shutil.rmtree, self.slot.disk_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.slot.disk_dir + ".lock")

    async def ping(self) -> str:
        await self.ready()
        return self.node_id
