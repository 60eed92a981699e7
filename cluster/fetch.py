"""Fetching a matched prefix: pick a source per page (this node first, then the fastest tier),
ask every source at once, copy what arrives into the caller's tensor.

    this node   acquire (pin) -> copy out of the shared-memory slab -> release
    other nodes export_pages -> one Ray object per page -> copy -> this node adopts the same
                objects into its host tier, off the caller's critical path
"""

from __future__ import annotations

import logging

import numpy as np
import ray
import torch

from cluster.kvcheck import page_slices
from cluster.tiers.memory import readonly_tensor

log = logging.getLogger("raykv.client")


def choose_sources(located: list, local_node: str | None) -> list[str]:
    """The node to read each page from: the local node when it has it, else the best tier."""
    sources = []
    for locations in located:
        nodes = [node for node, _ in locations]
        sources.append(local_node if local_node in nodes else locations[0][0])
    return sources


def group_positions(sources: list[str]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for position, node in enumerate(sources):
        groups.setdefault(node, []).append(position)
    return groups


def remote_keys(keys: list, sources: list[str], local_node: str | None) -> dict[str, list]:
    """Keys to fetch from each other node, in chain order."""
    return {node: [keys[p] for p in positions]
            for node, positions in group_positions(sources).items() if node != local_node}


def fetch_pages(client, keys: list, located: list, out: torch.Tensor) -> int:
    """Fill `out` with the matched pages; returns how many leading pages arrived."""
    local_id = client.local.node_id if client.local is not None else None
    groups = group_positions(choose_sources(located, local_id))
    exports = _start_exports(client, keys, groups, local_id)
    arrived = np.zeros(len(keys), dtype=bool)
    if local_id in groups:
        _copy_local(client, [keys[p] for p in groups[local_id]], groups[local_id], out, arrived)
    for node_id, (positions, ref) in exports.items():
        _copy_remote(client, node_id, [keys[p] for p in positions], positions, ref, out, arrived)
    misses = np.flatnonzero(~arrived)
    return int(misses[0]) if misses.size else len(keys)


def _start_exports(client, keys: list, groups: dict, local_id: str | None) -> dict:
    exports = {}
    for node_id, positions in groups.items():
        if node_id == local_id:
            continue
        peer = client.peer(node_id)
        if peer is not None:
            exports[node_id] = (positions, peer.export_pages(client.geometry,
                                                             [keys[p] for p in positions]))
    return exports


def _copy_local(client, keys: list, positions: list[int], out: torch.Tensor, arrived) -> None:
    epoch, lease_id, slots = ray.get(client.local.acquire(client.geometry, keys))
    client.map_epoch(epoch)
    try:
        for position, (tier, slot) in zip(positions, slots, strict=False):
            out[:, :, :, page_slices(position, client.page_tokens)].copy_(
                client._page_view(tier, slot))
            arrived[position] = True
    finally:
        if lease_id:
            client.local.release(lease_id)  # fire and forget: the copy is done
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
    for position, page in zip(positions, pages, strict=False):
        view = readonly_tensor(page).view(dtype).view(client.geometry.shape)
        out[:, :, :, page_slices(position, client.page_tokens)].copy_(view)
        arrived[position] = True
    client.counters["remote_pages"] += len(pages)
    if client.local is not None and page_refs:
        # Keep a copy here for next time; the objects are already on this node.
        client.local.adopt(client.geometry, keys[: len(page_refs)], page_refs)
