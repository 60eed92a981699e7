"""Quotas that hold at their limits (found by an audit of several models and namespaces
sharing a node): a weight or byte figure that is not finite is refused; a lowered max is
given back while the service runs; mins past a tier are cut to it, in proportion, and shown;
a namespace's min holds when a model gives chunks back; a namespace's max holds in the tier
its pages are demoted into; the disk tier's namespace guard counts disk slots. NodeStore on
tiny tiers; pure asyncio, no Ray."""

from __future__ import annotations

import asyncio

import pytest
from typer.testing import CliRunner

import cluster
from cluster import api
from cluster.core.elastic import guarded_victims
from cluster.core.geometry import DISK, HOST
from cluster.core.registry import Registry
from cluster.core.spec import ModelSpec
from cluster.tools.cli import app
from policies.quota import Quota, fitted_mins
from tests.unit._pages import DISK_SLOT_BYTES, PAGE_BYTES
from tests.unit._pool_harness import run
from tests.unit.test_elastic import LARGE, SMALL, elastic_store, held, key, put

P = PAGE_BYTES


def words(output: str) -> str:
    return " ".join(output.replace("│", " ").split())


def host_tier(store) -> dict:
    return store.stats()["memory"]["tiers"]["host"]


# ---- A: figures that are not finite ----------------------------------------------------------


