"""Models and namespaces registered while the service runs, with quotas, on a local Ray: one
elastic budget per tier shared by two models, an idle model shrinking, and the CLI verb."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from cluster import ModelSpec, Quota, add_namespace, connect, quotas, register_model
from cluster.core.geometry import PageGeometry
from cluster.tools.cli import app
from tests.kv import kv_for
from tests.waiting import wait_until

A = ModelSpec("model-a", 2, 2, 16, "float32")  # 8 KiB pages of 16 tokens
B = ModelSpec("model-b", 2, 2, 32, "float32")  # 16 KiB pages
PAGE = 8192
GA, GB = (PageGeometry.of(spec, 16).name for spec in (A, B))  # the models' pools


def node_memory(client) -> dict:
    return client.stats()["node"]["memory"]["tiers"]["host"]


def fill(client, spec: ModelSpec, first: int, num_prompts: int) -> None:
    for index in range(first, first + num_prompts):
        client.put(list(range(index * 32, index * 32 + 32)), kv_for(spec, 32, index))


def test_a_namespace_added_at_run_time_can_be_used_at_once(service):
    service(device_bytes=0)
    with pytest.raises(ValueError, match="unknown namespace 'late-tenant'"):
        connect(A, namespace="late-tenant")
    registry = add_namespace("late-tenant", Quota(max_bytes=4 * PAGE))
    assert registry["namespaces"]["late-tenant"]["max_bytes"] == 4 * PAGE
    client = connect(A, namespace="late-tenant")
    fill(client, A, 0, 4)  # 8 pages asked, 4 allowed: it evicts its own
    assert node_memory(client)["namespaces"]["late-tenant"] == 4 * PAGE
    with pytest.raises(ValueError, match="namespace"):
        add_namespace("")
    with pytest.raises(TypeError):
        add_namespace("x", quota="a lot")


def test_two_models_share_one_budget_by_weight(service):
    service(device_bytes=0, host_bytes=32 * PAGE, disk_bytes=0, chunk_bytes=4 * PAGE)
    register_model(A, Quota(weight=1))
    register_model(B, Quota(weight=3))
    a, b = connect(A), connect(B)
    fill(a, A, 0, 16)  # A alone takes all 32 pages of the host tier
    assert node_memory(a)["models"] == {GA: 32 * PAGE}
    fill(b, B, 100, 16)  # B wants more: it takes A's chunks back, up to its weighted share
    held = node_memory(a)["models"]
    assert held == {GA: 8 * PAGE, GB: 24 * PAGE}
    assert a.stats()["node"]["models"] == {"model-a": 8 * PAGE, "model-b": 24 * PAGE}
    assert a.lookup(list(range(15 * 32, 16 * 32))) == 32  # A's newest pages are still there
    registry = quotas()
    assert registry["models"]["model-b"]["weight"] == 3
    with pytest.raises(ValueError, match="another geometry"):
        register_model(ModelSpec("model-a", 4, 2, 16, "float32"))


def test_connect_refuses_a_registered_name_with_another_geometry_and_a_page_no_tier_holds(
        service):
    """A spec whose name is registered with another geometry would get a pool of its own,
    outside the model's quota, whose pages the model never sees; a page larger than every
    tier would make every put store nothing. Both are refused at connect."""
    service(device_bytes=0, host_bytes=32 * PAGE, disk_bytes=0, chunk_bytes=4 * PAGE)
    connect(A)
    for other in (ModelSpec("model-a", 4, 2, 16, "float32"),
                  ModelSpec("model-a", 2, 2, 16, "bfloat16")):
        with pytest.raises(ValueError, match="registered with another geometry"):
            connect(other)
    huge = ModelSpec("model-huge", 64, 8, 128, "float32")  # 4 MiB pages, 256 KiB of host
    with pytest.raises(ValueError, match="more than any tier of this node holds"):
        connect(huge)
    client = connect(A)
    assert client.lookup(list(range(32))) == 0  # the service is as it was


def test_an_idle_model_gives_its_memory_back(service):
    service(device_bytes=0, host_bytes=32 * PAGE, disk_bytes=1 << 20, chunk_bytes=4 * PAGE,
            idle_shrink_s=1.0)
    register_model(A, Quota(min_bytes=4 * PAGE))
    client = connect(A)
    fill(client, A, 0, 8)
    # 16 pages, the free slots the client leases ahead of its next put (twice its put, and
    # a put more each time back-to-back puts found the lease dry, within a quarter of the
    # tier: 4 to 8; spare room, taken back first when the model gives memory back), in
    # whole chunks, and what the node readied ahead for the next put (if it had the time).
    # The lease is topped up in the background, with the last put's commit, and asked again
    # when the node had too few slots readied: on a loaded machine it may come after the
    # put returns.
    wait_until(lambda: client.stats()["node"]["leased_slots"] >= 4, 10,
               "the client's lease topped up to 4 slots or more")
    node = client.stats()["node"]
    leased, held = node["leased_slots"], node["memory"]["tiers"]["host"]["models"][GA]
    assert 4 <= leased <= 8 and held % (4 * PAGE) == 0
    # Whole chunks of 4 pages: 16 + 6 leased slots take 24 pages' chunks (CI on b177b3c
    # held 32 with 6 leased, against a bound of 30 that forgot the rounding).
    in_chunks = -(-(16 + leased) // 4) * 4
    assert in_chunks * PAGE <= held <= (in_chunks + 8) * PAGE
    deadline_s = time.monotonic() + 10
    while node_memory(client)["models"].get(GA) != 4 * PAGE:
        assert time.monotonic() < deadline_s, node_memory(client)
        time.sleep(0.2)
    assert client.get(list(range(32)))[0] == 32  # demoted to disk, not lost


def test_the_quota_cli(service):
    service()
    runner = CliRunner()
    result = runner.invoke(app, ["quota", "model", "tiny-llama", "--min", "64KiB", "--max",
                                 "1MiB", "--weight", "2"])
    assert result.exit_code == 0, result.output
    assert "tiny-llama" in result.output and "64.0 KiB" in result.output
    result = runner.invoke(app, ["quota", "namespace", "cli-tenant", "--max", "256KiB"])
    assert result.exit_code == 0 and "cli-tenant" in result.output
    shown = runner.invoke(app, ["quota", "show", "--json"])
    assert '"cli-tenant"' in shown.output and '"tiny-llama"' in shown.output
    unknown = runner.invoke(app, ["quota", "model", "gpt-17"])
    assert unknown.exit_code == 2 and "unknown model" in unknown.output
    bad = runner.invoke(app, ["quota", "namespace", "x", "--min", "2MiB", "--max", "1MiB"])
    assert bad.exit_code == 2 and "below min_bytes" in bad.output
