"""ControlLoop: snapshots in, the rebalancing policy called, its plan applied.

Every `rebalance_period_s`:

    snapshot   ray.nodes() -> kv nodes; each node actor's stats (requests served, memory);
               each directory shard's hot_prefixes (demand, keys, holders); page geometry of
               new prefixes asked of a holder (cached)
    decide     policy(snapshot, state, now_s) -> (plan, state)   (policies/rebalance.py)
    apply      copy:  target.pull(geometry, {source: keys})
               move:  target.pull(...), then once the target holds them, source.discard(keys)
               drop:  source.discard(keys)            (a copy lives on elsewhere)
               scale: request_resources(bundles)      (actors/autoscaler.py)

A pass that fails (a policy that raises, a dead directory) is logged and counted by
BackgroundLoops, and the next pass runs as usual; a failed action is a count, never a crash.
The policy is a constructor argument, so tests can hand it one that raises.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import deque
from collections.abc import Callable

import ray

from actors.autoscaler import request_bundles
from actors.handles import DirectoryHandle, NodeHandle, PeerCache
from cluster.core.config import CacheConfig
from cluster.core.geometry import PageGeometry
from cluster.core.loops import BackgroundLoops
from cluster.core.membership import kv_nodes
from policies import rebalance
from policies.migration import Move
from policies.rebalance import RebalancePlan, RebalanceSettings
from policies.replication import Replicate
from policies.scaling import ScalingSettings
from policies.snapshot import ClusterSnapshot, NodeLoad, PrefixLoad

log = logging.getLogger("raykv.control")
SNAPSHOT_PREFIXES = 64  # per directory shard
MAX_GEOMETRIES_CACHED = 4096
Policy = Callable[[ClusterSnapshot, object, float], tuple[RebalancePlan, object]]


def default_policy(config: CacheConfig) -> Policy:
    """policies/rebalance.py with the scaling bounds of `config`."""
    scaling = ScalingSettings(min_nodes=config.min_kv_nodes, max_nodes=config.max_kv_nodes,
                              node_resource=config.node_resource)
    return functools.partial(rebalance.decide, settings=RebalanceSettings(scaling=scaling))


def node_load(node_id: str, stats: dict, config: CacheConfig) -> NodeLoad:
    """A node actor's stats as the policies see them: requests served (gets through the actor,
    gets its clients made straight from shared memory, and requests its page server served
    other nodes), and its memory tiers' use against their budget.

    With the elastic pool, the node reports its tiers' capacity and what is held
    (stats["memory"]["tiers"]). Without it, every page geometry (pool) gets the whole
    per-tier budgets, so the budget is `num_pools` times the configured one.
    """
    num_requests = (stats["gets"] + stats.get("optimistic_reads", 0)
                    + stats.get("dataplane", {}).get("requests", 0))
    tiers = (stats.get("memory") or {}).get("tiers")
    if tiers:
        memory = [tiers[name] for name in ("device", "host") if name in tiers]
        return NodeLoad(node_id, num_requests, sum(t["held_bytes"] for t in memory),
                        sum(t["capacity_bytes"] for t in memory))
    used_bytes = stats["bytes"]["device"] + stats["bytes"]["host"]
    budget_bytes = (config.device_bytes + config.host_bytes) * max(1, stats.get("num_pools", 1))
    return NodeLoad(node_id, num_requests, used_bytes, budget_bytes)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class ControlLoop:
    """The rebalancing loop of the service (see module docstring)."""

    def __init__(self, config_json: str, policy: Policy | None = None):
        self.config = CacheConfig.model_validate_json(config_json)
        self.policy = policy or default_policy(self.config)
        self.state = None
        self.directory = DirectoryHandle.lookup(self.config)
        self.peers = PeerCache(self.config)
        self.geometries: dict[bytes, PageGeometry] = {}
        self.loops = BackgroundLoops()
        self.counters = dict.fromkeys(("passes", "copies", "copied_pages", "moves", "drops",
                                       "dropped_pages", "scale_requests", "failed_actions"), 0)
        self.events: deque[dict] = deque(maxlen=512)  # recent actions, newest last
        self.last: dict = {}
        self.scale_todo = None  # a scale request not yet through to the GCS
        self._lock = asyncio.Lock()  # one pass at a time (the loop's, or a caller's step())

    async def start(self) -> bool:
        """Start the periodic pass (once)."""
        if not self.loops.tasks:
            self.loops.every("rebalance", self.config.rebalance_period_s, self.step)
        return True

    async def step(self) -> dict:
        """One pass now: snapshot, decide, apply; returns its summary. What the policy
        raises propagates (the periodic loop logs it and carries on)."""
        async with self._lock:
            snapshot, handles = await self._snapshot()
            plan, self.state = self.policy(snapshot, self.state, time.monotonic())
            self.counters["passes"] += 1
            await self._apply(plan, handles)
        self.last = {"nodes": len(snapshot.nodes), "prefixes": len(snapshot.prefixes),
                     "hot_prefixes": len(plan.burst.hot_prefixes),
                     "hot_nodes": sorted(plan.burst.hot_nodes), "copies": len(plan.copies),
                     "moves": len(plan.moves),
                     "scale": None if plan.scale is None else plan.scale.num_nodes}
        return self.last

    async def stats(self) -> dict:
        return {**self.counters, "loop_errors": dict(self.loops.errors),
                "running": self.loops.running(), "last": self.last, "events": list(self.events)}

    async def stop(self) -> None:
        self.loops.cancel_all()

    # ---- the snapshot --------------------------------------------------------------------

    def _timeout_s(self) -> float:
        return self.config.call_timeout_s

    async def _gather(self, refs: list) -> list:
        """Each ref's value, or the exception it raised or its timeout."""
        return await asyncio.gather(*(asyncio.wait_for(r, self._timeout_s()) for r in refs),
                                    return_exceptions=True)

    async def _snapshot(self) -> tuple[ClusterSnapshot, dict[str, NodeHandle]]:
        node_ids = kv_nodes(self.config.node_resource, await asyncio.to_thread(ray.nodes))
        found = [(n, await self.peers.aget(n)) for n in node_ids]
        handles = {n: h for n, h in found if h is not None}
        replies = await self._gather([h.stats() for h in handles.values()]
                                     + self.directory.hot_prefixes(SNAPSHOT_PREFIXES))
        nodes, alive = [], {}
        for (node_id, handle), reply in zip(handles.items(), replies, strict=False):
            if isinstance(reply, BaseException):
                self.peers.forget(node_id)
                continue
            nodes.append(node_load(node_id, reply, self.config))
            alive[node_id] = handle
        shards = [r for r in replies[len(handles):] if not isinstance(r, BaseException)]
        if len(shards) < len(replies) - len(handles):
            log.warning("some directory shards did not answer: their prefixes wait a pass")
        prefixes = await self._with_geometry([p for shard in shards for p in shard], alive)
        return ClusterSnapshot(tuple(nodes), tuple(prefixes)), alive

    async def _with_geometry(self, prefixes: list[PrefixLoad],
                             handles: dict[str, NodeHandle]) -> list[PrefixLoad]:
        """The prefixes with their page size, asking one holder per unknown prefix."""
        asks: dict[str, list[bytes]] = {}
        for prefix in prefixes:
            if prefix.prefix_id not in self.geometries:
                holder = next((h for h in prefix.holders if h in handles), None)
                if holder is not None:
                    asks.setdefault(holder, []).append(prefix.prefix_id)
        if len(self.geometries) > MAX_GEOMETRIES_CACHED:
            self.geometries.clear()
        replies = await self._gather([handles[n].geometries(keys) for n, keys in asks.items()])
        for keys, reply in zip(asks.values(), replies, strict=True):
            if not isinstance(reply, BaseException):
                self.geometries.update((k, g) for k, g in zip(keys, reply, strict=True) if g)
        return [dataclasses.replace(p, page_bytes=self.geometries[p.prefix_id].page_bytes)
                if p.prefix_id in self.geometries else p for p in prefixes]

    # ---- applying a plan -----------------------------------------------------------------

    async def _apply(self, plan: RebalancePlan, handles: dict[str, NodeHandle]) -> None:
        actions = [self._copy(c, handles) for c in plan.copies]
        actions += [self._move(m, handles) for m in plan.moves]
        outcomes = await asyncio.gather(*actions, return_exceptions=True)
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        self.scale_todo = plan.scale or self.scale_todo
        if self.scale_todo is not None:
            try:
                await self._scale(self.scale_todo)
                self.scale_todo = None
            except Exception as error:  # the GCS may be busy: asked again next pass
                failures.append(error)
        if failures:
            self.counters["failed_actions"] += len(failures)
            log.warning("%d rebalancing actions failed; first: %r", len(failures), failures[0])

    async def _scale(self, scale) -> None:
        await asyncio.to_thread(request_bundles, [dict(b) for b in scale.bundles])
        self.counters["scale_requests"] += 1
        self._event("scale", nodes=scale.num_nodes, reason=scale.reason)

    def _event(self, kind: str, **fields) -> None:
        self.events.append({"kind": kind, "time_s": time.time(), **fields})

    async def _copy(self, copy: Replicate, handles: dict[str, NodeHandle]) -> None:
        geometry, target = self.geometries.get(copy.prefix_id), handles.get(copy.target)
        if geometry is None or target is None:
            return
        pulled = await asyncio.wait_for(target.pull(geometry, {copy.source: list(copy.keys)}),
                                        self._timeout_s())
        self.counters["copies"] += 1
        self.counters["copied_pages"] += pulled
        self._event("copy", prefix=copy.prefix_id.hex(), source=copy.source,
                    target=copy.target, pages=pulled)

    async def _move(self, move: Move, handles: dict[str, NodeHandle]) -> None:
        geometry, source = self.geometries.get(move.prefix_id), handles.get(move.source)
        if geometry is None or source is None:
            return
        keys = list(move.keys)
        if move.target is not None:
            target = handles.get(move.target)
            if target is None:
                return
            await asyncio.wait_for(target.pull(geometry, {move.source: keys}), self._timeout_s())
            held = await asyncio.wait_for(target.geometries(keys), self._timeout_s())
            if not all(held):
                return  # the copy did not land: keep ours
        dropped = await asyncio.wait_for(source.discard(geometry, keys), self._timeout_s())
        self.counters["moves" if move.target else "drops"] += 1
        self.counters["dropped_pages"] += dropped
        self._event("move" if move.target else "drop", prefix=move.prefix_id.hex(),
                    source=move.source, target=move.target, pages=dropped)
