"""The kv-aware set-up's server class (vllm_serve_setups.py): Ray's LLMServer with its
engine's KV-event and prompt-token ports moved to free ones, since simulated nodes share one
host and Ray offsets its fixed port bases only by the replica's node-local rank."""

from __future__ import annotations

from ray.llm._internal.serve.core.server.llm_server import LLMServer

from cluster.tools.bench.vllm_serve_setups import ported_engine_kwargs
from cluster.tools.redis_server import free_port


class PortedLLMServer(LLMServer):
    """LLMServer whose engine's KV-event and prompt-token ports are free ones (module doc)."""

    async def start(self):
        from ray import serve

        rank = serve.get_replica_context().rank.local_rank
        config = self._llm_config
        engine, experimental = ported_engine_kwargs(
            config.engine_kwargs, dict(config.experimental_configs or {}), rank,
            (free_port(), free_port(), free_port()))
        config.engine_kwargs = engine
        config.experimental_configs = experimental
        await super().start()
