"""A client's mappings of its node's shared-memory slabs, and the slots it last saw its pages in.

Every reserve and acquire reply carries a SlabStamp: the node actor's epoch (a restarted
actor has new slabs: map them all again) and its pool's layout version (device chunks come
and go, each granted chunk a new allocation: map the new ones, drop the old). A client whose
mappings are older asks for the descriptors before it copies; a slot in a chunk it cannot
map (a GPU it does not see) is a miss, never a write through a stale mapping.

    hints: key -> (tier, slot, generation)     learned from acquires and puts (slot_table.py)

A hint lets a get read a page with no call to the node: copy the slot, then check that its
generation is the one noted. The generation grows whenever the slot is freed, and a page's
bytes never change while it holds its slot, so an unchanged generation means the copy is of
that page; a changed one makes the page a miss and the get asks the node as usual.

A hint is trusted for HINT_TTL_S after the node last confirmed it: a node actor that died
frees nothing (generations stand still), and this bounds how long a client keeps reading a
dead node's slabs, and keeps them mapped, without asking.

    held: digest(key) -> (tier, slot, generation)  the node's own index of its mapped tiers
                                                   (cluster/core/tiers/held_index.py)

Pages this client did not note (another client put them) are looked up in the node's
held-pages index, mapped read-only: the same kind of hint, copied and checked the same way,
trusted while the node keeps stamping it (HELD_MAX_AGE_S). The slabs are mapped when the client
connects (map_now), so even a client's first get of a page held here makes no call.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from actors.handles import NodeHandle
from cluster.calls import Steps, Wait, failed
from cluster.core.background import background_thread
from cluster.core.copies import Pair, host_bytes
from cluster.core.geometry import PageGeometry
from cluster.core.keys import PageKey
from cluster.core.kvcheck import page_rows, slab_order
from cluster.core.tiers.fence import SlotFence
from cluster.core.tiers.held_index import HeldView
from cluster.core.tiers.memory import ArenaMapping, SlabStamp
from cluster.core.tiers.slot_table import (
    PlaceHints,
    SlotRun,
    as_places,
    num_unchanged,
    slot_runs,
    unchanged,
)
from cluster.disk_direct import DiskDirect

log = logging.getLogger("raykv.client")
MAX_HINTS = 1 << 16
HINT_TTL_S = 1.0
# The node stamps its held-pages index every event_flush_s (0.05 s): one not stamped for
# this long is a dead or stuck node's, not read, well within HINT_TTL_S of its death.
HELD_MAX_AGE_S = HINT_TTL_S / 2


class LocalSlabs:
    """Views of this node's slots, for one page geometry."""

    def __init__(self, node: NodeHandle, geometry: PageGeometry):
        self.node = node
        self.geometry = geometry
        self.epoch: int | None = None
        self._mappings: list[ArenaMapping] = []
        self._fences: list[SlotFence] = []  # per tier: this client's slot write locks
        self._hints = PlaceHints(MAX_HINTS)
        self._held: HeldView | None = None  # the node's held-pages index for this geometry
        self.use_held = True  # False: pages not noted here are asked for (benchmarks compare)
        self._disk: DiskDirect | None = None  # its disk tier, read here (disk_direct.py)
        self.use_disk = True  # False: pages on the node's disk are asked for (likewise)
        self._lock = threading.Lock()
        self._prefaulting: Future | None = None

    @property
    def layout_version(self) -> int:
        """The layout version of the node's pool that these mappings reach."""
        return sum(mapping.layout_version for mapping in self._mappings)

    def ensure(self, stamp: SlabStamp) -> Steps[bool]:
        """Map the node's slabs as of `stamp` (from a reserve or acquire reply) unless the
        mappings already reach it; False if that failed (the reply's slots then miss)."""
        if stamp.covered_by(self.epoch, self.layout_version):
            return True
        if not (yield from self.map_now()):
            return False
        return stamp.covered_by(self.epoch, self.layout_version)

    def map_now(self) -> Steps[bool]:
        """Ask the node for its slabs' descriptors and map them (a client does it when it
        connects, so that its first get of pages held here needs no call); False if that
        failed."""
        (reply,) = yield Wait([self.node.descriptors(self.geometry)])
        if failed(reply):
            return False
        current, descriptors = reply
        try:
            self._remap(current, descriptors)
        except OSError as error:  # the slabs went away meanwhile (the actor restarted)
            log.warning("could not map the node's slabs (a miss): %s", error)
            return False
        self.prefault()
        return True

    def _remap(self, current: SlabStamp, descriptors: list) -> None:
        with self._lock:
            if self.epoch != current.epoch:
                self._mappings = [ArenaMapping(d) for d in descriptors]
                for fence in self._fences:
                    fence.close()
                self._fences = [SlotFence(d.generations_path) for d in descriptors]
                self._hints.clear()  # slots of the old slabs
                self._map_held(descriptors)
                self.epoch = current.epoch
                return
            for mapping, descriptor in zip(self._mappings, descriptors, strict=True):
                mapping.update(descriptor)

    def _map_held(self, descriptors: list) -> None:
        """Map the node's held-pages index (a node without one: no such lookups), and open
        its disk tier's index and slab files (without them: its disk pages are asked for)."""
        if self._held is not None:
            self._held.close()
            self._held = None
        path = next((d.held_path for d in descriptors if d.held_path), None)
        if path is not None:
            try:
                self._held = HeldView(path, HELD_MAX_AGE_S)
            except (OSError, ValueError) as error:
                log.warning("could not map the node's held-pages index: %s", error)
        self._open_disk(descriptors)

    def _open_disk(self, descriptors: list) -> None:
        if self._disk is not None:
            self._disk.close()
            self._disk = None
        found = next((d for d in descriptors if d.disk_held_path and d.disk_dir), None)
        if found is not None:
            try:
                self._disk = DiskDirect(self.geometry, found.disk_held_path, found.disk_dir,
                                        HELD_MAX_AGE_S, found.disk_threads)
            except (OSError, ValueError, KeyError) as error:
                log.warning("could not open the node's disk tier for reads (its disk pages "
                            "are asked for): %s", error)

    def on_disk(self, keys: list[PageKey]) -> np.ndarray:
        """Disk slots (int64 [N]) of the longest prefix of `keys` that the node's disk-held
        index lists; none without one (or with use_disk off)."""
        with self._lock:
            disk = self._disk if self.use_disk else None
        if disk is None or not keys:
            return np.empty(0, dtype=np.int64)
        return disk.located(keys)

    def start_disk_read(self, keys: list[PageKey], slots: np.ndarray, out: torch.Tensor,
                        first_page: int) -> Future:
        """DiskDirect.start: a future of (how many leading pages of `keys`, at disk `slots`,
        arrived whole in out's pages first_page.., the seconds it took)."""
        with self._lock:
            disk = self._disk
        try:
            if disk is not None:
                return disk.start(keys, slots, out, first_page)
        except RuntimeError:  # closed by a remap, or the interpreter is exiting
            pass
        missed: Future = Future()  # remapped away meanwhile, or closed: a miss
        missed.set_result((0, 0.0))
        return missed

    def fault_in(self, places: np.ndarray) -> int:
        """Fault in the chunks of `places` (a slot table) that this client has not touched
        yet, in the background thread (at a lower CPU priority, after any pre-fault queued
        there: the copies of puts under way go first), and wait; how many of the leading
        places are mapped here (see runs)."""
        try:
            job = _prefault_thread().submit(lambda: sum(run.count for run, _ in self.runs(places)))
        except RuntimeError:  # the interpreter is exiting (no new work): none mapped, a miss
            return 0
        return job.result()

    def prefault(self) -> None:
        """Fault in, in a background thread, the chunks the node holds that this client has
        not touched yet (the node readies a chunk ahead of need: a put into fresh slots then
        copies at memory speed)."""
        with self._lock:
            if self._prefaulting is not None and not self._prefaulting.done():
                return
            mappings = list(self._mappings)
            self._prefaulting = _prefault_thread().submit(
                lambda: sum(m.prefault_held() for m in mappings))

    def page(self, tier: int, slot: int) -> torch.Tensor | None:
        """The page in a slot, typed and shaped (a view into shared memory or VRAM); None
        where its chunk is not mapped here (a GPU this process does not see): a miss."""
        raw = self._mappings[tier].view(slot)
        if raw is None:
            return None
        raw = raw[: self.geometry.page_bytes]
        return raw.view(self.geometry.torch_dtype()).view(self.geometry.shape)

    def generation(self, tier: int, slot: int) -> int:
        return self._mappings[tier].generation(slot)

    def fence(self, tier: int) -> SlotFence:
        """This client's write locks on a tier's slots (see cluster/core/tiers/fence.py)."""
        return self._fences[tier]

    def unlock_places(self, places: np.ndarray) -> None:
        """Let go of this client's write locks on `places` (a slot table), kept after a
        leased copy until its commit was answered. A lock of slabs mapped anew since (the
        node restarted) went with the old file's close: unlocking it here is a no-op."""
        if not len(places):
            return
        with self._lock:
            fences = list(self._fences)
        for tier in np.unique(places[:, 0]).tolist():
            fences[tier].unlock(places[places[:, 0] == tier, 1].tolist())

    def runs(self, places: np.ndarray) -> list[tuple[SlotRun, torch.Tensor]]:
        """The leading runs of `places` (an int64 [N, 3] slot table) whose slots are mapped
        here, each with its pages as one [count, *page_shape] view; the list stops at the
        first run this process cannot map (a chunk on a GPU it does not see)."""
        per_chunk = [mapping.slots_per_chunk for mapping in self._mappings]
        views = []
        for run in slot_runs(places, per_chunk):  # one per run of consecutive slots
            raw = self._mappings[run.tier].run_view(run.first_slot, run.count)
            if raw is None:
                break
            rows = raw.view(run.count, -1)[:, : self.geometry.page_bytes]
            views.append((run, rows.view(self.geometry.torch_dtype())
                          .unflatten(1, self.geometry.shape)))
        return views

    def kv_blocks(self, places: np.ndarray, kv: torch.Tensor, positions: np.ndarray | int,
                  ) -> tuple[list[Pair], int]:
        """(kv's pages, their slots) as blocks for copies.copy_pages, one per run of consecutive
        slots and consecutive pages of kv: page positions[i] of kv [L, 2, H, N, D] sits in
        places[i] (positions increasing; an int p stands for p, p+1, ...: a get's or a whole
        put's). Also how many leading places the blocks cover (they stop at a slot not mapped
        here). Host slots and a CPU kv give numpy byte views (a few numpy calls, where each
        torch view is ~10x one on a get's path); VRAM slots or a GPU kv give torch views."""
        page_tokens = self.geometry.shape[3]
        byte_rows = None if kv.is_cuda else _byte_rows(kv, page_tokens)
        if byte_rows is not None:
            blocks = self._blocks(places, positions, byte_rows, self._host_runs)
            if blocks is not None:
                return blocks
        return self._blocks(places, positions, page_rows(kv, page_tokens),
                            lambda table: [(run, slab_order(block))
                                           for run, block in self.runs(table)])

    def _blocks(self, places: np.ndarray, positions: np.ndarray | int, rows,
                runs_of) -> tuple[list[Pair], int] | None:
        """kv_blocks over `rows` (kv's pages: [L, 2, H, pages, T, ...]) and `runs_of(places)`
        ((run, its slots in rows' order) for the leading mapped runs; None: not this way)."""
        if isinstance(positions, int):
            stretch_starts, firsts = [0], [positions]  # one stretch: no pass over positions
        else:
            stretch_starts = np.flatnonzero(np.diff(positions, prepend=-2) != 1).tolist()
            firsts = np.asarray(positions)[stretch_starts].tolist()
        blocks, covered = [], 0
        for start, end, first in zip(stretch_starts, stretch_starts[1:] + [len(places)], firsts,
                                     strict=True):
            runs = runs_of(places[start:end])
            if runs is None:
                return None
            blocks += [(rows[:, :, :, first + run.position : first + run.position + run.count],
                        block) for run, block in runs]
            covered += sum(run.count for run, _ in runs)
            if covered < end:
                break
        return blocks, covered

    def _host_runs(self, places: np.ndarray) -> list[tuple[SlotRun, np.ndarray]] | None:
        """runs(places) as numpy byte views in page_rows' order [L, 2, H, count, T, bytes];
        None when a run is in the device tier."""
        per_chunk = [mapping.slots_per_chunk for mapping in self._mappings]
        page_bytes, shape = self.geometry.page_bytes, self.geometry.shape
        row_bytes = shape[4] * self.geometry.torch_dtype().itemsize
        views = []
        for run in slot_runs(places, per_chunk):
            raw = self._mappings[run.tier].run_array(run.first_slot, run.count)
            if raw is None:
                return None
            pages = np.reshape(raw, (run.count, -1))[:, :page_bytes]
            block = np.reshape(pages, (run.count, *shape[:4], row_bytes), copy=False)
            views.append((run, block.transpose(1, 2, 3, 0, 4, 5)))
        return views

    # ---- hints ----------------------------------------------------------------------------

    def hinted(self, keys: list[PageKey]) -> np.ndarray:
        """Places of the longest prefix of `keys` with a live hint (mapped slabs only), as
        an int64 [N, 3] slot table: this client's notes, then the node's held-pages index."""
        return self.located(keys)[0]

    def located(self, keys: list[PageKey]) -> tuple[np.ndarray, int]:
        """(places, noted): the places of the longest prefix of `keys` that this client
        noted (the first `noted` of them) or the node's held-pages index holds (the rest)."""
        if self.epoch is None:
            return as_places([]), 0
        with self._lock:
            noted = self._hints.prefix(keys, time.monotonic() - HINT_TTL_S)
            held = self._held if self.use_held else None
        if held is None or len(noted) == len(keys):
            return noted, len(noted)
        more = held.prefix(keys[len(noted):])
        return (np.concatenate([noted, more]) if len(noted) else more), len(noted)

    def remember(self, keys: list[PageKey], places) -> None:
        """Note where the node said (or a put found) these pages are, as of now."""
        places = as_places(places)[: len(keys)]
        with self._lock:
            self._hints.note(keys[: len(places)], places, time.monotonic())

    def forget(self, keys: list[PageKey]) -> None:
        with self._lock:
            self._hints.forget(keys)

    def num_unchanged(self, places) -> int:
        """How many leading places still hold their generation (the rest are stale)."""
        return num_unchanged(as_places(places), [m.generations for m in self._mappings])

    def unchanged(self, places) -> np.ndarray:
        """Per place, whether it still holds its generation (bool [N])."""
        return unchanged(as_places(places), [m.generations for m in self._mappings])


def _byte_rows(kv: torch.Tensor, page_tokens: int) -> np.ndarray | None:
    """A CPU kv [L, 2, H, N, D] as numpy bytes in page_rows' shape [L, 2, H, N // T, T, D *
    itemsize] (a view: the copies write into kv); None where no such view exists (a last
    dimension that is not contiguous: the torch path copies those)."""
    try:
        data = host_bytes(kv)
    except RuntimeError:
        return None
    num_pages = data.shape[3] // page_tokens
    try:
        return np.reshape(data[:, :, :, : num_pages * page_tokens],
                          (*data.shape[:3], num_pages, page_tokens, data.shape[4]), copy=False)
    except ValueError:
        return None


def _prefault_thread() -> ThreadPoolExecutor:
    """At a lower CPU priority: it yields to the copies."""
    return background_thread("raykv-prefault")
