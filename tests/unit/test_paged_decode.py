"""Decoding over a partly paged-out context: the online attention, and every decode step
giving the resident answer from pages read back off a real DiskArena. Tiny sizes, no Ray."""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cluster.core import quant
from cluster.core.geometry import PageGeometry
from cluster.core.paged_attention import OnlineAttention
from cluster.core.paged_decode import (
    DECODE_STEPS,
    DiskPages,
    PagedContext,
    PageWindow,
    random_pages,
    relative_error,
    window_groups,
)
from cluster.core.tax_model import page_read_bytes
from cluster.core.tiers.disk import HEADER_BYTES, DiskArena
from tests.unit._pages import make_disk_dir, remove_dir

GEOMETRY = PageGeometry((2, 2, 2, 16, 16), "float32")  # [layers, k/v, kv heads, tokens, dim]
GROUP = 3  # query heads per kv head


def query(seed: int = 7) -> torch.Tensor:
    return torch.randn(2, 2, GROUP, 16, generator=torch.Generator().manual_seed(seed))


def reference_attention(q: torch.Tensor, pages: list[torch.Tensor]) -> torch.Tensor:
    """softmax(q K^T / sqrt(d)) V over all the pages' tokens at once."""
    kv = torch.cat(pages, dim=3).double()  # [L, 2, H, T, D]
    scores = torch.matmul(q.double(), kv[:, 0].transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.matmul(torch.softmax(scores, dim=-1), kv[:, 1]).float()


def attend(q: torch.Tensor, pages: list[torch.Tensor]) -> torch.Tensor:
    attention = OnlineAttention(q)
    for page in pages:
        attention.add_page(page)
    return attention.output()


def test_online_attention_is_softmax_attention_in_any_page_order():
    pages = random_pages(GEOMETRY, 5, seed=1)
    q = query()
    expected = reference_attention(q, pages)
    assert torch.allclose(attend(q, pages), expected, rtol=1e-5, atol=1e-6)
    assert torch.allclose(attend(q, pages[::-1]), expected, rtol=1e-5, atol=1e-6)


def test_online_attention_takes_bf16_pages():
    pages = random_pages(PageGeometry(GEOMETRY.shape, "bfloat16"), 3, seed=2)
    q = query()
    assert torch.allclose(attend(q, pages), reference_attention(q, pages), rtol=1e-4, atol=1e-5)


def test_online_attention_wants_a_grouped_query():
    with pytest.raises(ValueError, match="query"):
        OnlineAttention(torch.zeros(2, 2, 16))


def test_the_window_is_aligned_and_faulted_in():
    window = PageWindow(GEOMETRY, 3)
    assert window.num_buffers == 3
    for raw, page in zip(window.raw, window.pages, strict=True):
        assert raw.ctypes.data % 4096 == 0 and page.shape == GEOMETRY.shape
        assert page.data_ptr() == raw.ctypes.data
    with pytest.raises(ValueError):
        PageWindow(GEOMETRY, 0)


def test_a_run_of_window_buffers_is_one_tensor_over_the_same_memory():
    window = PageWindow(GEOMETRY, 5)
    batch = window.batch(range(1, 4))
    assert batch.shape == (3, *GEOMETRY.shape)
    for offset, buffer in enumerate(range(1, 4)):
        assert batch[offset].data_ptr() == window.pages[buffer].data_ptr()
    rows = window.staging_rows(range(2, 5))
    assert rows.shape[0] == 3 and rows[0].data_ptr() == window.staging[2].ctypes.data


@pytest.mark.parametrize(("num_buffers", "groups"), [(1, [range(1)]), (2, [range(1), range(1, 2)]),
                                                      (5, [range(3), range(3, 5)]),
                                                      (8, [range(4), range(4, 8)])])
def test_the_window_splits_in_two_runs_of_buffers(num_buffers, groups):
    assert window_groups(num_buffers) == groups


class Paged:
    """A context of `num_pages` pages, the first `num_disk` of them on disk in each codec."""

    def __init__(self, num_pages: int, num_disk: int, window_pages: int) -> None:
        self.dir = make_disk_dir()
        pages = random_pages(GEOMETRY, num_pages, seed=3)
        self.context = PagedContext(pages[num_disk:], pages[:num_disk],
                                    PageWindow(GEOMETRY, window_pages), ThreadPoolExecutor(3))
        self.disk = {codec: self._write(codec) for codec in quant.CODECS}

    def _write(self, codec: str) -> DiskPages:
        payload = quant.payload_bytes(GEOMETRY.shape, torch.float32, codec)
        num_disk = len(self.context.originals)
        arena = DiskArena(os.path.join(self.dir, codec), num_disk * page_read_bytes(payload),
                          payload, 2)
        disk = DiskPages(arena, GEOMETRY, codec)
        disk.write(self.context.originals)
        return disk

    def token(self, step: str, codec: str = "none") -> torch.Tensor:
        return DECODE_STEPS[step](self.context, query(), self.disk[codec])

    def close(self) -> None:
        self.context.loader.shutdown()
        for disk in self.disk.values():
            disk.arena.close()
        remove_dir(self.dir)


@pytest.fixture
def paged(request):
    made = []

    def make(num_pages=9, num_disk=4, window_pages=2) -> Paged:
        made.append(Paged(num_pages, num_disk, window_pages))
        return made[-1]

    yield make
    for each in made:
        each.close()


@pytest.mark.parametrize(("num_disk", "window_pages"), [(4, 2), (4, 1), (3, 8), (9, 2), (7, 5)])
@pytest.mark.parametrize("step", ["sync", "prefetch", "beside"])
def test_raw_disk_pages_give_the_resident_answer(paged, num_disk, window_pages, step):
    context = paged(9, num_disk, window_pages)
    all_pages = [*context.context.originals, *context.context.resident]
    expected = reference_attention(query(), all_pages)
    assert torch.allclose(context.token("resident"), expected, rtol=1e-5, atol=1e-6)
    assert torch.allclose(context.token(step), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("codec", "max_error"), [("int8", 0.02), ("fp8", 0.06)])
@pytest.mark.parametrize("step", ["sync", "prefetch"])
@pytest.mark.parametrize("window_pages", [1, 2, 3])
def test_quantized_disk_pages_give_it_within_the_codecs_rounding(paged, codec, max_error, step,
                                                                 window_pages):
    context = paged(9, 4, window_pages)
    error = relative_error(context.token(step, codec), context.token("resident"))
    assert 0 < error < max_error


def test_pages_land_in_shuffled_slots_and_read_back_by_key(paged):
    context = paged(12, 8, 2)
    disk = context.disk["none"]
    assert sorted(disk.slots) == list(range(8)) and disk.slots != list(range(8))
    assert disk.arena.slot_bytes == page_read_bytes(GEOMETRY.page_bytes)


def test_a_corrupt_disk_page_is_an_error_not_a_wrong_answer(paged):
    context = paged()
    disk = context.disk["none"]
    path = os.path.join(disk.arena.dir_path, "slab-00000.bin")
    offset = disk.slots[1] * disk.arena.slot_bytes + HEADER_BYTES + 10
    with open(path, "r+b") as handle:  # O_DIRECT readers see it once it is on disk
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))
        handle.flush()
        os.fsync(handle.fileno())
    for step in ("sync", "prefetch", "beside"):
        with pytest.raises(RuntimeError, match="disk page 1"):
            context.token(step)


