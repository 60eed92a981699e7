"""raykv: a Ray-distributed, tiered KV-cache service for LLM serving.

    from cluster import CacheConfig, ModelSpec, start, connect

start() and connect() import Ray lazily, so the pure core (specs, keys, tiers, policies) can be
used and tested without it.
"""

from cluster.config import CacheConfig
from cluster.core.spec import ModelSpec

__all__ = ["CacheConfig", "ModelSpec", "start", "connect", "stop"]


def start(config: CacheConfig | None = None) -> dict:
    """Ensure the directory and node actors run on the current Ray cluster; idempotent."""
    from cluster.api import start as _start

    return _start(config)


def connect(spec: ModelSpec, namespace: str = "default"):
    """A KVClient for `spec` in `namespace` (see cluster.client.KVClient)."""
    from cluster.api import connect as _connect

    return _connect(spec, namespace)


def stop() -> None:
    """Stop the service's actors on the current Ray cluster."""
    from cluster.api import stop as _stop

    _stop()
