"""The kv-aware set-up's server class (vllm_serve_setups.py): Ray's LLMServer with its
engine's KV-event and prompt-token ports moved to free ones, since simulated nodes share one
host and Ray offsets its fixed port bases only by the replica's node-local rank; an engine that
runs RaykvConnector (kv-aware-raykv) also gets a rates file of its own."""

from __future__ import annotations

import uuid

from ray.llm._internal.serve.core.server.llm_server import LLMServer

from cluster.serving.engine_rates import rates_path
from cluster.serving.vllm_events_server import with_rates_file
from cluster.tools.bench.vllm_serve_setups import ported_engine_kwargs
from cluster.tools.redis_server import free_port


def port_config(config, rank: int, ports: tuple[int, int, int], rates_file: str) -> None:
    """Move `config`'s (an LLMConfig) KV-event endpoints and prompt-token port base to `ports`
    (ported_engine_kwargs) and name RaykvConnector's rates file where its engine runs one.

    Through `update_engine_kwargs`: the builder already made and cached the engine config
    (placement reads it), and the engine starts from that cache. Assigning `engine_kwargs`
    reached it only where Ray re-applies a key itself (the events' endpoints); the rates file
    of kv-aware-raykv's first run was lost that way."""
    engine, experimental = ported_engine_kwargs(
        config.engine_kwargs, dict(config.experimental_configs or {}), rank, ports)
    changed = {"kv_events_config": engine["kv_events_config"]} \
        if "kv_events_config" in engine else {}
    kv_transfer = with_rates_file(engine.get("kv_transfer_config"), rates_file)
    if kv_transfer is not None:
        changed["kv_transfer_config"] = kv_transfer
    config.update_engine_kwargs(**changed)
    config.experimental_configs = experimental


class PortedLLMServer(LLMServer):
    """LLMServer whose engine's KV-event and prompt-token ports are free ones (module doc)."""

    async def start(self):
        from ray import serve

        # kv-aware-raykv's engines run RaykvConnector: their measured rates (lookups skipped,
        # how often raykv held more) go to a file of their own, which the bench reads
        # (vllm_serve.rates_files_since), as raykv's server class names one for its router.
        port_config(self._llm_config, serve.get_replica_context().rank.local_rank,
                    (free_port(), free_port(), free_port()), rates_path(uuid.uuid4().hex))
        await super().start()
