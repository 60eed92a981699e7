"""The Serve deployments: EngineDeployment (the model on the cache, one replica per kv node
by default) and the replica-side plumbing around the Engine.

Which cache a replica uses is chosen when the app is deployed: raykv's shared cache (a raykv
client per namespace), or, with LocalCacheSettings, only the replica's own prefix cache
(cluster/serving/local_cache.py), the baseline that `raykv bench serve` compares against."""

from __future__ import annotations

import asyncio

import ray
import torch
from ray import serve

from cluster.api import connect
from cluster.serving.engine import Chunk, Engine, EngineConfig, GenerationRequest
from cluster.serving.local_cache import LocalCacheSettings, LocalPrefixCache


@serve.deployment(max_ongoing_requests=4, max_replicas_per_node=1,
                  ray_actor_options={"num_cpus": 1, "resources": {"kv_node": 0.001}})
class EngineDeployment:
    """One engine replica: a model and a cache client per namespace (raykv's, or with
    `local_cache` the replica's own cache's)."""

    def __init__(self, config: EngineConfig, spec_check: str,
                 local_cache: LocalCacheSettings | None = None):
        torch.set_num_threads(1)  # replicas share the node's cores with each other
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        replica = serve.get_replica_context().replica_id.unique_id
        self.clients: dict = {}
        self.engine = Engine(config, self.clients, f"{self.node_id[:8]}/{replica[:8]}")
        assert self.engine.spec.name == spec_check, "ingress and engine disagree on the model"
        self._connect_lock = asyncio.Lock()
        self.local_cache = None
        if local_cache is not None:
            self.local_cache = LocalPrefixCache(self.engine.spec, local_cache)
        # Paid here, not by the first requests: the default namespace's client, and the
        # model's first forward (one-off allocations).
        self.clients["default"] = self._connect("default")
        self.engine.warm_up()

    def _connect(self, namespace: str):
        if self.local_cache is not None:
            return self.local_cache.client(namespace)
        return connect(self.engine.spec, namespace)

    async def generate(self, request: GenerationRequest):
        """Stream Chunks: the first has no text (it carries the request's figures)."""
        await self._client(request.namespace)
        async for chunk in self.engine.generate(request):
            yield chunk

    async def _client(self, namespace: str):
        async with self._connect_lock:
            if namespace not in self.clients:
                self.clients[namespace] = await asyncio.to_thread(self._connect, namespace)
        return self.clients[namespace]

    async def stats(self) -> dict:
        """The engine's counters, its raykv clients' (local and remote pages fetched), and
        its own prefix cache's (pages held, matched, evicted) when it has one."""
        clients = {ns: dict(c.counters) for ns, c in self.clients.items()}
        own = {} if self.local_cache is None else {"local_cache": self.local_cache.stats()}
        meter = self.engine.meter
        return {"replica": self.engine.replica, "node_id": self.node_id,
                **self.engine.counters, "clients": clients, **own,
                "rates": {} if meter is None else meter.published()}

    async def drain(self) -> dict:
        """Wait for background stores; then the replica's counters."""
        await self.engine.drain()
        return await self.stats()

    def record_routing_stats(self) -> dict:
        """Published to routers by Serve: compact facts about this replica, with its
        measured rates for cost-based routing (the directory stays the source of truth for
        where pages are)."""
        meter = self.engine.meter
        return {"node_id": self.node_id, "requests": self.engine.counters["requests"],
                "rates": {} if meter is None else meter.published()}


__all__ = ["Chunk", "EngineDeployment"]
