"""Fetching a cached prefix in one round trip's time (as steps: see cluster/calls.py).

    this node     acquire(all keys)  --.   sent together
    directory     prefix_runs(keys)  --'   local prefix L, global prefix P >= L
    other nodes   export_pages(keys[L:P]) -> one Ray object per page
    copies        slab -> out[:L] (generations checked after), objects -> out[L:P];
                  release; this node adopts the objects

Any call that fails or times out is a miss: a dead local node leaves only remote pages, a dead
directory only local ones, a dead peer none of its own. A local page whose slot generation
changed during the copy (its lease ran out and the slot was reused) is a miss too.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from actors.handles import merge_shard_prefixes
from cluster.calls import Steps, Wait, Work, failed
from cluster.core.copies import copy_pages
from cluster.core.kvcheck import page_slices
from cluster.core.tiers.memory import readonly_tensor
from cluster.view import CacheView

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


def located_prefix(view: CacheView, keys: list, answers: list, positions: list) -> list:
    """Merge the shards' answers; a shard that failed answers nothing (its keys miss)."""
    view.note_failures(answers)
    answers = [[] if failed(a) else a for a in answers]
    return merge_shard_prefixes(len(keys), positions, answers)


def fetch_prefix(view: CacheView, keys: list, out: torch.Tensor | None) -> Steps[tuple]:
    """(pages that arrived, out) for the longest cached prefix of `keys`; (0, None) on a miss."""
    local = view.local
    acquired = [local.acquire(view.geometry, keys)] if local is not None else []
    positions, prefix_refs = view.directory.prefix_refs(keys)
    replies = yield Wait(acquired + prefix_refs)
    epoch, lease_id, slots = _acquired(view, replies[: len(acquired)])
    located = located_prefix(view, keys, replies[len(acquired):], positions)
    sources = remote_sources(located, len(slots), local.node_id if local is not None else None)
    total = len(slots) + len(sources)
    if total == 0:
        return 0, None
    if out is None:
        out = view.empty(total * view.page_tokens)
    arrived = np.zeros(total, dtype=bool)
    exports_started_s = time.perf_counter()
    exports = yield from _start_exports(view, keys, group_positions(sources, len(slots)))
    yield from _copy_local(view, epoch, lease_id, slots, out, arrived)
    yield from _copy_remote(view, keys, exports, out, arrived)
    view.fetch_s = time.perf_counter() - exports_started_s if exports else 0.0
    misses = np.flatnonzero(~arrived)
    num_pages = int(misses[0]) if misses.size else total
    return (num_pages, out) if num_pages else (0, None)


def _acquired(view: CacheView, replies: list) -> tuple:
    if not replies or failed(replies[0]):
        if replies:
            view.note_failures(replies)
            log.warning("this node's cache actor did not answer; local pages miss: %s",
                        replies[0])
        return None, 0, []
    return replies[0]


def _start_exports(view: CacheView, keys: list, groups: dict[str, list[int]]) -> Steps[list]:
    """[(node_id, positions, ref to the page refs)], for the peers that can be found."""
    peers = yield Work(lambda: {node_id: view.peers.get(node_id) for node_id in groups})
    return [(node_id, positions, peers[node_id].export_pages(view.geometry,
                                                             [keys[p] for p in positions]))
            for node_id, positions in groups.items() if peers[node_id] is not None]


def _copy_local(view: CacheView, epoch, lease_id: int, slots: list, out: torch.Tensor,
                arrived: np.ndarray) -> Steps[None]:
    if not slots:
        return
    try:
        if not (yield from view.slabs.ensure(epoch)):
            return
        pairs = [(out[:, :, :, page_slices(p, view.page_tokens)], view.slabs.page(tier, slot))
                 for p, (tier, slot, _) in enumerate(slots)]
        yield Work(lambda: copy_pages(pairs))
    finally:
        if lease_id:
            view.home.release(lease_id)  # fire and forget: the copy is done
    # The pins may have lapsed mid-copy: a slot freed since (generation moved) is a miss.
    for position, (tier, slot, generation) in enumerate(slots):
        if view.slabs.generation(tier, slot) != generation:
            view.counters["torn_reads"] += 1
            break
        arrived[position] = True
    view.counters["local_pages"] += int(arrived[: len(slots)].sum())


def _copy_remote(view: CacheView, keys: list, exports: list, out: torch.Tensor,
                 arrived: np.ndarray) -> Steps[None]:
    if not exports:
        return
    answers = yield Wait([ref for _, _, ref in exports])
    view.note_failures(answers)
    for (node_id, _, _), answer in zip(exports, answers, strict=True):
        if failed(answer):
            view.peers.forget(node_id)  # looked up afresh next time (a restarted actor)
    live = [(node_id, positions, refs) for (node_id, positions, _), refs
            in zip(exports, answers, strict=True) if not failed(refs) and refs]
    pages = yield Wait([ref for _, _, refs in live for ref in refs])
    view.note_failures(pages)
    pairs, done = [], []
    page_iter = iter(pages)
    for node_id, positions, refs in live:
        got = [next(page_iter) for _ in refs]
        count = next((i for i, page in enumerate(got) if failed(page)), len(got))
        if count < len(got):
            view.peers.forget(node_id)
        for position, page in zip(positions[:count], got[:count], strict=True):
            pairs.append((out[:, :, :, page_slices(position, view.page_tokens)],
                          readonly_tensor(page).view(view.geometry.torch_dtype())
                          .view(view.geometry.shape)))
            done.append(position)
        if view.local is not None and count:  # keep a copy here for next time, off our path
            view.local.adopt(view.geometry, [keys[p] for p in positions[:count]], refs[:count],
                             view.namespace)
    yield Work(lambda: copy_pages(pairs))
    arrived[done] = True
    view.counters["remote_pages"] += len(done)
