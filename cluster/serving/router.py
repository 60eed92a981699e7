"""RaykvRouter: a Ray Serve request router that sends a request where its cached prefix is.

It runs where the handle is: in the ingress replica, which tokenized the prompt and put its
page keys on the request. Per request it asks the directory (one call per shard) where each
page of the longest cached prefix lives, scores each replica's node (policies/routing.py) and
returns ranks; Serve picks the least-loaded replica within the first rank with room. Without
hits, or when the directory does not answer in time, it is power-of-two choices.
"""

from __future__ import annotations

import asyncio
import logging

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.common import PendingRequest
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    RequestRouter,
    RunningReplica,
)

from actors.handles import DirectoryHandle, merge_shard_prefixes
from cluster.api import running_config
from cluster.core.spec import ModelSpec
from cluster.serving.prompt_keys import PromptKeys
from policies.routing import ReplicaLoad, has_hits, prefix_scores, rank_replicas

log = logging.getLogger("raykv.router")
KEY_BYTES = 16


class RaykvRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """KV-aware routing on Serve's RequestRouter API (see module docstring)."""

    def initialize_state(self, max_imbalance: int = 1, lookup_timeout_s: float = 0.5,
                         directory=None, prompt_keys: dict | None = None) -> None:
        """`max_imbalance`: queue-length lead past which a replica loses its rank.
        `directory`: a DirectoryHandle (tests pass a fake); found lazily otherwise.
        `prompt_keys`: for requests that carry text, not page keys (Ray Serve LLM's), how to
        key them: {"tokenizer_dir", "spec": ModelSpec fields, "namespace", "page_tokens"}."""
        self.max_imbalance = max_imbalance
        self.lookup_timeout_s = lookup_timeout_s
        self._directory = directory
        self._prompt_keys = None
        if prompt_keys:
            self._prompt_keys = PromptKeys(prompt_keys["tokenizer_dir"],
                                           ModelSpec(**prompt_keys["spec"]),
                                           prompt_keys.get("namespace", "default"),
                                           prompt_keys["page_tokens"])
        self.counters = {"ranked": 0, "fallback": 0, "lookup_failures": 0}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        keys_blob = await self._keys_of(pending_request)
        located = await self._locate(keys_blob) if keys_blob else []
        scores = prefix_scores(located, {r.node_id for r in candidate_replicas})
        if not has_hits(scores):
            self.counters["fallback"] += 1
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(
                self, candidate_replicas=candidate_replicas, pending_request=pending_request)
        loads = [ReplicaLoad(r.replica_id.unique_id, r.node_id,
                             self._replica_queue_len_cache.get(r.replica_id))
                 for r in candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        self.counters["ranked"] += 1
        return [[by_id[i] for i in rank]
                for rank in rank_replicas(loads, scores, self.max_imbalance)]

    async def _keys_of(self, pending_request: PendingRequest | None) -> bytes:
        keys_blob = _page_keys(pending_request)
        if keys_blob or self._prompt_keys is None or pending_request is None \
                or not pending_request.args:
            return keys_blob
        # Tokenizing is CPU work: off the handle's event loop.
        return await asyncio.to_thread(self._prompt_keys.of, pending_request.args[0])

    async def _locate(self, keys_blob: bytes) -> list:
        keys = [keys_blob[i : i + KEY_BYTES] for i in range(0, len(keys_blob), KEY_BYTES)]
        try:
            directory = await self._directory_handle()
            positions, refs = directory.prefix_refs(keys)
            answers = await asyncio.wait_for(asyncio.gather(*refs), self.lookup_timeout_s)
        except Exception as error:  # a slow or dead directory: route without it
            self.counters["lookup_failures"] += 1
            log.warning("directory lookup for routing failed: %s", error)
            return []
        return merge_shard_prefixes(len(keys), positions, answers)

    async def _directory_handle(self):
        if self._directory is None:
            config = await asyncio.to_thread(running_config)
            self._directory = await asyncio.to_thread(DirectoryHandle.lookup, config)
        return self._directory


def _page_keys(pending_request: PendingRequest | None) -> bytes:
    if pending_request is None or not pending_request.args:
        return b""
    return getattr(pending_request.args[0], "page_keys", b"") or b""
