"""raykv: a Ray-distributed, tiered KV-cache service for LLM serving.

    from cluster import CacheConfig, ModelSpec, start, connect

start() and connect() import Ray lazily, so the pure core (specs, keys, tiers, policies) can be
used and tested without it.
"""

from cluster.config import CacheConfig
from cluster.core.spec import ModelSpec
from policies.quota import Quota

__all__ = ["CacheConfig", "ModelSpec", "Quota", "start", "connect", "stop", "purge",
           "register_model", "add_namespace", "quotas"]


def start(config: CacheConfig | None = None) -> dict:
    """Ensure the directory and node actors run on the current Ray cluster; idempotent."""
    from cluster.api import start as _start

    return _start(config)


def connect(spec: ModelSpec, namespace: str = "default"):
    """A KVClient for `spec` in `namespace` (see cluster.client.KVClient)."""
    from cluster.api import connect as _connect

    return _connect(spec, namespace)


def stop() -> None:
    """Stop the service's actors on the current Ray cluster; disk pages stay for the next
    start (which recovers them)."""
    from cluster.api import stop as _stop

    _stop()


def purge() -> None:
    """Stop the service and remove every live node's disk slabs: nothing is left behind."""
    from cluster.api import purge as _purge

    _purge()


def register_model(spec: ModelSpec, quota: Quota | None = None) -> dict:
    """Register a model, or change its quota, on the running service (see cluster.api)."""
    from cluster.api import register_model as _register_model

    return _register_model(spec, quota)


def add_namespace(name: str, quota: Quota | None = None) -> dict:
    """Add a namespace, or change its quota, on the running service (see cluster.api)."""
    from cluster.api import add_namespace as _add_namespace

    return _add_namespace(name, quota)


def quotas() -> dict:
    """The registered models and namespaces, with their quotas."""
    from cluster.api import quotas as _quotas

    return _quotas()
