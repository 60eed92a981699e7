"""A get, top to bottom: the longest cached prefix of a request's keys into one KV tensor,
with one round trip on its path when this node holds the prefix (as steps: calls.py).

    fetch_prefix
      1. _copy_hinted   pages this client noted earlier (its gets and puts), then pages the
                        node's held-pages index lists (put by anyone: tiers/held_index.py):
                        no call at all (the node hears of the reads in a batch, and the
                        directory of the request's demand: touches.py)
      1b. _read_disk    pages past those that the node's disk-held index lists: read from
                        its slab files here, with no call either (cluster/disk_direct.py;
                        the node hears of them with the touches, and moves them up)
      2. _ask           the rest: this node's acquire(keys[h:]) (it carries the leases earlier
                        gets are done with), sent before step 1's copy; the directory's
                        prefix_runs(keys[h:]) too when there is no local node, or when this
                        client's last asked get went past its node's prefix (early_directory)
      3. _answer        local prefix L from the acquire: all of keys[h:] -> no directory
                        call (the request's demand goes to the directory in a batch, off the
                        path: touches.DemandBatch); short -> the directory's global prefix P
           _copy_local    this node's slots -> out; the lease let go (touches.py)
           _read_remote   other nodes' page servers send pages L.. straight into out
                          (cluster/core/dataplane/); this node pulls them too, off our path

Steps 1 and 3 copy a slot table (slot_table.py: one int64 row per page; the acquire's reply
is one) in one pass: a block per run of consecutive slots, never a loop per page, then check
every page's slot generation with one gather per tier. Each step calls only lower layers: the
slabs (slot tables and copies), the actor handles, the data plane; the view holds the counters.

Any call that fails or times out is a miss: a dead local node leaves only remote pages, a dead
directory only local ones, a dead peer none of its own. A local page whose slot generation
changed during the copy (its lease ran out and the slot was reused) is a miss too, and so is
a remote page whose owner saw its slot change before the reader had it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from actors.handles import merge_shard_prefixes
from cluster.calls import Steps, Wait, Work, failed, timed_out
from cluster.core.copies import copy_pages
from cluster.core.dataplane.endpoint import PageRead, TensorPages, tensor_buffers
from cluster.core.kvcheck import page_slices
from cluster.core.tiers.slot_table import as_places
from cluster.slabs import LocalSlabs
from cluster.view import CacheView

log = logging.getLogger("raykv.client")
_NO_SLOTS = np.empty(0, dtype=np.int64)


def fetch_prefix(view: CacheView, keys: list, out: torch.Tensor | None) -> Steps[tuple]:
    """(pages that arrived, out) for the longest cached prefix of `keys`; (0, None) on a miss."""
    hints, noted = (_live(view, keys, *view.slabs.located(keys)) if view.local is not None
                    else (as_places([]), 0))
    on_disk = (view.slabs.on_disk(keys[len(hints):])
               if view.local is not None and len(hints) < len(keys) else _NO_SLOTS)
    known = len(hints) + len(on_disk)
    if out is None and known and known < len(keys):
        # out's size depends on the answers: no copy before them. The ask then starts at the
        # first page, and so the directory hears of the request's whole prefix.
        hints, on_disk, known = hints[:0], _NO_SLOTS, 0
    if out is None and known:
        out = view.empty(len(keys) * view.page_tokens)
    reading = (view.slabs.start_disk_read(keys[len(hints) : known], on_disk, out, len(hints))
               if len(on_disk) else None)  # first: the calls below go out while it reads
    asked = _ask(view, keys, known) if known < len(keys) else None
    good = ((yield from _copy_hinted(view, keys, hints, min(noted, len(hints)), out))
            if len(hints) else 0)
    if reading is not None:  # waited for even after a stale hint: it writes into out
        read = yield from _read_disk(view, keys[len(hints) : known], reading)
        good += read if good == len(hints) else 0
    if good < known:  # a hint went stale during the copy: the node's disk, from there on
        good += yield from _read_disk_from(view, keys, good, out)
    if asked is not None and asked.start != good:  # asked past a page that did not come
        yield from _drop(view, asked)
        asked = None
    if asked is None:
        if good == len(keys):
            view.note_demand(keys)  # served whole here, with no call: the directory hears
            return good, out
        asked = _ask(view, keys, good)
    num_pages, out = yield from _answer(view, keys, asked, out)
    return (num_pages, out) if num_pages else (0, None)


# ---- 1. the pages noted earlier ---------------------------------------------------------------


def _live(view: CacheView, keys: list, hints: np.ndarray, noted: int) -> tuple[np.ndarray, int]:
    """The hints up to the first whose slot's generation has already moved (the page left
    it: demoted to disk, say), so that the disk-held index, or the node, is asked from there
    rather than a dead slot copied; the copy checks the generations again after."""
    live = view.slabs.num_unchanged(hints) if len(hints) else 0
    if live < len(hints):
        view.slabs.forget(keys[live : len(hints)])
        view.counters["stale_hints"] += 1
    return hints[:live], min(noted, live)


def _copy_hinted(view: CacheView, keys: list, hints: np.ndarray, noted: int,
                 out: torch.Tensor) -> Steps[int]:
    """Copy pages from their hinted slots (the first `noted` this client's notes, the rest
    the node's index); returns how many leading ones stayed valid (a slot whose chunk is no
    longer mapped here ends them, and so does a changed generation)."""
    mapped = yield from _copy_places(view, hints, out, 0)
    good = view.slabs.num_unchanged(hints[:mapped])
    if good < len(hints):
        view.slabs.forget(keys[good : len(hints)])
        view.counters["stale_hints"] += 1
    if good > noted:  # found in the node's index: noted now, read from the notes next time
        view.slabs.remember(keys[noted:good], hints[noted:good])
        view.counters["held_pages"] += good - noted
    view.note_touched(keys[:good])
    view.counters["local_pages"] += good
    view.counters["optimistic_pages"] += good
    return good


def _copy_places(view: CacheView, places: np.ndarray, out: torch.Tensor,
                 first_page: int) -> Steps[int]:
    """Copy the pages at `places` (a slot table) into out's pages first_page.. in one pass,
    one block per run of consecutive slots; returns how many leading pages were copied (the
    rest sit in chunks not mapped here). Their generations are the caller's to check."""
    pairs, mapped = copy_pairs(view.slabs, places, out, first_page)
    started_s = time.perf_counter()
    yield Work(lambda: copy_pages(pairs))
    view.note_copy(places[:mapped], time.perf_counter() - started_s, len(pairs))
    return mapped


