"""The client's call logic (cluster/fetch.py, cluster/client.py) with fake handles: local and
remote pages, and every failure a miss, never an exception or wrong bytes."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from cluster.client import KVClient
from cluster.core.config import CacheConfig
from cluster.core.geometry import HOST, PageGeometry
from cluster.core.keys import page_keys
from cluster.core.spec import ModelSpec
from cluster.core.tiers.memory import ArenaOptions, MappedArena
from cluster.fetch import fetch_prefix, remote_sources
from cluster.slabs import LocalSlabs
from cluster.view import CacheView
from tests.unit._fakes import FakeDirectory, FakeNode, FakePeers, FakeTransport, drive
from tests.unit._pages import unique_prefix

SPEC = ModelSpec("tiny", 2, 2, 16, "float32")
PAGE_TOKENS = 16
G = PageGeometry.of(SPEC, PAGE_TOKENS)
TOKENS = list(range(4 * PAGE_TOKENS + 3))
KEYS = page_keys(SPEC, "default", PAGE_TOKENS, TOKENS)


KV = torch.randn(2, 2, 2, 4 * PAGE_TOKENS, 16, generator=torch.Generator().manual_seed(0))


def page(p: int) -> torch.Tensor:
    return KV[:, :, :, p * PAGE_TOKENS : (p + 1) * PAGE_TOKENS].contiguous()


class World:
    """A local node (real shm arenas), a remote node B, a directory and the view."""

    def __init__(self, num_shards: int = 1):
        prefix = unique_prefix()
        options = ArenaOptions(shm_prefix=prefix)
        self.arenas = [MappedArena(t, 8 * G.slot_bytes, G.slot_bytes, options)
                       for t in ("device", "host")]
        self.local = FakeNode("local", self.arenas, is_local=True)
        self.remote = FakeNode("b")
        self.directory = FakeDirectory(num_shards)
        self.peers = FakePeers({"b": self.remote})
        self.transport = FakeTransport({"b": self.remote})
        self.view = CacheView(G, self.local, self.directory, self.peers,
                              LocalSlabs(self.local, G), transport=self.transport)

    def put_local(self, pages: range) -> None:
        for p in pages:
            slot = self.arenas[HOST].alloc()
            self.arenas[HOST].view(slot)[: G.page_bytes].copy_(page(p).view(-1).view(torch.uint8))
            self.local.pages[KEYS[p]] = (HOST, slot)
        self.directory.place("local", [KEYS[p] for p in pages], HOST)

    def put_remote(self, pages: range) -> None:
        for p in pages:
            self.remote.exported[KEYS[p]] = page(p).view(-1).view(torch.uint8).numpy().copy()
        self.directory.place("b", [KEYS[p] for p in pages], HOST)

    def get(self, before_work=None):
        return drive(fetch_prefix(self.view, KEYS, None), before_work)

    def close(self) -> None:
        for arena in self.arenas:
            arena.close()


@pytest.fixture
def world():
    w = World()
    yield w
    w.close()


def test_remote_sources_skip_this_node_and_stop_at_its_own_pages():
    located = [(("a", 0),), (("local", 1), ("b", 2)), (("local", 0),), (("b", 1),)]
    assert remote_sources(located, 1, "local") == ["b"]
    assert remote_sources(located, 0, "local") == ["a", "b"]
    assert remote_sources(located, 3, None) == ["b"]


def test_all_pages_local(world):
    world.put_local(range(4))
    num_pages, out = world.get()
    assert num_pages == 4 and torch.equal(out, KV)
    assert world.local.calls.count("release") == 0  # the lease rides on the next call
    assert world.view.counters["local_pages"] == 4 and world.view.counters["remote_pages"] == 0
    assert world.transport.reads == []
    world.view.slabs.forget(KEYS)
    world.get()
    assert world.local.released == [7]  # on the second get's acquire
    world.view.flush_touched()
    assert world.local.released == [7, 7]  # or with the touches, the timer's or a flush's


def test_a_prefix_this_node_holds_whole_costs_one_call_and_its_demand_is_told_later(world):
    world.put_local(range(4))
    world.get()  # maps the node's slabs (one more call, once)
    world.view.slabs.forget(KEYS)
    world.local.calls.clear()
    num_pages, out = world.get()
    assert num_pages == 4 and torch.equal(out, KV)
    assert world.local.calls == ["acquire"]
    assert getattr(world.directory, "matches", 0) == 0  # no match on the get's path
    assert getattr(world.directory, "demand", []) == []  # gathered, sent by a timer
    world.view.flush_touched()
    assert world.directory.demand == [KEYS[:4]] * 2  # as the match would have counted them


def test_a_short_acquire_asks_the_directory_after_it_and_the_next_get_asks_both(world):
    world.put_local(range(2))
    world.put_remote(range(4))
    assert world.get()[0] == 4
    assert world.directory.matches == 1 and world.view.early_directory
    world.view.slabs.forget(KEYS)
    world.local.calls.clear()
    assert world.get()[0] == 4  # sent together now (the previous get needed the directory)
    assert world.directory.matches == 2 and world.local.calls[0] == "acquire"
    world.put_local(range(2, 4))  # now the node holds it all: back to the acquire alone
    world.view.slabs.forget(KEYS)
    world.get()
    assert not world.view.early_directory
    world.view.slabs.forget(KEYS)
    world.get()
    assert world.directory.matches == 3
    world.view.flush_touched()
    assert world.directory.demand == [KEYS[:4]]  # only the get that asked no match


def test_a_short_acquire_on_a_single_node_finds_no_more_and_misses_past_it(world):
    world.put_local(range(2))
    num_pages, out = world.get()
    assert num_pages == 2 and torch.equal(out, KV[:, :, :, : 2 * PAGE_TOKENS])
    assert world.directory.matches == 1 and world.transport.reads == []


def test_local_prefix_then_remote_pages_over_the_data_plane_then_pulled_here(world):
    world.put_local(range(2))
    world.put_remote(range(4))
    num_pages, out = world.get()
    assert num_pages == 4 and torch.equal(out, KV)
    assert world.remote.calls == ["dataplane"]  # the endpoint, once; then the data plane
    (read,) = world.transport.reads
    assert read.keys == tuple(KEYS[2:4])
    assert "pull" in world.local.calls  # this node keeps a copy, off the get's path
    assert world.view.counters["remote_pages"] == 2
    world.get()
    assert world.remote.calls == ["dataplane"]  # the endpoint is remembered


def test_reads_are_timed_per_source_for_the_routers_rates(world):
    world.put_local(range(2))
    world.put_remote(range(4))
    world.get()
    noted = {source: (num_bytes, seconds) for source, num_bytes, seconds
             in world.view.transfers}
    assert set(noted) == {"host", "remote"}
    assert noted["host"][0] == noted["remote"][0] == 2 * G.page_bytes
    assert noted["host"][1] > 0 and noted["remote"][1] > 0


def test_local_pages_land_in_any_out_through_numpy_views_or_torch_ones(world):
    """Host slots and a CPU out give numpy byte views (slabs.kv_blocks); an out whose last
    dimension is not contiguous has none, and its copies go through torch: both land."""
    world.put_local(range(4))
    plain = torch.zeros_like(KV)
    pairs, covered = world.view.slabs.kv_blocks(world.view.slabs.hinted(KEYS), plain, 0)
    assert covered == 0 and pairs == []  # nothing noted yet: the get asks the node
    assert drive(fetch_prefix(world.view, KEYS, plain))[0] == 4 and torch.equal(plain, KV)
    places = world.view.slabs.hinted(KEYS)
    pairs, covered = world.view.slabs.kv_blocks(places, plain, 0)
    assert covered == 4 and all(isinstance(dst, np.ndarray) for dst, _ in pairs)
    assert all(np.shares_memory(dst, plain.view(torch.uint8).numpy()) for dst, _ in pairs)
    strided = torch.zeros(tuple(reversed(KV.shape))).permute(4, 3, 2, 1, 0)
    assert strided.stride()[-1] != 1
    pairs, covered = world.view.slabs.kv_blocks(places, strided, 0)
    assert covered == 4 and all(isinstance(dst, torch.Tensor) for dst, _ in pairs)
    world.view.slabs.forget(KEYS)
    assert drive(fetch_prefix(world.view, KEYS, strided))[0] == 4
    assert torch.equal(strided, KV)


def test_a_copy_is_a_rate_sample_only_when_its_pages_sat_in_one_tier(world):
    view = world.view
    view.note_copy([(1, 3, 0), (1, 7, 0)], 0.001)  # two runs of one tier
    view.note_copy([(0, 3, 0), (1, 4, 0)], 0.001)  # two tiers: speeds not told apart
    view.note_copy([(0, 5, 0), (0, 6, 0)], 0.002, num_runs=1)
    view.note_copy([], 0.001)
    assert list(view.transfers) == [("host", 2 * G.page_bytes, 0.001),
                                    ("device", 2 * G.page_bytes, 0.002)]


def test_an_acquire_that_read_pages_up_from_disk_times_the_disk_path(world):
    world.put_local(range(2))
    world.local.on_disk = set(KEYS[:1])  # the node read page 0 up from its disk tier
    world.view.slabs.forget(KEYS)
    world.get()
    (disk,) = [t for t in world.view.transfers if t[0] == "disk"]
    assert disk[1] == G.page_bytes and disk[2] > 0


def test_a_page_of_a_tensor_lands_in_its_rows_and_others_are_staged(world):
    world.put_remote(range(4))
    out = torch.zeros_like(KV)[:, :, :, :, :].transpose(0, 1).contiguous().transpose(0, 1)
    num_pages, got = drive(fetch_prefix(world.view, KEYS, out))
    assert num_pages == 4 and torch.equal(got, KV)  # rows that do not flatten: staged
    plain = torch.zeros_like(KV)
    assert drive(fetch_prefix(world.view, KEYS, plain))[0] == 4 and torch.equal(plain, KV)


def test_a_dead_local_node_leaves_the_remote_pages(world):
    world.put_local(range(4))
    world.put_remote(range(3))
    world.local.fail = {"acquire"}
    num_pages, out = world.get()
    assert num_pages == 3 and torch.equal(out[:, :, :, : 3 * PAGE_TOKENS],
                                          KV[:, :, :, : 3 * PAGE_TOKENS])
    assert world.view.counters["failed_calls"] == 1


def test_a_dead_local_node_with_pages_only_there_is_a_miss(world):
    world.put_local(range(4))
    world.local.fail = {"acquire"}
    assert world.get() == (0, None)


def test_an_acquire_that_answers_past_the_timeout_has_its_lease_let_go(world):
    # The node pinned the prefix for a get that had given up on it: left alone, those pages
    # stayed pinned, beyond eviction, until the lease lapsed (pin_lease_s).
    world.put_local(range(4))
    world.local.fail = {"acquire late"}
    assert world.get() == (0, None)
    assert world.view.counters["failed_calls"] == 1
    world.view.flush_touched()
    assert world.local.released == [7]  # the fake's lease id, sent with the next touch


def test_an_acquire_that_fails_outright_leaves_nothing_to_let_go(world):
    world.put_local(range(4))
    world.local.fail = {"acquire"}
    assert world.get() == (0, None)
    world.view.flush_touched()
    assert getattr(world.local, "released", []) == []


def test_a_dead_directory_leaves_the_local_pages(world):
    world.put_local(range(2))
    world.put_remote(range(4))
    world.directory.failing = {0}
    num_pages, out = world.get()
    assert num_pages == 2 and torch.equal(out[:, :, :, : 2 * PAGE_TOKENS],
                                          KV[:, :, :, : 2 * PAGE_TOKENS])
    assert world.transport.reads == []


def test_a_dead_peer_is_a_miss_and_forgotten(world):
    world.put_local(range(1))
    world.put_remote(range(4))
    world.remote.fail = {"serve"}
    num_pages, _ = world.get()
    assert num_pages == 1
    assert world.peers.forgotten == ["b"]
    assert "pull" not in world.local.calls


def test_a_peer_without_an_endpoint_is_a_miss(world):
    world.put_remote(range(4))
    world.remote.fail = {"dataplane"}
    assert world.get() == (0, None)
    assert world.peers.forgotten == ["b"] and world.transport.reads == []


def test_an_unknown_peer_is_a_miss(world):
    world.put_remote(range(4))
    world.peers.nodes = {}
    assert world.get() == (0, None)


def test_a_slot_reused_during_the_copy_is_a_miss_not_wrong_bytes(world):
    """The lease ran out mid-copy and the node gave slot 1's page's slot to another page."""
    world.put_local(range(3))
    _, slot = world.local.pages[KEYS[1]]
    arena = world.arenas[HOST]

    def reuse_slot():
        if arena.generation(slot) == 0:
            arena.free(slot)  # the page was evicted ...
            assert arena.alloc() == slot  # ... and its slot written with another page
            arena.view(slot).fill_(0x55)

    num_pages, out = world.get(before_work=reuse_slot)
    assert num_pages == 1
    assert torch.equal(out[:, :, :, :PAGE_TOKENS], KV[:, :, :, :PAGE_TOKENS])
    assert world.view.counters["torn_reads"] == 1


def test_a_new_epoch_remaps_the_slabs(world):
    world.put_local(range(2))
    assert world.get()[0] == 2
    world.local.epoch = 2
    world.view.slabs.forget(KEYS)  # no hints: the get asks the node, which has restarted
    assert world.get()[0] == 2
    assert world.local.calls.count("descriptors") == 2
    assert world.view.slabs.epoch == 2


def test_nothing_cached_anywhere(world):
    assert world.get() == (0, None)
    assert world.local.calls == ["acquire"]


# ---- optimistic reads: slots noted by earlier gets, checked by generation ------------------


def waited(calls: list[str]) -> list[str]:
    """The calls a get waits on (a touch is a report sent after the read, fire and forget)."""
    return [call for call in calls if call != "touch"]


def test_a_second_get_of_local_pages_makes_no_call(world):
    world.put_local(range(4))
    world.get()
    calls = waited(world.local.calls)
    num_pages, out = world.get()
    assert num_pages == 4 and torch.equal(out, KV)
    assert waited(world.local.calls) == calls and world.view.counters["optimistic_pages"] == 4


def test_hinted_pages_are_copied_while_the_rest_is_asked_for(world):
    world.put_local(range(2))
    world.get()
    world.put_local(range(2, 3))
    world.put_remote(range(4))
    out = torch.zeros_like(KV)
    num_pages, got = drive(fetch_prefix(world.view, KEYS, out))
    assert num_pages == 4 and torch.equal(got, KV)
    assert world.view.counters["optimistic_pages"] == 2
    assert world.transport.reads[-1].keys == (KEYS[3],)


def test_a_stale_hint_is_a_miss_of_that_slot_and_the_node_is_asked(world):
    world.put_local(range(3))
    world.get()
    _, slot = world.local.pages[KEYS[1]]
    arena = world.arenas[HOST]
    arena.free(slot)  # evicted: the slot's generation moves, the page is written elsewhere
    new_slot = arena.alloc()
    arena.view(new_slot).fill_(0x55)
    fresh = arena.alloc()
    arena.view(fresh)[: G.page_bytes].copy_(page(1).view(-1).view(torch.uint8))
    world.local.pages[KEYS[1]] = (HOST, fresh)
    out = torch.zeros_like(KV)
    num_pages, got = drive(fetch_prefix(world.view, KEYS, out))
    assert num_pages == 3 and torch.equal(got[:, :, :, : 3 * PAGE_TOKENS],
                                          KV[:, :, :, : 3 * PAGE_TOKENS])
    assert world.view.counters["stale_hints"] == 1
    # the first get's, then one from the stale page on: its generation had moved before the
    # get began, so no ask went out for the pages past the hints, and nothing was copied
    assert world.local.calls.count("acquire") == 2


def test_a_hint_gone_stale_during_the_copy_drops_the_ask_and_asks_again(world, monkeypatch):
    import cluster.fetch

    world.put_local(range(3))
    world.get()
    _, slot = world.local.pages[KEYS[1]]
    arena = world.arenas[HOST]
    real_copy = cluster.fetch.copy_pages

    def evicting_copy(pairs):  # page 1 leaves its slot while the get copies it
        real_copy(pairs)
        arena.free(slot)
        fresh = arena.alloc()
        arena.view(fresh)[: G.page_bytes].copy_(page(1).view(-1).view(torch.uint8))
        world.local.pages[KEYS[1]] = (HOST, fresh)
        monkeypatch.setattr(cluster.fetch, "copy_pages", real_copy)

    monkeypatch.setattr(cluster.fetch, "copy_pages", evicting_copy)
    out = torch.zeros_like(KV)
    num_pages, got = drive(fetch_prefix(world.view, KEYS, out))
    assert num_pages == 3 and torch.equal(got[:, :, :, : 3 * PAGE_TOKENS],
                                          KV[:, :, :, : 3 * PAGE_TOKENS])
    assert world.view.counters["stale_hints"] == 1
    assert world.local.calls.count("acquire") == 3  # the first get, one dropped, one used


def test_optimistic_reads_are_reported_to_the_node_in_batches(world, monkeypatch):
    import cluster.touches

    monkeypatch.setattr(cluster.touches, "TOUCH_EVERY_S", 0.0)
    world.put_local(range(4))
    world.get()
    world.get()
    deadline_s = time.monotonic() + 5.0
    while getattr(world.local, "touched", None) != KEYS and time.monotonic() < deadline_s:
        time.sleep(0.002)  # sent by the sender thread, TOUCH_SOON_S after each read
    assert world.local.touched == KEYS


def test_two_shards_one_down_ends_the_prefix_at_its_first_key():
    world = World(num_shards=2)
    try:
        world.put_remote(range(4))
        world.directory.failing = {1}
        from cluster.core.keys import shard_of

        first_down = next(p for p, k in enumerate(KEYS) if shard_of(k, 2) == 1)
        assert world.get()[0] == first_down
    finally:
        world.close()


# ---- the client's put and lookup, on the same fakes --------------------------------------


def client_of(world: World, put_lease_bytes: int = 0) -> KVClient:
    """A client of the world's view; puts reserve and commit unless given slots to lease
    (tests/unit/test_leased_puts.py)."""
    config = CacheConfig(page_tokens=PAGE_TOKENS, disk_dir="/tmp",
                         put_lease_bytes=put_lease_bytes)
    client = KVClient(SPEC, "default", config, world.directory, world.local)
    client.view = world.view
    return client


def test_put_copies_into_reserved_slots_and_commits(world):
    client = client_of(world)
    assert drive(client._put(TOKENS, torch.cat([KV, KV[:, :, :, :3]], dim=3))) == 64
    assert world.local.calls[-1] == "commit"
    calls = len(waited(world.local.calls))
    num_pages, out = drive(fetch_prefix(world.view, KEYS, None))  # read-your-writes, here
    assert num_pages == 4 and torch.equal(out, KV)
    assert len(waited(world.local.calls)) == calls  # from the slots the put noted: no call


@pytest.mark.parametrize("failure, stored", [("reserve", 0), ("commit", 0), ("lapse", 0)])
def test_a_failed_put_stores_nothing_it_reports(world, failure, stored):
    client = client_of(world)
    world.local.fail = {failure}
    kv = torch.cat([KV, KV[:, :, :, :3]], dim=3)
    assert drive(client._put(TOKENS, kv)) == stored
    assert len(world.view.slabs.hinted(KEYS)) == 0


def test_a_lapsed_reservation_reports_only_the_pages_stored_before_it(world):
    world.put_local(range(2))  # pages 0 and 1 are stored already
    client = client_of(world)
    world.local.fail = {"lapse"}
    kv = torch.cat([KV, KV[:, :, :, :3]], dim=3)
    assert drive(client._put(TOKENS, kv)) == 2 * PAGE_TOKENS


def test_bad_input_raises_before_any_call(world):
    client = client_of(world)
    with pytest.raises(ValueError, match="kv holds"):
        drive(client._put(TOKENS, KV))
    with pytest.raises(TypeError, match="integers"):
        drive(client._put([0.5] * 16, KV[:, :, :, :16]))
    assert world.local.calls == []


def test_lookup_counts_whole_pages_and_a_dead_directory_is_zero(world):
    client = client_of(world)
    world.put_remote(range(3))
    assert drive(client._lookup(TOKENS)) == 3 * PAGE_TOKENS
    world.directory.failing = {0}
    assert drive(client._lookup(TOKENS)) == 0


@pytest.mark.parametrize("parallel_min_bytes", [0, 1 << 40])
def test_pages_in_scattered_slots_of_both_tiers_land_in_their_rows(world, monkeypatch,
                                                                  parallel_min_bytes):
    """One copy pass over runs of slots (cut by layers across the copy threads, or not):
    every page in its own place, whichever tier and slot order it was stored in."""
    import cluster.core.copies

    monkeypatch.setattr(cluster.core.copies, "PARALLEL_MIN_BYTES", parallel_min_bytes)
    held = {tier: [world.arenas[tier].alloc() for _ in range(7)] for tier in (0, HOST)}
    layout = {0: (HOST, held[HOST][5]), 1: (HOST, held[HOST][6]), 2: (0, held[0][2]),
              3: (HOST, held[HOST][1])}  # a run of two, then two single pages
    for p, (tier, slot) in layout.items():
        world.arenas[tier].view(slot)[: G.page_bytes].copy_(page(p).view(-1).view(torch.uint8))
        world.local.pages[KEYS[p]] = (tier, slot)
    world.directory.place("local", KEYS[:4], HOST)
    for _ in range(2):  # through the node's acquire, then from the noted slots
        out = torch.zeros_like(KV)
        assert drive(fetch_prefix(world.view, KEYS, out))[0] == 4 and torch.equal(out, KV)
    assert world.view.counters["optimistic_pages"] == 4


def test_a_bounded_client_shares_the_view_and_bounds_only_its_own_calls(world):
    client = client_of(world)
    bounded = client.bounded(0.04)
    assert bounded.timeout_s == 0.04 and client.timeout_s == client.config.call_timeout_s
    assert bounded.view is client.view and bounded.chain is client.chain
    assert bounded.salted(b"t").timeout_s == 0.04  # a salted view keeps the bound
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout_s"):
            client.bounded(bad)
