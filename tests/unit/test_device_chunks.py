"""The device tier's chunks through its CPU stand-in, which behaves as the CUDA backing does:
one allocation per chunk (a shm file each, made on every grant), per-chunk handles with
offsets and sizes, a layout version, and clients that remap or miss, never writing through
a stale mapping (issue 15, findings 1 and 3)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from cluster.client import KVClient
from cluster.core.config import CacheConfig
from cluster.core.geometry import DEVICE, HOST, PageGeometry
from cluster.core.keys import page_keys
from cluster.core.spec import ModelSpec
from cluster.core.tiers.chunks import Share, TierBudget
from cluster.core.tiers.device_chunks import ChunkHandle, DeviceLayout, DeviceMaps
from cluster.core.tiers.memory import ArenaMapping, ArenaOptions, MappedArena
from cluster.slabs import LocalSlabs
from cluster.view import CacheView
from tests.unit._fakes import FakeDirectory, FakeNode, FakePeers, FakeTransport, drive
from tests.unit._pages import shm_files, unique_prefix

SLOT_BYTES = 4096
SPEC = ModelSpec("tiny", 2, 2, 16, "float32")
PAGE_TOKENS = 16
G = PageGeometry.of(SPEC, PAGE_TOKENS)


def device_arena(prefix: str, num_slots: int = 4, slots_per_chunk: int = 1,
                 slot_bytes: int = SLOT_BYTES, budget_slots: int | None = None) -> MappedArena:
    budget = TierBudget((budget_slots or num_slots) * slot_bytes)
    share = Share(budget, "model", slots_per_chunk * slot_bytes)
    return MappedArena("device", num_slots * slot_bytes, slot_bytes,
                       ArenaOptions(shm_prefix=prefix, share=share))


@pytest.fixture
def prefix():
    name = unique_prefix()
    yield name
    assert shm_files(name) == []


# ---- the stand-in's allocations (finding 3's logic on CPU) ---------------------------------


def test_a_device_chunk_granted_again_is_a_new_allocation_and_bumps_the_layout_version(prefix):
    arena = device_arena(prefix)
    slot = arena.alloc()
    arena.view(slot).fill_(1)
    stale = ArenaMapping(arena.descriptor()).view(slot)  # a client's view, then the chunk goes
    version = arena.layout_version
    arena.free(slot)
    assert arena.slots.release_empty() == 1
    assert arena.layout_version > version  # clients learn that they must map again
    assert arena.alloc() == slot
    arena.view(slot).fill_(2)
    assert int(stale[0]) == 1  # the old mapping is of the old allocation: really stale
    assert int(ArenaMapping(arena.descriptor()).view(slot)[0]) == 2
    arena.close()


def test_each_device_chunk_is_its_own_allocation_of_exactly_its_size(prefix):
    arena = device_arena(prefix, num_slots=5, slots_per_chunk=2, budget_slots=6)  # 2, 2, 1
    slots = [arena.alloc() for _ in range(5)]
    assert slots == [0, 1, 2, 3, 4]
    layout = arena.descriptor().device_layout
    assert [(c.chunk, c.offset_bytes, c.nbytes) for c in layout.chunks] == [
        (0, 0, 2 * SLOT_BYTES), (1, 2 * SLOT_BYTES, 2 * SLOT_BYTES),
        (2, 4 * SLOT_BYTES, SLOT_BYTES)]  # the short last chunk is short
    assert [os.path.getsize(c.shm_path) for c in layout.chunks] == [c.nbytes for c in
                                                                    layout.chunks]
    assert len({c.grant for c in layout.chunks}) == 3
    for slot in (2, 3):
        arena.free(slot)
    arena.slots.release_empty()  # chunk 1 goes back: its memory with it
    assert not os.path.exists(layout.chunks[1].shm_path)
    assert [c.chunk for c in arena.descriptor().device_layout.chunks] == [0, 2]
    arena.close()
    assert all(not os.path.exists(c.shm_path) for c in layout.chunks)


def test_the_chunk_table_holds_while_a_thread_grants_and_releases(prefix):
    """grow_ahead readies chunks in a thread while the loop reads the layout."""
    arena = device_arena(prefix, num_slots=8)
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            arena.ready_chunk(7)
            arena._release_chunk(7)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        versions = []
        for _ in range(300):
            layout = arena.descriptor().device_layout
            chunks = [c.chunk for c in layout.chunks]
            assert chunks == sorted(set(chunks)) and set(chunks) <= {7}
            versions.append(layout.version)
    finally:
        stop.set()
        thread.join()
    assert versions == sorted(versions)
    arena.close()


def test_a_mapping_keeps_unchanged_chunks_and_maps_new_grants(prefix):
    arena = device_arena(prefix)
    first = arena.alloc()
    mapping = ArenaMapping(arena.descriptor())
    kept = mapping.device.mapped_chunks
    second = arena.alloc()  # granted after the client mapped
    assert mapping.view(second) is None  # not mapped yet: a miss, not a KeyError
    mapping.update(arena.descriptor())
    assert mapping.device.mapped_chunks == {**kept, 1: mapping.device.mapped_chunks[1]}
    arena.view(second).fill_(9)
    assert int(mapping.view(second)[0]) == 9 and mapping.view(first) is not None
    arena.close()


# ---- through the client: remap or miss -------------------------------------------------------


class World:
    """A local node whose puts go to a chunked device arena (the stand-in), and a client."""

    def __init__(self, prefix: str, num_slots: int = 4):
        self.arenas = [device_arena(prefix, num_slots, slot_bytes=G.slot_bytes),
                       MappedArena("host", 4 * G.slot_bytes, G.slot_bytes,
                                   ArenaOptions(shm_prefix=prefix))]
        self.node = FakeNode("local", self.arenas, is_local=True, put_tier=DEVICE)
        self.view = CacheView(G, self.node, FakeDirectory(), FakePeers({}),
                              LocalSlabs(self.node, G), transport=FakeTransport({}))
        config = CacheConfig(page_tokens=PAGE_TOKENS, disk_dir="/tmp", put_lease_bytes=0)
        self.client = KVClient(SPEC, "default", config, FakeDirectory(), self.node)
        self.client.view = self.view

    def put(self, tokens: list[int], kv: torch.Tensor) -> int:
        return drive(self.client._put(tokens, kv))

    def drop(self, tokens: list[int]) -> None:
        """The node evicts the pages of `tokens` and gives their chunks back."""
        for key in page_keys(SPEC, "default", PAGE_TOKENS, tokens):
            tier, slot = self.node.pages.pop(key)
            self.arenas[tier].free(slot)
        self.arenas[DEVICE].slots.release_empty()

    def close(self) -> None:
        for arena in self.arenas:
            arena.close()


def kv_of(value: float, num_pages: int = 1) -> torch.Tensor:
    return torch.full((2, 2, 2, num_pages * PAGE_TOKENS, 16), value)


def node_page(world: World, tokens: list[int]) -> torch.Tensor:
    tier, slot = world.node.pages[page_keys(SPEC, "default", PAGE_TOKENS, tokens)[0]]
    return world.arenas[tier].view(slot)[: G.page_bytes].view(torch.float32)


def test_a_put_after_a_release_and_regrant_remaps_and_never_writes_the_old_allocation(prefix):
    world = World(prefix)
    first, second = list(range(PAGE_TOKENS)), list(range(100, 100 + PAGE_TOKENS))
    assert world.put(first, kv_of(1.0)) == PAGE_TOKENS
    old = world.view.slabs.page(DEVICE, 0)  # the client's view of chunk 0's first allocation
    world.drop(first)
    assert world.put(second, kv_of(2.0)) == PAGE_TOKENS  # slot 0 again: chunk 0 granted again
    assert world.node.calls.count("descriptors") == 2  # the reply's stamp said: map again
    assert torch.equal(node_page(world, second), torch.full((G.page_bytes // 4,), 2.0))
    assert torch.equal(old, kv_of(1.0).reshape(G.shape))  # nothing went through the old one
    world.close()


def test_a_chunk_granted_after_the_client_mapped_is_mapped_before_the_copy(prefix):
    world = World(prefix)
    assert world.put(list(range(PAGE_TOKENS)), kv_of(1.0)) == PAGE_TOKENS
    tokens = list(range(200, 200 + PAGE_TOKENS))
    assert world.put(tokens, kv_of(3.0)) == PAGE_TOKENS  # slot 1: chunk 1, granted now
    assert torch.equal(node_page(world, tokens), torch.full((G.page_bytes // 4,), 3.0))
    world.close()


def test_a_put_into_chunks_the_client_cannot_map_lands_in_host_memory(prefix, monkeypatch):
    """VRAM chunks on a GPU this process does not see (a worker shown one of the node's GPUs):
    the device reservation goes back and the pages are reserved, written and committed in
    host memory instead; nothing raises and nothing is lost."""
    world = World(prefix)
    monkeypatch.setattr(DeviceMaps, "_open", lambda self, handle: None)
    tokens = list(range(2 * PAGE_TOKENS))
    assert world.put(tokens, kv_of(1.0, 2)) == 2 * PAGE_TOKENS
    calls = world.node.calls
    assert calls[calls.index("abort") + 1:] == ["reserve", "commit"]
    assert world.arenas[DEVICE].slots.num_used == 0
    assert world.arenas[HOST].slots.num_used == 2
    assert world.view.counters["unmapped_pages"] == 1
    num_tokens, out = drive(world.client._get(tokens, None))
    assert num_tokens == 2 * PAGE_TOKENS and torch.equal(out, kv_of(1.0, 2))
    world.close()


def test_a_page_in_a_chunk_the_client_cannot_map_is_a_get_miss(prefix, monkeypatch):
    world = World(prefix)
    tokens = list(range(2 * PAGE_TOKENS))
    assert world.put(tokens, kv_of(1.0, 2)) == 2 * PAGE_TOKENS
    world.view.slabs.forget(page_keys(SPEC, "default", PAGE_TOKENS, tokens))
    opened = DeviceMaps._open
    monkeypatch.setattr(DeviceMaps, "_open",
                        lambda self, h: None if h.chunk == 1 else opened(self, h))
    world.arenas[DEVICE].free(world.arenas[DEVICE].alloc())  # the layout moves on: remap
    world.view.slabs.epoch = None  # and this client maps afresh, under the patch
    num_tokens, out = drive(world.client._get(tokens, None))
    assert num_tokens == PAGE_TOKENS  # page 0 (chunk 0); page 1's chunk is not mapped here
    assert torch.equal(out, kv_of(1.0))
    assert world.view.counters["unmapped_pages"] == 1
    world.close()


def test_cuda_chunks_on_a_gpu_this_process_does_not_see_are_not_mapped(monkeypatch):
    """A descriptor names GPUs by UUID: this process maps only the chunks on GPUs it sees
    (here none; opening a handle on a seen GPU needs cupy and is tested by make gpu-check)."""
    import cluster.core.tiers.device_chunks as device_chunks

    monkeypatch.setattr(device_chunks, "local_gpu_uuids", lambda: ["GPU-bbbb"])
    handles = tuple(ChunkHandle(c, c + 1, c * 8192, 8192, uuid, ipc_handle=b"\0" * 64)
                    for c, uuid in enumerate(["GPU-aaaa", "GPU-cccc"]))
    maps = DeviceMaps(DeviceLayout(3, 8192, handles))
    assert maps.mapped_chunks == {} and maps.view(0, 4096) is None and maps.view(8192, 4096) \
        is None
