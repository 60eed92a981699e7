"""Fetching a matched prefix: pick a source per page (this node first, then the fastest tier),
then one call to this node's actor, which pulls the remote pages into its host tier (sharing
pulls already under way) and pins the prefix; the client copies it out of shared memory.
A client on a node without a node actor reads remote pages straight through Ray objects.
"""

from __future__ import annotations

import logging

import ray
import torch

from actors.handles import NodeHandle
from cluster.kvcheck import page_slices
from cluster.tiers.memory import readonly_tensor

log = logging.getLogger("raykv.client")


def choose_sources(located: list[list[tuple[str, int]]], local_node: str | None) -> list[str]:
    """The node to read each page from: the local node when it has it, else the best tier."""
    sources = []
    for locations in located:
        nodes = [node for node, _ in locations]
        sources.append(local_node if local_node in nodes else locations[0][0])
    return sources


def remote_keys(keys: list, sources: list[str], local_node: str | None) -> dict[str, list]:
    """Keys to fetch from each other node, in chain order."""
    groups: dict[str, list] = {}
    for key, node in zip(keys, sources, strict=True):
        if node != local_node:
            groups.setdefault(node, []).append(key)
    return groups


def fetch_pages(client, keys: list, located: list, out: torch.Tensor) -> int:
    """Fill `out` with the matched pages; returns how many leading pages arrived."""
    local_id = client.local.node_id if client.local is not None else None
    remote = remote_keys(keys, choose_sources(located, local_id), local_id)
    if client.local is None:
        return _fetch_direct(client, keys, remote, out)
    epoch, lease_id, slots = ray.get(client.local.acquire(client.geometry, keys, remote or None))
    client.map_epoch(epoch)
    try:
        for position, (tier, slot) in enumerate(slots):
            out[:, :, :, page_slices(position, client.page_tokens)].copy_(
                client._page_view(tier, slot))
    finally:
        if lease_id:
            client.local.release(lease_id)  # fire and forget: the copy is done
    client.counters["local_pages"] += len(slots) - sum(map(len, remote.values()))
    client.counters["remote_pages"] += sum(map(len, remote.values()))
    return len(slots)


def _fetch_direct(client, keys: list, remote: dict[str, list], out: torch.Tensor) -> int:
    """No node actor here: ask every source node at once, copy what arrives."""
    refs = {}
    for node_id, wanted in remote.items():
        handle = NodeHandle.lookup(node_id, client.config)
        if handle is not None:
            refs[node_id] = handle.read_pages(client.geometry, wanted)
    arrived: dict = {}
    for node_id, ref in refs.items():
        try:
            arrived.update(zip(remote[node_id], ray.get(ref), strict=False))
        except ray.exceptions.RayError as error:
            log.warning("node %s unavailable, its pages are misses: %s", node_id[:8], error)
    dtype = client.spec.torch_dtype()
    for position, key in enumerate(keys):
        if key not in arrived:
            return position
        page = readonly_tensor(arrived[key]).view(dtype).view(client.geometry.shape)
        out[:, :, :, page_slices(position, client.page_tokens)].copy_(page)
    client.counters["remote_pages"] += len(keys)
    return len(keys)
