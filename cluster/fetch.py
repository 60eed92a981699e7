"""Fetching a matched prefix: pick a source per page (this node first, then the fastest tier),
ask every source at once, copy what arrives into the caller's tensor."""

from __future__ import annotations

import logging

import numpy as np
import ray
import torch

from actors.handles import NodeHandle
from cluster.kvcheck import page_slices

log = logging.getLogger("raykv.client")


def choose_sources(located: list[list[tuple[str, int]]], local_node: str | None) -> list[str]:
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


def fetch_pages(client, keys: list, located: list, out: torch.Tensor) -> int:
    """Fill `out` with the matched pages; returns how many leading pages arrived."""
    local_id = client.local.node_id if client.local is not None else None
    groups = group_positions(choose_sources(located, local_id))
    remote_refs = _start_remote(client, keys, groups, local_id)
    arrived = np.zeros(len(keys), dtype=bool)
    if local_id in groups:
        _copy_local(client, keys, groups[local_id], out, arrived)
    for node_id, (positions, ref) in remote_refs.items():
        _copy_remote(client, node_id, positions, ref, out, arrived)
    misses = np.flatnonzero(~arrived)
    return int(misses[0]) if misses.size else len(keys)


def _start_remote(client, keys: list, groups: dict, local_id: str | None) -> dict:
    refs = {}
    for node_id, positions in groups.items():
        if node_id == local_id:
            continue
        handle = NodeHandle.lookup(node_id, client.config)
        if handle is not None:
            wanted = [keys[p] for p in positions]
            refs[node_id] = (positions, handle.read_pages(client.geometry, wanted))
    return refs


def _copy_local(client, keys: list, positions: list[int], out: torch.Tensor, arrived) -> None:
    epoch, lease_id, slots = ray.get(
        client.local.acquire(client.geometry, [keys[p] for p in positions]))
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


def _copy_remote(client, node_id: str, positions: list[int], ref, out: torch.Tensor,
                 arrived) -> None:
    try:
        pages = ray.get(ref)
    except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as error:
        log.warning("node %s unavailable, pages count as misses: %s", node_id[:8], error)
        return
    dtype = client.spec.torch_dtype()
    for position, page in zip(positions, pages, strict=False):
        view = torch.from_numpy(page).view(dtype).view(client.geometry.shape)
        out[:, :, :, page_slices(position, client.page_tokens)].copy_(view)
        arrived[position] = True
    client.counters["remote_pages"] += len(pages)
