"""KVClient: what a serving replica imports. One directory call per request, then parallel
page fetches: same-node pages are copied straight out of the node's shared-memory slabs,
remote pages come through Ray objects.
"""

from __future__ import annotations

import threading

import ray
import torch

from actors.handles import DirectoryHandle, NodeHandle
from cluster.core.config import CacheConfig
from cluster.core.copies import copy_pages
from cluster.core.geometry import PageGeometry
from cluster.core.keys import PageKey, page_keys
from cluster.core.kvcheck import check_kv, check_out, page_slices
from cluster.core.spec import ModelSpec
from cluster.core.tiers.memory import ArenaMapping
from cluster.fetch import fetch_prefix


class KVClient:
    """put / lookup / get / prefetch / stats for one model and namespace."""

    def __init__(self, spec: ModelSpec, namespace: str, config: CacheConfig,
                 directory: DirectoryHandle, home: NodeHandle):
        self.spec = spec
        self.namespace = namespace
        self.config = config
        self.page_tokens = config.page_tokens
        self.geometry = PageGeometry.of(spec, config.page_tokens)
        self.directory = directory
        # The node actor this client writes through: its own node's when there is one
        # (shared memory), else a remote one (pages then travel as Ray objects).
        self.home = home
        self.local = home if home.is_local else None
        self._mappings: list[ArenaMapping] = []
        self._peers: dict[str, NodeHandle | None] = {}
        self._mapped_epoch: int | None = None
        self._lock = threading.Lock()
        self.counters = {"put_tokens": 0, "get_tokens": 0, "lookups": 0,
                         "local_pages": 0, "remote_pages": 0}

    # ---- helpers -------------------------------------------------------------------------

    def keys(self, tokens: object) -> list[PageKey]:
        return page_keys(self.spec, self.namespace, self.page_tokens, tokens)

    def peer(self, node_id: str) -> NodeHandle | None:
        """Another node's actor handle, looked up once (a GCS call) and cached."""
        handle = self._peers.get(node_id)
        if handle is None:
            handle = self._peers[node_id] = NodeHandle.lookup(node_id, self.config)
        return handle

    def map_epoch(self, epoch: int) -> None:
        """Map the local node's slabs, again if the actor restarted since (new epoch)."""
        with self._lock:
            if self._mapped_epoch != epoch:
                current, descriptors = ray.get(self.local.descriptors(self.geometry))
                self._mappings = [ArenaMapping(d) for d in descriptors]
                self._mapped_epoch = current

    def _page_view(self, tier: int, slot: int) -> torch.Tensor:
        raw = self._mappings[tier].view(slot)[: self.geometry.page_bytes]
        return raw.view(self.spec.torch_dtype()).view(self.geometry.shape)

    # ---- put -----------------------------------------------------------------------------

    def put(self, tokens: object, kv: torch.Tensor) -> int:
        """Store the full pages of `tokens`' KV; returns the tokens now stored (whole pages)."""
        keys = self.keys(tokens)
        check_kv(kv, self.spec, len(tokens))
        if not keys:
            return 0
        if self.local is None:
            return self._put_remote(keys, kv)
        epoch, slots = ray.get(self.local.reserve(self.geometry, keys))
        self.map_epoch(epoch)
        # Only the pages this put reserved are ours to write, commit or abort.
        mine = [key for key, slot in zip(keys, slots, strict=False) if slot is not None]
        try:
            copy_pages([(self._page_view(*slot), kv[:, :, :, page_slices(page, self.page_tokens)])
                        for page, slot in enumerate(slots) if slot is not None])
        except BaseException:
            ray.get(self.local.abort(self.geometry, mine))
            raise
        ray.get(self.local.commit(self.geometry, mine))
        stored_tokens = len(slots) * self.page_tokens  # the prefix that found room
        self.counters["put_tokens"] += stored_tokens
        return stored_tokens

    def _put_remote(self, keys: list[PageKey], kv: torch.Tensor) -> int:
        pages = [kv[:, :, :, page_slices(p, self.page_tokens)].contiguous().view(torch.uint8)
                 .reshape(-1).cpu().numpy() for p in range(len(keys))]
        stored_tokens = ray.get(self.home.put_pages(self.geometry, keys, pages)) * self.page_tokens
        self.counters["put_tokens"] += stored_tokens
        return stored_tokens

    # ---- lookup / get --------------------------------------------------------------------

    def lookup(self, tokens: object) -> int:
        """Longest cached prefix, in tokens (a multiple of page_tokens)."""
        self.counters["lookups"] += 1
        return len(self.directory.match(self.keys(tokens))) * self.page_tokens

    def get(self, tokens: object, out: torch.Tensor | None = None):
        """(prefix tokens, KV of that prefix); (0, None) on a miss. Fills `out` when given."""
        keys = self.keys(tokens)
        if out is not None:
            check_out(out, self.spec, len(keys) * self.page_tokens, self.page_tokens)
        if not keys:
            return 0, None
        num_pages, out = fetch_prefix(self, keys, out)
        if num_pages == 0:
            return 0, None
        num_tokens = num_pages * self.page_tokens
        self.counters["get_tokens"] += num_tokens
        return num_tokens, out if out.shape[3] == num_tokens else out[:, :, :, :num_tokens]

    def _empty(self, num_tokens: int) -> torch.Tensor:
        shape = list(self.geometry.shape)
        shape[3] = num_tokens
        return torch.empty(shape, dtype=self.spec.torch_dtype())

    def prefetch(self, tokens: object) -> int:
        """Start promoting the cached prefix toward this node's fastest tier; returns tokens."""
        keys = self.keys(tokens)
        located = self.directory.match(keys)
        if located:
            home = self.home.node_id
            remote: dict[str, list[PageKey]] = {}
            for key, locations in zip(keys, located, strict=False):
                if home not in (node for node, _ in locations):
                    remote.setdefault(locations[0][0], []).append(key)
            self.home.prefetch(self.geometry, keys[: len(located)], remote or None)
        return len(located) * self.page_tokens

    def stats(self) -> dict:
        """Client counters, this node's tiers, and the directory's size."""
        node = ray.get(self.home.stats())
        directory = ray.get(self.directory.stats())
        return {"client": dict(self.counters), "node": node, "directory": directory,
                "namespace": self.namespace, "model": self.spec.name,
                "page_tokens": self.page_tokens}