def _read_disk(view: CacheView, run_keys: list, reading: Future) -> Steps[int]:
    """Wait for the read of `run_keys` from this node's slab files (started by
    fetch_prefix: cluster/disk_direct.py, no call); returns how many leading pages arrived
    whole. The node hears of them as of any read without a lease (touches.py)."""
    good, seconds = yield Work(reading.result)
    view.note_disk(good, seconds)
    if good < len(run_keys):
        view.counters["stale_hints"] += 1
    view.note_touched(run_keys[:good])
    view.counters["local_pages"] += good
    view.counters["disk_direct_pages"] += good
    view.counters["disk_direct_us"] += int(seconds * 1e6)
    return good


def _read_disk_from(view: CacheView, keys: list, first_page: int, out: torch.Tensor
                    ) -> Steps[int]:
    """The pages from keys[first_page] on that the node's disk-held index lists, read into
    out with no call (a hint that went stale as its page was demoted, say); how many."""
    slots = view.slabs.on_disk(keys[first_page:])
    if not len(slots):
        return 0
    run_keys = keys[first_page : first_page + len(slots)]
    return (yield from _read_disk(view, run_keys,
                                  view.slabs.start_disk_read(run_keys, slots, out, first_page)))


def copy_pairs(slabs: LocalSlabs, places: np.ndarray, out: torch.Tensor,
               first_page: int) -> tuple[list, int]:
    """The (destination, source) blocks that copy the pages at `places` into out's pages
    first_page..: one per run of consecutive slots (copies.copy_pages copies them), and how
    many leading pages they cover (the rest are in chunks not mapped here)."""
    return slabs.kv_blocks(places, out, first_page)