@pytest.mark.parametrize("figure", ["weight", "min_bytes", "max_bytes"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_quota_figure_that_is_not_finite_is_refused(figure, value):
    with pytest.raises(ValueError, match=f"{figure} must be a finite number"):
        Quota(**{figure: value})


def test_a_negative_byte_figure_or_weight_is_refused():
    for bad in ({"min_bytes": -1}, {"max_bytes": -1}, {"weight": 0}, {"weight": -1}):
        with pytest.raises(ValueError):
            Quota(**bad)
    assert Quota(min_bytes=4, max_bytes=8, weight=0.5).weight == 0.5  # good ones still are


def test_models_sharing_a_geometry_cannot_add_up_to_a_weight_past_finite():
    registry = Registry(16)
    registry.register_model(ModelSpec("a", 2, 2, 16, "float32"), Quota(weight=1e308))
    with pytest.raises(ValueError, match="weight must be a finite number"):
        registry.register_model(ModelSpec("b", 2, 2, 16, "float32"), Quota(weight=1e308))
    assert sorted(registry.models) == ["a"] and registry.version == 1  # as it was


@pytest.mark.parametrize("command", [["quota", "namespace", "t"],
                                     ["quota", "model", "llama-3.1-8b"]], ids=" ".join)
@pytest.mark.parametrize("weight", ["nan", "inf", "-1"])
def test_the_cli_refuses_a_weight_that_is_not_finite_before_any_service(monkeypatch, command,
                                                                        weight):
    calls = []

    def service(*args, **kwargs):
        calls.append(args)
        raise ConnectionError("no Ray here")

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # never another run's Ray
    for name in ("add_namespace", "register_model"):
        monkeypatch.setattr(api, name, service)
        monkeypatch.setattr(cluster, name, service, raising=False)
    result = CliRunner().invoke(app, [*command, "--weight", weight], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "weight" in words(result.output) and "Traceback" not in result.output
    assert calls == []


# ---- B: a lowered max ----------------------------------------------------------------------


def test_a_lowered_max_is_given_back_on_the_node_loop(stores):
    store = elastic_store(stores)
    put(store, SMALL, range(16))

    async def lower() -> None:  # as the node actor applies a registry push: on its loop
        store.set_quotas({SMALL.name: Quota(max_bytes=4 * P)}, {})
        for _ in range(200):
            if held(store)[SMALL.name] <= 4 * P:
                return
            await asyncio.sleep(0.01)

    run(lower())
    assert held(store) == {SMALL.name: 4 * P}
    assert host_tier(store)["over_max_bytes"] == {}
    assert store.stats()["memory"]["max_released_chunks"] == 6


def test_a_lowered_max_is_given_back_before_the_next_put(stores):
    store = elastic_store(stores)
    put(store, SMALL, range(16))
    store.set_quotas({SMALL.name: Quota(max_bytes=4 * P)}, {})  # no loop running here
    assert put(store, SMALL, range(16, 24)) == 4  # what fits under the new max
    assert held(store) == {SMALL.name: 4 * P}
    pool = store.pool(SMALL)
    assert sorted(pool.slots(HOST)._used) == sorted(e.slot for e in pool.index.values())


def test_a_lowered_max_held_by_pinned_pages_takes_nothing_until_they_go(stores):
    store = elastic_store(stores, host_pages=32)
    put(store, SMALL, range(16))
    lease_id, located = run(store.acquire(SMALL, [key("s", i) for i in range(16)]))
    assert len(located) == 16  # a reader holds every page: no chunk can go now
    store.set_quotas({SMALL.name: Quota(max_bytes=4 * P)}, {})
    run(store.shrink_idle(idle_s=3600))  # the node's tick tries again
    assert held(store) == {SMALL.name: 16 * P}
    assert host_tier(store)["over_max_bytes"] == {SMALL.name: 12 * P}
    assert put(store, SMALL, range(16, 18)) == 0  # the tier has room, but no chunk is taken
    assert held(store) == {SMALL.name: 16 * P}
    store.release(lease_id)
    run(store.shrink_idle(idle_s=3600))  # the next tick gives the excess back
    assert held(store) == {SMALL.name: 4 * P}
    assert host_tier(store)["over_max_bytes"] == {}


# ---- C: mins a tier cannot give ------------------------------------------------------------


def test_mins_fit_or_are_cut_in_proportion():
    assert fitted_mins({"a": 4, "b": 8}, 16) == {"a": 4, "b": 8}  # mins that fit: as given
    assert fitted_mins({"a": 12, "b": 12}, 16) == {"a": 8, "b": 8}
    assert fitted_mins({"a": 1000, "b": 0}, 16) == {"a": 16, "b": 0}
    assert fitted_mins({"a": 3, "b": 1}, 2) == {"a": 1, "b": 0}  # never more than the tier
    assert fitted_mins({"a": 5}, 0) == {"a": 0}


def test_mins_past_the_tier_are_cut_in_proportion_and_shown(stores):
    store = elastic_store(stores, small=Quota(min_bytes=12 * P), large=Quota(min_bytes=12 * P))
    put(store, SMALL, range(16))
    put(store, LARGE, range(8))
    assert held(store) == {SMALL.name: 8 * P, LARGE.name: 8 * P}  # 8 of 16 pages each
    assert host_tier(store)["min_shortfall_bytes"] == {
        "models": {SMALL.name: 4 * P, LARGE.name: 4 * P}, "namespaces": {}}


def test_a_min_past_the_tier_is_cut_to_it_and_shown(stores):
    store = elastic_store(stores, small=Quota(min_bytes=1000 * P),
                          namespaces={"y": Quota(min_bytes=40 * P)})
    assert host_tier(store)["min_shortfall_bytes"] == {
        "models": {SMALL.name: 984 * P}, "namespaces": {"y": 24 * P}}
    # the device tier is absent (capacity 0): no min is short there
    assert store.stats()["memory"]["tiers"]["device"]["min_shortfall_bytes"] == {
        "models": {}, "namespaces": {}}


# ---- D: a namespace's min when a model gives chunks back ----------------------------------


def test_a_namespace_min_is_kept_when_a_model_gives_chunks_to_another(stores):
    store = elastic_store(stores, namespaces={"y": Quota(min_bytes=8 * P), "z": Quota()})
    put(store, SMALL, range(8), "y")  # the small model's first chunks: y's pages
    put(store, SMALL, range(8, 16), "z")
    assert put(store, LARGE, range(4), "x") == 4  # 4 chunks taken from the small model
    usage = store.elastic.namespace_bytes(HOST)
    assert usage["y"] == 8 * P  # y's chunks were not given: z's were
    assert usage.get("z", 0) == 0 and held(store) == {SMALL.name: 8 * P, LARGE.name: 8 * P}


def test_chunks_a_namespace_min_holds_are_not_releasable(stores):
    store = elastic_store(stores, namespaces={"y": Quota(min_bytes=16 * P)})
    assert put(store, SMALL, range(16), "y") == 16
    small = next(h for h in store.elastic.holdings(HOST) if h.holder == SMALL.name)
    assert not small.releasable
    put(store, LARGE, range(4), "x")
    assert store.elastic.namespace_bytes(HOST)["y"] == 16 * P


def test_an_idle_model_keeps_a_namespace_min(stores):
    store = elastic_store(stores, namespaces={"y": Quota(min_bytes=4 * P)})
    put(store, SMALL, range(8), "y")
    store.pool(SMALL).last_access_s -= 10
    assert run(store.shrink_idle(idle_s=5)) == 2  # 4 chunks held: 2 go, 2 hold y's min
    assert store.elastic.namespace_bytes(HOST)["y"] == 4 * P


# ---- E: a namespace's max in the tier its pages are demoted into --------------------------


def test_a_namespace_max_holds_in_the_tier_its_pages_are_demoted_into(stores):
    store = elastic_store(stores, disk_pages=32, namespaces={"x": Quota(max_bytes=2 * P)})
    for i in range(0, 10, 2):
        assert put(store, SMALL, range(i, i + 2), "x") == 2
    usage = {tier: store.elastic.namespace_bytes(tier).get("x", 0) for tier in (HOST, DISK)}
    assert usage[HOST] == 2 * P
    assert usage[DISK] == DISK_SLOT_BYTES  # one disk slot (4 KiB header + page) fits in 2P
    pool = store.pool(SMALL)
    assert pool.ns_pages[(DISK, "x")] == 1 and pool.slots(DISK).num_used == 1


def test_a_namespace_max_holds_in_every_tier_its_pages_move_down_through(stores):
    # x may hold 2 disk slots' worth per tier: 3 pages in device, 3 in host, 2 on disk. Pages
    # demoted out of device into a host at x's max push x's own coldest host pages on down
    store = stores.make(stores.config(device_pages=4, host_pages=4, disk_pages=8))
    store.set_quotas({}, {"x": Quota(max_bytes=2 * DISK_SLOT_BYTES)})
    pool = store.pool(SMALL)
    for i in range(0, 8, 2):
        assert put(store, SMALL, range(i, i + 2), "x") == 2
    usage = {tier: store.elastic.namespace_bytes(tier).get("x", 0) for tier in range(3)}
    assert usage == {0: 3 * P, HOST: 3 * P, DISK: 2 * DISK_SLOT_BYTES}
    assert len(pool.index) == 8  # none dropped while a tier below had room under the max


# ---- the disk tier's namespace guard -------------------------------------------------------


def test_the_namespace_guard_counts_disk_pages_in_disk_slots(stores):
    # y's min is 2 pages' worth (16 KiB); on disk it holds 2 slots (24 KiB): giving one
    # would leave 12 KiB, under its min, though a memory slot (8 KiB) less would not
    store = elastic_store(stores, host_pages=8, disk_pages=8,
                          namespaces={"y": Quota(min_bytes=2 * P), "x": Quota()})
    put(store, SMALL, range(2), "y")
    put(store, SMALL, range(10, 14), "x")
    pool = store.pool(SMALL)
    run(pool.demote([k for k, e in pool.index.items() if e.tier == HOST], HOST))
    assert store.elastic.namespace_bytes(DISK) == {"y": 2 * DISK_SLOT_BYTES,
                                                   "x": 4 * DISK_SLOT_BYTES}
    victims = guarded_victims(pool, DISK, 6, "x")
    assert {pool.index[k].namespace for k in victims} == {"x"} and len(victims) == 4
    run(pool.make_room(DISK, 8, "x"))
    assert store.elastic.namespace_bytes(DISK)["y"] == 2 * DISK_SLOT_BYTES
