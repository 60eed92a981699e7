"""raykv: a Ray-distributed, tiered KV-cache service for LLM serving.

    from cluster import CacheConfig, ModelSpec, start, connect

Every name here is imported on first use (PEP 562), so importing a submodule (the pure core,
`cluster.tools.gpu_check` on a GPU machine without Ray or pydantic) imports nothing else, and
start() and connect() bring Ray in only when called.
"""

from __future__ import annotations

import importlib

__all__ = ["CacheConfig", "ModelSpec", "Quota", "start", "connect", "stop", "purge",
           "register_model", "add_namespace", "quotas"]

# public name -> the module that defines it
_EXPORTS = {
    "CacheConfig": "cluster.config",
    "ModelSpec": "cluster.core.spec",
    "Quota": "policies.quota",
    "start": "cluster.api",
    "connect": "cluster.api",
    "stop": "cluster.api",
    "purge": "cluster.api",
    "register_model": "cluster.api",
    "add_namespace": "cluster.api",
    "quotas": "cluster.api",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