# ---- 2. the calls for the rest ---------------------------------------------------------------


@dataclass(slots=True)
class _Asked:
    """The calls sent for keys[start:]: this node's acquire, and the directory's match when
    it went along (else it is sent only if the acquire comes back short)."""

    start: int
    acquired: list
    positions: list
    prefix_refs: list
    sent_s: float  # perf_counter when sent: the acquire's round trip times disk reads


def _ask(view: CacheView, keys: list, start: int) -> _Asked:
    local = view.local
    acquired = ([local.acquire(view.geometry, keys[start:], view.take_released())]
                if local is not None else [])
    positions, prefix_refs = [], []
    if local is None or view.early_directory:
        positions, prefix_refs = view.directory.prefix_refs(keys[start:])
    return _Asked(start, acquired, positions, prefix_refs, time.perf_counter())


def _drop(view: CacheView, asked: _Asked) -> Steps[None]:
    """Let go of answers we will not use (release a lease they took)."""
    replies = yield Wait(asked.acquired)
    _let_go_late(view, asked, replies)
    if replies and not failed(replies[0]) and replies[0][1]:
        view.release_later(replies[0][1])


def _let_go_late(view: CacheView, asked: _Asked, replies: list) -> None:
    """An acquire that timed out still runs on the node, and pins the prefix when it lands:
    its lease is let go then (view.release_when_answered)."""
    if asked.acquired and timed_out(replies[0]):
        view.release_when_answered(asked.acquired[0])


# ---- 3. their answers: this node's slots, then other nodes -------------------------------------


def _answer(view: CacheView, keys: list, asked: _Asked, out: torch.Tensor | None) -> Steps[tuple]:
    """The rest of the prefix from keys[asked.start:]: local slots, then other nodes."""
    start, rest = asked.start, keys[asked.start:]
    replies = yield Wait(asked.acquired + asked.prefix_refs)
    answered_s = time.perf_counter() - asked.sent_s
    _let_go_late(view, asked, replies)
    stamp, lease_id, places, num_disk = _acquired(view, replies[: len(asked.acquired)])
    view.note_disk(num_disk, answered_s)
    sources = []
    if len(places) < len(rest):  # pages past this node's prefix: other nodes may hold them
        located = yield from _located(view, rest, asked, replies[len(asked.acquired):])
        local_node = view.local.node_id if view.local is not None else None
        sources = remote_sources(located, len(places), local_node)
    elif not asked.prefix_refs:  # this node held it all: the directory hears of it later
        view.note_demand(rest)
    if asked.acquired:  # the next get asks the directory along if this one needed it
        view.early_directory = len(places) < len(rest)
    total = start + len(places) + len(sources)
    if total == start:  # nothing past the hinted pages (and so no lease was taken)
        return start, out
    if out is None:
        out = view.empty(total * view.page_tokens)
    arrived = np.zeros(total, dtype=bool)
    arrived[:start] = True
    yield from _copy_local(view, (stamp, lease_id, places), keys, out, arrived)
    groups = group_positions(sources, start + len(places))
    remote_started_s = time.perf_counter()
    remote_before = view.counters["remote_pages"]
    yield from _read_remote(view, keys, groups, out, arrived)
    view.fetch_s = time.perf_counter() - remote_started_s if groups else 0.0
    view.note_remote(view.counters["remote_pages"] - remote_before, view.fetch_s)
    misses = np.flatnonzero(~arrived)
    return (int(misses[0]) if misses.size else total), out


def _located(view: CacheView, rest: list, asked: _Asked, answers: list) -> Steps[list]:
    """The directory's locations of the longest prefix of `rest`: from the answers that came
    with the acquire, else asked now (one more round trip: the acquire came back short)."""
    positions = asked.positions
    if not asked.prefix_refs:
        positions, refs = view.directory.prefix_refs(rest)
        answers = yield Wait(refs)
    return located_prefix(view, rest, answers, positions)


