"""Hypothesis against the running service (cluster/tools/fuzz.py): thousands of client calls
with odd tokens, tensors, buffers, namespaces and geometries. Each is refused with a clear
TypeError/ValueError or works; every page a get returns holds exactly the bytes put for its
prefix; no node actor dies."""

from __future__ import annotations

from cluster import ModelSpec, connect
from cluster.tools.fuzz import run_api_fuzz, run_client_fuzz
from tests.actors.test_isolation import alive_actors

CLIENT_CASES = 2500
API_CASES = 300


def node_actor_pids() -> set[int]:
    return {a["pid"] for a in alive_actors(("NodeCacheActor",))}


def test_the_client_api_refuses_bad_input_and_returns_only_what_was_put(service):
    service(host_bytes=32 * 8192, device_bytes=8 * 8192)  # small tiers: evictions, disk reads
    pids = node_actor_pids()
    client = connect(ModelSpec("fuzz", 2, 2, 8, "float16"))
    assert run_client_fuzz(client, CLIENT_CASES) >= CLIENT_CASES * 0.95
    stats = client.stats()
    assert stats["client"]["put_tokens"] > 0 and stats["client"]["get_tokens"] > 0, stats
    assert node_actor_pids() == pids  # no actor crashed (or was restarted)


def test_connect_refuses_odd_namespaces_and_geometries(service):
    service()
    assert run_api_fuzz(API_CASES) >= API_CASES * 0.95
