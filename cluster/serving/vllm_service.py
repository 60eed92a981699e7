"""How a vLLM process reaches raykv: the connector's settings, the page geometry read from
vLLM's config, and a lazy connection that treats an absent service as a miss (no vLLM import).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from cluster.core.spec import ModelSpec

log = logging.getLogger("raykv.vllm")
RETRY_CONNECT_S = 30.0


@dataclass(frozen=True, slots=True)
class RaykvSettings:
    """kv_connector_extra_config, read once.

    raykv.namespace    the raykv namespace (tenant) of the pages; "default"
    raykv.ray_address  the Ray cluster raykv runs on; RAY_ADDRESS, else "auto". A process
                       already connected to Ray (a Ray actor) keeps its connection.
    raykv.model_name   names the model in page keys; vLLM's served model name by default.
                       Give raykv's own name (e.g. "small-llama") to share pages with it.
    """

    namespace: str = "default"
    ray_address: str = "auto"
    model_name: str | None = None

    @staticmethod
    def from_extra(extra: dict | None) -> RaykvSettings:
        extra = extra or {}
        known = {"raykv.namespace", "raykv.ray_address", "raykv.model_name"}
        unknown = sorted(k for k in extra if k.startswith("raykv.") and k not in known)
        if unknown:
            raise ValueError(f"unknown raykv settings {unknown}; known: {sorted(known)}")
        return RaykvSettings(
            namespace=str(extra.get("raykv.namespace", "default")),
            ray_address=str(extra.get("raykv.ray_address")
                            or os.environ.get("RAY_ADDRESS") or "auto"),
            model_name=extra.get("raykv.model_name"))


def spec_of(vllm_config, model_name: str | None) -> ModelSpec:
    """The KV geometry one vLLM worker holds: layers, KV heads per tensor-parallel rank, head
    size and the cache dtype ("auto" is the model's dtype)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = model.dtype if cache_dtype == "auto" else cache_dtype
    name = model_name or _served_name(model.served_model_name)
    if parallel.tensor_parallel_size > 1:  # each rank holds its own heads: its own pages
        name = f"{name}|tp{parallel.rank}of{parallel.tensor_parallel_size}"
    return ModelSpec(name, model.get_num_layers(parallel), model.get_num_kv_heads(parallel),
                     model.get_head_size(), str(dtype).removeprefix("torch."))


def _served_name(served: str | list[str]) -> str:
    return served[0] if isinstance(served, list) else served


class ServiceLink:
    """A raykv client for one process, made on first use. While raykv cannot be reached it is
    None, and the connection is tried again RETRY_CONNECT_S later."""

    def __init__(self, settings: RaykvSettings, spec: ModelSpec):
        self.settings, self.spec = settings, spec
        self._client = None
        self._next_try_s = 0.0

    def client(self):
        if self._client is None and time.monotonic() >= self._next_try_s:
            try:
                self._client = self._connect()
            except Exception as error:  # no service is a miss, never an engine failure
                self._next_try_s = time.monotonic() + RETRY_CONNECT_S
                log.warning("raykv unreachable (%s); misses for %.0f s", error, RETRY_CONNECT_S)
        return self._client

    def prefetch(self, tokens: list[int]) -> int:
        """Tokens of `tokens` raykv holds (one lookup); their pull toward this node starts."""
        client = self.client()
        if client is None:
            return 0
        try:
            return client.prefetch(tokens)
        except Exception:
            log.exception("raykv lookup failed")
            return 0

    def _connect(self):
        from cluster import connect
        from cluster.api import join_ray

        # An engine process outside Ray's process tree (vLLM's engine core, `vllm serve`) joins
        # with the token at hand when the cluster uses token auth, or says what to export.
        join_ray(self.settings.ray_address)
        client = connect(self.spec, self.settings.namespace)
        log.info("raykv connected: %s, namespace %r, %d tokens a page", self.spec,
                 self.settings.namespace, client.page_tokens)
        return client