def _acquired(view: CacheView, replies: list) -> tuple:
    """(stamp, lease_id, places as a slot table, pages read up from disk) of the acquire."""
    if not replies or failed(replies[0]):
        if replies:
            view.note_failures(replies)
            log.warning("this node's cache actor did not answer; local pages miss: %s",
                        replies[0])
        return None, 0, as_places([]), 0
    stamp, lease_id, places, num_disk = replies[0]
    return stamp, lease_id, as_places(places), num_disk


def _copy_local(view: CacheView, acquired: tuple, keys: list, out: torch.Tensor,
                arrived: np.ndarray) -> Steps[None]:
    stamp, lease_id, places = acquired
    if not len(places):
        return
    start = int(np.flatnonzero(~arrived)[0])
    try:
        if not (yield from view.slabs.ensure(stamp)):
            return
        mapped = yield from _copy_places(view, places, out, start)
        if mapped < len(places):  # a chunk not mapped here (another GPU) ends them
            view.counters["unmapped_pages"] += 1
            places = places[:mapped]
    finally:
        if lease_id:
            view.release_later(lease_id)  # the copy is done: told with the next call
    # The pins may have lapsed mid-copy: a slot freed since (generation moved) is a miss.
    good = view.slabs.num_unchanged(places)
    if good < len(places):
        view.counters["torn_reads"] += 1
    arrived[start : start + good] = True
    view.slabs.remember(keys[start : start + good], places[:good])
    view.counters["local_pages"] += good


def _read_remote(view: CacheView, keys: list, groups: dict[str, list[int]], out: torch.Tensor,
                 arrived: np.ndarray) -> Steps[None]:
    """Pages from their owners' page servers, straight into out; this node pulls them too."""
    if not groups:
        return
    endpoints = yield from view.endpoints(list(groups))
    reads, staged = [], []
    for node_id, positions in groups.items():
        if endpoints.get(node_id) is None:
            continue
        dests, stages = _destinations(view, out, positions)
        staged.append(stages)
        reads.append((node_id, positions, PageRead(endpoints[node_id], view.geometry,
                                                   tuple(keys[p] for p in positions), dests,
                                                   view.authority)))
    counts = yield Work(lambda: view.transport.read([r for _, _, r in reads],
                                                    view.call_timeout_s))
    for (node_id, positions, _), count, stages in zip(reads, counts, staged, strict=True):
        if count is None:
            view.counters["failed_calls"] += 1
            view.peers.forget(node_id)  # looked up afresh next time (a restarted actor)
            continue
        staged_pairs = [pair for pair in stages[:count] if pair is not None]
        if staged_pairs:
            yield Work(lambda pairs=staged_pairs: copy_pages(pairs))
        arrived[positions[:count]] = True
        view.counters["remote_pages"] += count
        if view.local is not None and count:  # keep a copy here for next time, off our path
            view.local.pull(view.geometry, {node_id: [keys[p] for p in positions[:count]]},
                            view.namespace)


def _destinations(view: CacheView, out: torch.Tensor, positions: list[int]) -> tuple:
    """Per page, the buffers its bytes land in: out's own rows where they can be described
    (one copy, socket -> out; made as the reader reaches each page); else host staging pages
    copied into out afterwards (a GPU tensor, or one whose rows do not flatten)."""
    targets = [out[:, :, :, page_slices(p, view.page_tokens)] for p in positions]
    if tensor_buffers(targets[0][:, :, :, :1]) is not None:
        return TensorPages(out, targets), [None] * len(targets)
    stages = [torch.empty(view.geometry.shape, dtype=view.geometry.torch_dtype())
              for _ in targets]
    return (tuple(tensor_buffers(stage) for stage in stages),
            list(zip(targets, stages, strict=True)))


# ---- the answers' arithmetic (pure) ----------------------------------------------------------


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
