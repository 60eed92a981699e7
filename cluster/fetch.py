"""Fetching a cached prefix in one round trip's time.

    this node     acquire(all keys)  --.   sent together
    directory     match(all keys)    --'   local prefix L, global prefix P >= L
    other nodes   export_pages(keys[L:P]) -> one Ray object per page
    copies        slab -> out[:L], objects -> out[L:P]; release; this node adopts the objects

Copies go through cluster/copies.py (numpy, split over a few threads for large batches).
"""

from __future__ import annotations

import logging

import numpy as np
import ray
import torch

from cluster.core.copies import copy_pages
from cluster.core.kvcheck import page_slices
from cluster.core.tiers.memory import readonly_tensor

log = logging.getLogger("raykv.client")


def remote_sources(located: list, start: int, local_node: str | None) -> list[str]:
    """Where to read pages start.. from: the best-tier node other than this one; the list
    stops at the first page only this node claims (it was not in our local prefix)."""
    sources = []
    for locations in located[start:]:
        others = [node for node, _ in locations if node != local_node]
        if not others:
            break
        sources.append(others[0])
    return sources


def group_positions(sources: list[str], start: int) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for offset, node in enumerate(sources):
        groups.setdefault(node, []).append(start + offset)
    return groups


def fetch_prefix(client, keys: list, out: torch.Tensor | None):
    """(pages that arrived, out) for the longest cached prefix of `keys`; (0, None) on a miss."""
    acquired = client.local.acquire(client.geometry, keys) if client.local is not None else None
    located = client.directory.collect(len(keys), *client.directory.match_refs(keys))
    epoch, lease_id, slots = ray.get(acquired) if acquired is not None else (None, 0, [])
    local_id = client.local.node_id if client.local is not None else None
    sources = remote_sources(located, len(slots), local_id)
    total = len(slots) + len(sources)
    if total == 0:
        _release(client, lease_id)
        return 0, None
    if out is None:
        out = client._empty(total * client.page_tokens)
    exports = _start_exports(client, keys, group_positions(sources, len(slots)))
    arrived = np.zeros(total, dtype=bool)
    _copy_local(client, epoch, lease_id, slots, out, arrived)
    for node_id, (positions, ref) in exports.items():
        _copy_remote(client, node_id, [keys[p] for p in positions], positions, ref, out, arrived)
    misses = np.flatnonzero(~arrived)
    return (int(misses[0]) if misses.size else total), out


def _release(client, lease_id: int) -> None:
    if lease_id:
        client.local.release(lease_id)  # fire and forget: the copy is done


def _start_exports(client, keys: list, groups: dict[str, list[int]]) -> dict:
    exports = {}
    for node_id, positions in groups.items():
        peer = client.peer(node_id)
        if peer is not None:
            exports[node_id] = (positions, peer.export_pages(client.geometry,
                                                             [keys[p] for p in positions]))
    return exports


def _copy_local(client, epoch, lease_id: int, slots: list, out: torch.Tensor, arrived) -> None:
    if not slots:
        return
    client.map_epoch(epoch)
    try:
        copy_pages([(out[:, :, :, page_slices(position, client.page_tokens)],
                     client._page_view(tier, slot)) for position, (tier, slot) in enumerate(slots)])
        arrived[: len(slots)] = True
    finally:
        _release(client, lease_id)
    client.counters["local_pages"] += len(slots)


def _copy_remote(client, node_id: str, keys: list, positions: list[int], ref,
                 out: torch.Tensor, arrived) -> None:
    try:
        page_refs = ray.get(ref)
        pages = ray.get(page_refs)
    except ray.exceptions.RayError as error:
        log.warning("node %s unavailable, its pages are misses: %s", node_id[:8], error)
        return
    dtype = client.spec.torch_dtype()
    copy_pages([(out[:, :, :, page_slices(position, client.page_tokens)],
                 readonly_tensor(page).view(dtype).view(client.geometry.shape))
                for position, page in zip(positions, pages, strict=False)])
    arrived[positions[: len(pages)]] = True
    client.counters["remote_pages"] += len(pages)
    if client.local is not None and page_refs:
        # Keep a copy here for next time; the objects are already on this node.
        client.local.adopt(client.geometry, keys[: len(page_refs)], page_refs)
