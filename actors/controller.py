"""Controller: watches Ray membership, keeps one node actor per kv node, and holds the
registry of models and namespaces with their quotas.

Nodes that join get an actor (and the registry); nodes Ray reports dead are purged from every
directory shard (the shards also purge on missed heartbeats, whichever comes first). It
catches and logs every error and never dies: a failed pass is retried on the next tick. A node
whose actor cannot start (say, /dev/shm too small) is reported by sync_members(), so start()
can say so. A registry change is pushed to every node; a restarted controller takes the
registry back from a node (the newest version it finds).

It alone holds the master secret (cluster/core/secrets.py: from the environment, a mounted
Kubernetes Secret, or a 0600 file on its node; never Redis). It hands out what derives from
it over Ray: a namespace's secret to that namespace's clients, the data plane's peer key to
clients, and the node key to node actors.
"""

from __future__ import annotations

import asyncio
import logging

import ray

from actors.handles import DirectoryHandle, NodeHandle
from actors.spawn_node import spawn_node
from cluster.core import secrets
from cluster.core.config import CacheConfig
from cluster.core.dataplane import auth
from cluster.core.loops import BackgroundLoops
from cluster.core.membership import dead_nodes, kv_nodes
from cluster.core.registry import Registry
from cluster.core.spec import ModelSpec
from policies.quota import Quota

log = logging.getLogger("raykv.controller")
MEMBERSHIP_S = 1.0
READY_TIMEOUT_S = 60.0


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Controller:
    """The service's membership loop (and, later, its policy loop)."""

    def __init__(self, config_json: str):
        self.config = CacheConfig.model_validate_json(config_json)
        self.directory = DirectoryHandle.lookup(self.config)
        self.members: dict[str, NodeHandle] = {}
        self.failures: dict[str, str] = {}
        self.dropped: set[str] = set()
        self.loops = BackgroundLoops()
        self._registry = Registry(self.config.page_tokens)
        for namespace in self.config.namespaces:
            self._registry.add_namespace(namespace)
        self._master, self._master_source = secrets.load_master(self.config.disk_dir)
        log.info("key chain's master secret from %s", self._master_source)
        self._forget_legacy_redis_master()

    def _forget_legacy_redis_master(self) -> None:
        """Delete the master an older raykv kept in Redis (it is never used again)."""
        if not self.config.redis_url:
            return
        key = f"raykv:{self.config.ray_namespace}:key-secret"
        try:
            if secrets.delete_legacy_redis_master(self.config.redis_url, key):
                log.warning("deleted the master secret an older raykv stored in Redis (%s); "
                            "pages keyed by it will miss", key)
        except Exception as error:  # Redis down: it is tried again at the next start
            log.warning("could not check Redis for an old master secret: %s", error)

    async def sync_members(self) -> dict:
        """One membership pass now (start() waits on it); starts the loop once.

        Returns {"members": [node ids], "failures": {node id: why its actor is not ready}}.
        """
        await self._pass()
        if not self.loops.tasks:
            self.loops.every("membership", MEMBERSHIP_S, self._pass)
        return {"members": sorted(self.members), "failures": dict(self.failures)}

    async def _pass(self) -> None:
        nodes = await asyncio.to_thread(ray.nodes)
        todo = [n for n in kv_nodes(self.config.node_resource, nodes) if n not in self.members]
        await asyncio.gather(*(self._add(node_id) for node_id in todo))
        for node_id in dead_nodes(nodes) - self.dropped:
            self.members.pop(node_id, None)
            self.failures.pop(node_id, None)
            self.dropped.add(node_id)
            await asyncio.gather(*self.directory.drop_node(node_id), return_exceptions=True)

    async def _add(self, node_id: str) -> None:
        node = spawn_node(self.config, node_id)
        try:
            await asyncio.wait_for(node.ready(), READY_TIMEOUT_S)
        except Exception as error:  # placement may fail on a node going away: retry later
            why = str(getattr(error, "cause", None) or error).strip().splitlines()[-1]
            if self.failures.get(node_id) != why:
                log.warning("node actor on %s not ready: %s", node_id[:8], why)
            self.failures[node_id] = why
            return
        self.failures.pop(node_id, None)
        self.members[node_id] = node
        await self._adopt_registry(node)
        await asyncio.gather(node.set_registry(self._registry), return_exceptions=True)
        log.info("node actor ready on %s", node_id[:8])

    async def _adopt_registry(self, node: NodeHandle) -> None:
        """A node's registry if it is newer than ours (this controller restarted)."""
        try:
            theirs = await asyncio.wait_for(node.get_registry(), READY_TIMEOUT_S)
        except Exception as error:  # a node that does not answer keeps no registry from us
            log.warning("could not read the registry of %s: %s", node.node_id[:8], error)
            return
        if theirs is not None and theirs.version > self._registry.version:
            self._registry = theirs

    # ---- models, namespaces, quotas --------------------------------------------------------

    async def registry(self) -> Registry:
        return self._registry

    async def register_model(self, spec: ModelSpec, quota: Quota | None) -> dict:
        """Add a model or set its quota; every node applies it. ValueError on a conflict."""
        self._registry.register_model(spec, quota)
        await self._push()
        return self._registry.describe()

    async def add_namespace(self, name: str, quota: Quota | None) -> dict:
        self._registry.add_namespace(name, quota)
        await self._push()
        return self._registry.describe()

    async def namespace_secret(self, name: str) -> bytes:
        """The namespace's key-chain secret (for its clients and the ingress that serves it);
        ValueError for a namespace not registered."""
        self._registry.check_namespace(name)
        return secrets.namespace_secret(self._master, name)

    async def peer_key(self) -> bytes:
        """The data plane's connection credential (clients and node actors prove it)."""
        return auth.peer_key(self._master)

    async def node_keys(self) -> tuple[bytes, bytes]:
        """(peer key, node key): what a node actor's page server and pulls need."""
        return auth.peer_key(self._master), auth.node_key(self._master)

    async def purge(self) -> None:
        """Forget the master secret this service made (the service's pages are being purged)."""
        await asyncio.to_thread(secrets.forget_master, self._master_source,
                                self.config.disk_dir)

    async def _push(self) -> None:
        replies = await asyncio.gather(*(node.set_registry(self._registry)
                                         for node in self.members.values()),
                                       return_exceptions=True)
        for reply in replies:
            if isinstance(reply, Exception):
                log.warning("a node did not take the registry (it gets it when it rejoins): "
                            "%s", reply)

    async def stats(self) -> dict:
        return {"members": sorted(self.members), "dropped": sorted(self.dropped),
                "failures": dict(self.failures), "loop_errors": dict(self.loops.errors)}
