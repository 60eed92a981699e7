"""Decoding over a context whose pages are partly on disk: the workload of the paging tax.

    context:  [ resident pages, in memory ] [ disk pages: DiskArena slots, one arena per codec ]
    window:   a few 4096-aligned page buffers that disk pages are read (and decoded) into

Every token attends to every page (paged_attention.OnlineAttention), so each disk page is read
once per token. A load brings a batch of pages (a run of window buffers) in with one
DiskArena.read_pages (O_DIRECT; the arena's threads read and checksum the pages in parallel)
and, for a quantized codec, decodes the whole batch with quant.decode_pages (a few tensor ops
per batch, not per page); loads run on a loader thread, off the decoding thread, which gets
one hand-off per batch. The ways to decode a token (DECODE_STEPS):

    resident   attend to the resident pages and the disk pages' in-memory originals: compute only
    sync       read a window of disk pages (its two halves' batches at once), wait for it,
               attend; repeat; then resident
    prefetch   the window in two halves, each a batch in flight: attend to resident pages while
               they land; take each batch as it arrives and reload its half with the next pages

A step returns, or raises, only once every load it issued has landed: the window is the next
step's, and a load still reading into it would overwrite (or fail the checksum of) the pages
that step reads there.

Pure: no Ray. Pages of a quantized codec come back as their decoded values, not the originals.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from cluster.core import quant
from cluster.core.geometry import PageGeometry
from cluster.core.keys import KEY_BYTES
from cluster.core.paged_attention import OnlineAttention
from cluster.core.tiers.aligned import aligned_empty, round_up
from cluster.core.tiers.disk import DiskArena

WRITE_BATCH_PAGES = 16


class PageWindow:
    """`num_buffers` aligned page buffers, seen as raw bytes and as page tensors, and an
    aligned staging buffer each for payloads that must be decoded. Each kind is one block of
    equal, 4096-aligned rows, so that a run of buffers is one tensor (`batch`, `staging_rows`)
    that a batch's decode covers with a few whole-batch ops."""

    def __init__(self, geometry: PageGeometry, num_buffers: int) -> None:
        if num_buffers <= 0:
            raise ValueError(f"the window needs at least one buffer, got {num_buffers}")
        dtype = geometry.torch_dtype()
        # a quantized payload (scales + 1 byte per element) is never larger than the raw page
        row_bytes = round_up(geometry.page_bytes)
        raw_block, staging_block = (aligned_empty(num_buffers * row_bytes) for _ in range(2))
        for block in (raw_block, staging_block):
            block.fill(0)  # fault the pages in now, not inside a timed load
        self._raw_rows = torch.from_numpy(raw_block).view(num_buffers, row_bytes)
        self._staging_rows = torch.from_numpy(staging_block).view(num_buffers, row_bytes)
        self._pages = self._raw_rows[:, : geometry.page_bytes].view(dtype).unflatten(
            1, geometry.shape)
        self.raw = [raw_block[i * row_bytes : i * row_bytes + geometry.page_bytes]
                    for i in range(num_buffers)]
        self.staging = [staging_block[i * row_bytes : (i + 1) * row_bytes]
                        for i in range(num_buffers)]
        self.pages = list(self._pages.unbind(0))

    @property
    def num_buffers(self) -> int:
        return len(self.raw)

    def batch(self, buffers: range) -> torch.Tensor:
        """Buffers `buffers` (a run of them) as one [n, *page shape] tensor."""
        return self._pages[buffers.start : buffers.stop]

    def staging_rows(self, buffers: range) -> torch.Tensor:
        """Their staging buffers as one uint8 [n, row bytes] tensor."""
        return self._staging_rows[buffers.start : buffers.stop]


