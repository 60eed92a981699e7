"""An engine replica's own prefix cache, in place of raykv: what serving teams run today.

Each replica keeps the KV pages of its earlier requests in its own memory, as vLLM's automatic
prefix caching does, and reuses the longest cached prefix of a new prompt; nothing is shared
with other replicas, no other process is asked, and raykv is neither started nor used. Pages
and keys are raykv's (whole pages of page_tokens, the same chained page keys), so a hit counts
the same cached tokens as a raykv hit would. The index and its LRU eviction are
cluster/core/prefix_lru.py; this module holds the KV and has the calls the engine makes on a
raykv client (`page_tokens`, `aget`, `aput`, `counters`), so the engine runs unchanged on
either.

Namespaces share the replica's one budget and never a page: each namespace's keys are rooted
in its name (cluster/core/keys.py). No secret is needed, since no other process can ask this
cache anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.core.keys import KeyChain
from cluster.core.kvcheck import check_kv, check_out, page_slices
from cluster.core.prefix_lru import PrefixLRU
from cluster.core.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class LocalCacheSettings:
    """One replica's own prefix cache: its page size and its byte budget."""

    page_tokens: int = 16
    capacity_bytes: int = 256 << 20


class LocalPrefixCache:
    """One replica's pages (torch tensors [L, 2, H, page_tokens, D]) and their LRU index."""

    def __init__(self, spec: ModelSpec, settings: LocalCacheSettings):
        self.spec, self.page_tokens = spec, settings.page_tokens
        self.lru: PrefixLRU[torch.Tensor] = PrefixLRU(settings.capacity_bytes,
                                                      spec.page_bytes(settings.page_tokens))
        self.counters = {"get_tokens": 0, "put_tokens": 0}

    def client(self, namespace: str) -> LocalPrefixClient:
        """The engine's view of this cache for one namespace."""
        return LocalPrefixClient(self, KeyChain.of(self.spec, namespace, self.page_tokens))

    def stats(self) -> dict:
        return {**self.counters, **self.lru.counters, "held_bytes": self.lru.used_bytes,
                "capacity_bytes": self.lru.capacity_pages * self.lru.page_bytes}


class LocalPrefixClient:
    """get / put of one namespace's pages in the replica's own cache (and a*-variants, which
    copy in process and never wait)."""

    def __init__(self, cache: LocalPrefixCache, chain: KeyChain):
        self.cache, self.chain = cache, chain
        self.spec, self.page_tokens = cache.spec, cache.page_tokens

    @property
    def counters(self) -> dict:
        return self.cache.counters

    def get(self, tokens: object, out: torch.Tensor | None = None):
        """(prefix tokens, KV of that prefix); (0, None) on a miss. Fills `out` when given."""
        keys = self.chain.keys(tokens)
        if out is not None:
            check_out(out, self.spec, len(keys) * self.page_tokens, self.page_tokens)
        pages = self.cache.lru.match(keys) if keys else []
        if not pages:
            return 0, None
        num_tokens = len(pages) * self.page_tokens
        self.counters["get_tokens"] += num_tokens
        if out is None:
            return num_tokens, torch.cat(pages, dim=3)
        for index, page in enumerate(pages):
            out[:, :, :, page_slices(index, self.page_tokens)].copy_(page)
        return num_tokens, out[:, :, :, :num_tokens]

    def put(self, tokens: object, kv: torch.Tensor) -> int:
        """Hold the full pages of `tokens`' KV; returns the tokens now held (whole pages)."""
        keys = self.chain.keys(tokens)
        check_kv(kv, self.spec, len(tokens))
        if not keys:
            return 0

        def page(index: int) -> torch.Tensor:  # a copy: the page outlives the request's KV
            return kv[:, :, :, page_slices(index, self.page_tokens)].clone()

        stored_tokens = self.cache.lru.insert(keys, page) * self.page_tokens
        self.counters["put_tokens"] += stored_tokens
        return stored_tokens

    async def aget(self, tokens: object, out: torch.Tensor | None = None):
        return self.get(tokens, out)

    async def aput(self, tokens: object, kv: torch.Tensor) -> int:
        return self.put(tokens, kv)