@pytest.mark.parametrize(("step", "failing", "reading"),
                         [("sync", 0, 1), ("prefetch", 1, 2), ("beside", 1, 2)])
def test_a_step_that_raises_has_no_load_still_reading_into_the_window(paged, step, failing,
                                                                      reading):
    """A page fails while another load is still reading: the step raises only once that load
    has landed. Left in flight, it wrote into the window the next step loaded into, and a good
    page there failed its checksum (or was overwritten once it had passed it)."""
    context = paged()
    disk = context.disk["none"]
    started, landed = threading.Event(), threading.Event()
    read_pages = disk.arena.read_pages

    def read(slots, outs):
        if slots == [disk.slots[failing]]:
            assert started.wait(10), f"page {reading} was never loaded"
            return [None]
        if slots == [disk.slots[reading]]:
            started.set()
            time.sleep(0.3)  # still reading when page `failing` comes back missing
            metas = read_pages(slots, outs)
            landed.set()
            return metas
        return read_pages(slots, outs)

    disk.arena.read_pages = read
    with pytest.raises(RuntimeError, match=f"disk page {failing}"):
        context.token(step)
    assert landed.is_set(), f"{step} raised with page {reading}'s load still in flight"


@pytest.mark.parametrize("step", ["prefetch", "beside"])
def test_the_beside_diagnostic_loads_what_prefetch_loads(paged, step):
    """beside_token (tax's loads-beside) reads every disk page in the batches prefetch
    reads them in, and attends to the in-memory originals instead of what it read."""
    context = paged(9, 5, 2)
    disk = context.disk["none"]
    batches = []
    read_pages = disk.arena.read_pages

    def counted(slots, outs):
        batches.append(list(slots))
        return read_pages(slots, outs)

    disk.arena.read_pages = counted
    context.token(step)
    assert sorted(slot for batch in batches for slot in batch) == sorted(disk.slots)
    assert [len(batch) for batch in batches] == [1, 1, 1, 1, 1]  # window 2: halves of 1


def test_writing_more_pages_than_the_arena_holds_is_refused(paged):
    context = paged()
    disk = DiskPages(context.disk["none"].arena, GEOMETRY, "none")  # its slots are all taken
    with pytest.raises(ValueError, match="holds"):
        disk.write(context.context.originals)


def test_only_paged_steps_wait_for_pages(paged):
    context = paged()
    stall = context.context.stall
    context.token("resident")
    assert stall.total_s == 0.0
    context.token("sync")
    after_sync = stall.total_s
    assert after_sync > 0
    context.token("prefetch")
    assert stall.total_s >= after_sync