class DiskPages:
    """A context's disk pages in one codec: written once, then loaded into a window."""

    def __init__(self, arena: DiskArena, geometry: PageGeometry, codec: str) -> None:
        self.arena, self.geometry, self.codec = arena, geometry, codec
        self.payload_bytes = quant.payload_bytes(geometry.shape, geometry.torch_dtype(), codec)
        self.slots: list[int] = []
        self.keys: list[bytes] = []

    def __len__(self) -> int:
        return len(self.slots)

    def write(self, pages: list[torch.Tensor], seed: int = 0) -> None:
        """Encode and write `pages` to slots in a shuffled order, as a tier in use holds them."""
        assert not self.slots, "pages were written already"
        slots = [self.arena.alloc() for _ in pages]
        if None in slots:
            for slot in slots:
                if slot is not None:
                    self.arena.free(slot)
            raise ValueError(f"the arena holds {self.arena.num_free} free pages, not "
                             f"{len(pages)}")
        random.Random(seed).shuffle(slots)
        self.slots = slots
        self.keys = [index.to_bytes(KEY_BYTES, "little") for index in range(len(pages))]
        codec_id = quant.codec_id(self.codec)
        for start in range(0, len(pages), WRITE_BATCH_PAGES):
            batch = range(start, min(start + WRITE_BATCH_PAGES, len(pages)))
            self.arena.write_pages([(self.slots[i], self.keys[i], codec_id,
                                     quant.encode_page(pages[i], self.codec)) for i in batch])

    def load(self, first_index: int, window: PageWindow, buffers: range) -> None:
        """Read pages first_index, first_index + 1, ... into window buffers `buffers` (a run of
        them) as one batch: one DiskArena.read_pages (its threads read and checksum the pages
        in parallel), then, for a quantized codec, one decode of the whole batch. A page that
        comes back missing or as another page raises RuntimeError."""
        indices = range(first_index, first_index + len(buffers))
        raw = self.codec == "none"
        outs = [(window.raw if raw else window.staging)[buffer][: self.payload_bytes]
                for buffer in buffers]
        metas = self.arena.read_pages([self.slots[i] for i in indices], outs)
        for index, meta in zip(indices, metas, strict=True):
            if meta is None or meta.key != self.keys[index]:
                raise RuntimeError(f"disk page {index} (slot {self.slots[index]}) came back "
                                   f"missing or corrupt")
        if not raw:
            quant.decode_pages(window.staging_rows(buffers), self.codec, self.geometry.shape,
                               window.batch(buffers))


class StallClock:
    """Seconds the decoding thread spent waiting for disk pages, rather than computing."""

    def __init__(self) -> None:
        self.total_s = 0.0

    @contextmanager
    def waiting(self) -> Iterator[None]:
        start_s = time.perf_counter()
        try:
            yield
        finally:
            self.total_s += time.perf_counter() - start_s


@dataclass(frozen=True, slots=True)
class PagedContext:
    """The pages of one context and the means to bring the disk ones in."""

    resident: list[torch.Tensor]  # pages kept in memory
    originals: list[torch.Tensor]  # the disk pages' in-memory copies: the resident baseline
    window: PageWindow
    loader: ThreadPoolExecutor  # runs DiskPages.load, a batch at a time
    stall: StallClock = field(default_factory=StallClock)


def resident_token(context: PagedContext, query: torch.Tensor,
                   disk: DiskPages | None = None) -> torch.Tensor:
    """The token with every page in memory (`disk` is not read)."""
    attention = OnlineAttention(query)
    for page in (*context.resident, *context.originals):
        attention.add_page(page)
    return attention.output()


def sync_token(context: PagedContext, query: torch.Tensor, disk: DiskPages) -> torch.Tensor:
    """Disk pages read when needed: a window's worth at a time, waited for, then attended. The
    window loads as two batches at once (window_groups), so that one half's decode overlaps
    the other half's reads; the decoding thread waits for both."""
    attention = OnlineAttention(query)
    window = context.window
    for start in range(0, len(disk), window.num_buffers):
        count = min(window.num_buffers, len(disk) - start)
        futures = [context.loader.submit(disk.load, start + group.start, window,
                                         range(group.start, min(group.stop, count)))
                   for group in window_groups(window.num_buffers) if group.start < count]
        with context.stall.waiting():
            wait(futures)  # all of them, even once one failed: none may still be reading
            for future in futures:
                future.result()
        for buffer in range(count):
            attention.add_page(window.pages[buffer])
    for page in context.resident:
        attention.add_page(page)
    return attention.output()


