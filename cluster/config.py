"""CacheConfig, as the face exports it (the settings live in the core, which actors share)."""

from cluster.core.config import CacheConfig, GiB, MiB

__all__ = ["CacheConfig", "GiB", "MiB"]
