"""A pool's reads from its disk tier up into host memory (a mixin of Pool).

    host has room      disk --O_DIRECT--> host slots                       one batched read
    host is full       disk --O_DIRECT--> staging  } at once, then staging --> host slots
                       host victims --demote--> disk }

When host is full, making room demotes victims, and their disk writes used to come first: the
read waited for them. Now the read lands in aligned staging buffers while the victims are
written, and the pages are copied into the freed slots after (a memcpy, far cheaper than
waiting for the writes). Pages that find no slot stay on disk. A page another request is
already loading is awaited, not read twice.

Each namespace stays within its max in the host tier, as its puts do: before the read, its
own least valuable host pages are demoted to make the room (namespace_max.admitted_into),
and the pages they cannot make room for stay on disk (unread); a page whose room another
read-up took meanwhile stays on disk too (checked as it is placed).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import torch

from cluster.core import quant
from cluster.core.geometry import DISK, HOST
from cluster.core.keys import PageKey
from cluster.core.namespace_max import admitted_into, namespace_room_pages
from cluster.core.pool_entry import Entry, State
from cluster.core.tiers.aligned import aligned_empty


class DiskLoads:
    """Pool's disk-to-host reads. Uses the pool's index, tiers, loads claims and make_room."""

    async def load_from_disk(self, keys: list[PageKey], keep_unmoved: bool = False) -> None:
        """Read the disk-resident pages among `keys` up into host, in one batched read.

        `keep_unmoved`: a read-up that no request waits on (a touch's, a prefetch's) takes
        only the room the host's victims leave by going down to disk; it drops none of them
        (a failing disk, say), and the pages that find no room stay on disk (demote)."""
        wanted = [k for k in keys if k in self._loads or self._on_disk_ready(k)]
        todo, waits, done = self._loads.claim(wanted)
        for key in todo:
            self.index[key].state = State.MOVING
        try:
            if todo:
                await self._read_disk_batch(todo, keep_unmoved)
        finally:
            for key in todo:
                if key in self.index:
                    self.index[key].state = State.READY
            self._loads.finish(todo, done)
        await self._loads.wait(waits)

    def _on_disk_ready(self, key: PageKey) -> bool:
        entry = self.index.get(key)
        return entry is not None and entry.tier == DISK and entry.state == State.READY

    async def _read_disk_batch(self, keys: list[PageKey], keep_unmoved: bool) -> None:
        keys, _ = await admitted_into(self, HOST, keys[: self._num_slots(HOST)], keep_unmoved)
        if not keys:
            return
        self.note_host_batch(len(keys))  # before it takes free room: demote_ahead.py
        if self._free_slots(HOST) < len(keys):  # room with no write: unused leased slots
            self.revoke_leased(HOST, len(keys) - self._free_slots(HOST))
        if self._free_slots(HOST) >= len(keys):  # new chunks faulted in off the event loop
            await self.ready_held(HOST, len(keys))
        if self._free_slots(HOST) >= len(keys):
            slots = [self.memory[HOST].alloc() for _ in keys]
            outs = [self._read_target(self.index[k], s) for k, s in zip(keys, slots, strict=True)]
            metas = await self._read_into_slots(keys, slots, outs)
            with self.held_batched():
                for key, slot, out, meta in zip(keys, slots, outs, metas, strict=True):
                    self._place(key, slot, out, meta, copy=False)
            return
        slot_bytes = self.geometry.slot_bytes  # a multiple of 4096: every row stays aligned
        block = aligned_empty(len(keys) * slot_bytes)  # one mapping for the batch
        staging = [block[i * slot_bytes : (i + 1) * slot_bytes] for i in range(len(keys))]
        reading = asyncio.ensure_future(self._read_pages(keys, staging))
        # Under the room lock, as a put's reserve and demotion ahead: the victims this makes
        # room from are MOVING until their writes land, and a reserve meanwhile found only
        # the rest (a failing disk's write let a put store 2 of its 4 pages). Held until the
        # pages are placed, so the room made is this read-up's own.
        async with self.room_lock:
            try:
                await self.make_room(HOST, len(keys), keep_unmoved=keep_unmoved)
            finally:
                metas = await reading
            fits = min(len(keys), self._free_slots(HOST))
            with self.held_batched():
                for key, out, meta in zip(keys[:fits], staging, metas, strict=False):
                    self._place(key, self.memory[HOST].alloc(), out, meta, copy=True)

    async def _read_into_slots(self, keys: list[PageKey], slots: list[int],
                               outs: list[np.ndarray]) -> list:
        """_read_pages into host `slots`. A read-up cancelled (or failed) meanwhile gives
        them back only once the read has landed: it runs in a thread that a cancel does not
        stop, and a slot handed to another page before would take its late bytes."""
        reading = asyncio.ensure_future(self._read_pages(keys, outs))
        try:
            return await asyncio.shield(reading)
        except BaseException:
            reading.add_done_callback(lambda done: self._free_host(slots, done))
            raise

    def _free_host(self, slots: list[int], read: asyncio.Future) -> None:
        if not read.cancelled():
            read.exception()  # seen here: the read-up that awaited it has gone
        for slot in slots:
            self.memory[HOST].free(slot)

    async def _read_pages(self, keys: list[PageKey], outs: list[np.ndarray]) -> list:
        disk_slots = [self.index[k].slot for k in keys]
        start_s = time.perf_counter()
        metas = await asyncio.to_thread(self.disk.read_pages, disk_slots, outs)
        elapsed_s = time.perf_counter() - start_s
        self.disk_read_s += elapsed_s
        sample = elapsed_s * 1e6 / (len(keys) * self.geometry.shape[3])
        self.disk_read_us_per_token = 0.8 * self.disk_read_us_per_token + 0.2 * sample
        return metas

    def _place(self, key: PageKey, slot: int, out: np.ndarray, meta, copy: bool) -> None:
        """Page `key`, read into `out`, into host `slot` (copied there when `copy`: it was read
        into staging); a corrupt or overwritten page is dropped, a miss from now on, and one
        its namespace's max in host has no room for stays on disk."""
        entry = self.index[key]
        if meta is None or meta.key != bytes(key):
            self.memory[HOST].free(slot)
            self.drop(key)
            return
        if namespace_room_pages(self, HOST, entry.namespace) == 0:  # taken meanwhile
            self.memory[HOST].free(slot)  # its disk copy is whole: it stays there
            return
        if entry.codec != 0:
            self._decode_into(self.memory[HOST].view(slot), out[: meta.payload_bytes],
                              entry.codec)
        elif copy:
            target = self.memory[HOST].view(slot).numpy()
            np.copyto(target[: meta.payload_bytes], out[: meta.payload_bytes])
        # A raw page keeps the checksum its read verified (never hashed again); a decoded one
        # has none yet: the encoded bytes' checksum is not the page's.
        entry.checksum = meta.checksum if entry.codec == 0 else None
        self._relocate(key, entry, HOST, slot)
        entry.codec = 0

    def _read_target(self, entry: Entry, host_slot: int) -> np.ndarray:
        # Raw pages land straight in the (4096-aligned) host slot; quantized ones need staging.
        if entry.codec == 0:
            return self.memory[HOST].view(host_slot).numpy()
        return np.empty(self.geometry.slot_bytes, dtype=np.uint8)

    def _decode_into(self, view: torch.Tensor, payload: np.ndarray, codec: int) -> None:
        dtype = self.geometry.torch_dtype()
        out = view[: self.geometry.page_bytes].view(dtype).view(self.geometry.shape)
        quant.decode_page(payload, quant.codec_name(codec), self.geometry.shape, dtype, out)