def window_groups(num_buffers: int) -> list[range]:
    """The window split in two runs of buffers (one when it has a single buffer): while the
    decode attends to one run's pages, the other run's batch is being read."""
    half = -(-num_buffers // 2)
    return [range(0, half), range(half, num_buffers)] if num_buffers > 1 else [range(1)]


class _Stream:
    """Disk pages 0..n-1 flowing through the window's buffers in order, a batch per group of
    buffers (window_groups) in flight; a group is reloaded with the next pages once its batch
    was attended to. A context manager: leaving it, raising or not, waits for the batches
    still in flight (a failed batch leaves the next one reading into the window)."""

    def __init__(self, context: PagedContext, disk: DiskPages) -> None:
        self.context, self.disk = context, disk
        self.next_index = 0
        self.inflight: deque[tuple[range, range, Future]] = deque()  # group, loaded, batch

    def __enter__(self) -> _Stream:
        try:
            for group in window_groups(self.context.window.num_buffers):
                self._issue(group)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        wait([future for _, _, future in self.inflight])
        self.inflight.clear()

    def _issue(self, group: range) -> None:
        count = min(len(group), len(self.disk) - self.next_index)
        if count > 0:
            buffers = range(group.start, group.start + count)
            future = self.context.loader.submit(self.disk.load, self.next_index,
                                                self.context.window, buffers)
            self.inflight.append((group, buffers, future))
            self.next_index += count

    def _take_head(self, use: Callable[[torch.Tensor], None]) -> None:
        group, buffers, future = self.inflight.popleft()
        with self.context.stall.waiting():
            future.result()
        for buffer in buffers:
            use(self.context.window.pages[buffer])
        self._issue(group)

    def take_ready(self, use: Callable[[torch.Tensor], None]) -> None:
        """`use` each page whose batch has landed (in order), reloading their buffers."""
        while self.inflight and self.inflight[0][2].done():
            self._take_head(use)

    def take_rest(self, use: Callable[[torch.Tensor], None]) -> None:
        while self.inflight:
            self._take_head(use)


def prefetch_token(context: PagedContext, query: torch.Tensor, disk: DiskPages) -> torch.Tensor:
    """Disk reads issued ahead: resident pages are attended to while the disk pages land."""
    attention = OnlineAttention(query)
    with _Stream(context, disk) as stream:
        for page in context.resident:
            attention.add_page(page)
            stream.take_ready(attention.add_page)
        stream.take_rest(attention.add_page)
    return attention.output()


def beside_token(context: PagedContext, query: torch.Tensor, disk: DiskPages) -> torch.Tensor:
    """A diagnostic, not a way to decode: every page attended from memory, as resident_token
    does, while the disk pages are loaded exactly as prefetch_token loads them and then thrown
    away. Its tax is what the loads cost a decode that never waits for them: how much of
    prefetch's remaining tax is the loads' CPU and memory traffic beside the decode."""
    attention = OnlineAttention(query)
    with _Stream(context, disk) as stream:
        for page in (*context.resident, *context.originals):
            attention.add_page(page)
            stream.take_ready(_discard)
        stream.take_rest(_discard)
    return attention.output()


def _discard(page: torch.Tensor) -> None:
    pass


DecodeStep = Callable[[PagedContext, torch.Tensor, DiskPages], torch.Tensor]
DECODE_STEPS: dict[str, DecodeStep] = {
    "resident": resident_token,
    "sync": sync_token,
    "prefetch": prefetch_token,
    "beside": beside_token,
}


def random_pages(geometry: PageGeometry, num_pages: int, seed: int) -> list[torch.Tensor]:
    """Seeded normal pages of the geometry's shape and dtype."""
    generator = torch.Generator().manual_seed(seed)
    dtype = geometry.torch_dtype()
    return [torch.randn(geometry.shape, generator=generator).to(dtype)
            for _ in range(num_pages)]


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """rms(got - expected) / rms(expected)."""
    scale = float(expected.float().square().mean().sqrt())
    return float((got.float() - expected.float()).square().mean().sqrt()) / max(scale, 1e-30)

