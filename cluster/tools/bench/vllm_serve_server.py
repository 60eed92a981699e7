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


class PortedLLMServer(LLMServer):
    """LLMServer whose engine's KV-event and prompt-token ports are free ones (module doc)."""

    async def start(self):
        from ray import serve

        rank = serve.get_replica_context().rank.local_rank
        config = self._llm_config
        engine, experimental = ported_engine_kwargs(
            config.engine_kwargs, dict(config.experimental_configs or {}), rank,
            (free_port(), free_port(), free_port()))
        # kv-aware-raykv's engines run RaykvConnector: its measured rates (lookups skipped,
        # how often raykv held more) go to a file of their own, which the bench reads
        # (vllm_serve.engine_rates), as raykv's server class names one for its router.
        kv_transfer = with_rates_file(engine.get("kv_transfer_config"),
                                      rates_path(uuid.uuid4().hex))
        if kv_transfer is not None:
            engine = {**engine, "kv_transfer_config": kv_transfer}
        config.engine_kwargs = engine
        config.experimental_configs = experimental
        await super().start()
