"""raykv's direct-streaming vLLM app, its pure parts: the router's decision as HAProxy request
headers and back into the body, the replica's key check (as ASGI), and the router counting a
pick-only caller's picks as in flight until they expire."""

from __future__ import annotations

import asyncio
import json

from hypothesis import given
from hypothesis import strategies as st

from cluster.serving.access import Access, key_digest
from cluster.serving.router import RaykvRouter
from cluster.serving.vllm_direct import (
    CUT_HEADER,
    HIT_HEADER,
    ROUTER_HEADER_PREFIX,
    DirectMiddleware,
    capped_body,
    refusal,
    route_caller_allowed,
    route_headers,
    routed_params,
    with_routed_params,
)
from cluster.serving.vllm_plan import FETCH_LIMIT_KEY, HIT_KEY, fetch_limit, routed_hit
from tests.unit.test_engine_routing import PAGE as ENGINE_PAGE
from tests.unit.test_engine_routing import SPEC, Follower, advertise_events, request
from tests.unit.test_routing import (
    AsyncFakeDirectory,
    DeploymentHandleSource,
    DeploymentID,
    PublishingReplica,
    ids,
)


def test_the_headers_sit_under_serve_s_router_prefix_which_haproxy_strips_from_clients():
    from ray.serve._private.constants import SERVE_INGRESS_ROUTER_HEADER_PREFIX

    assert ROUTER_HEADER_PREFIX == SERVE_INGRESS_ROUTER_HEADER_PREFIX
    assert HIT_HEADER.startswith(ROUTER_HEADER_PREFIX)
    assert CUT_HEADER.startswith(ROUTER_HEADER_PREFIX)


@given(st.none() | st.integers(0, 1 << 20), st.none() | st.integers(0, 1 << 20))
def test_the_router_s_hit_and_cut_reach_the_connector_through_headers(hit, cut):
    params = {"other": "kept"}
    if hit is not None:
        params[HIT_KEY] = hit
    if cut is not None:
        params[FETCH_LIMIT_KEY] = cut
    headers = route_headers(params)
    assert all(isinstance(v, str) and '"' not in v for v in headers.values())  # HAProxy's Lua
    body = json.dumps({"prompt": "hi", "kv_transfer_params": {"client": 1}}).encode()
    merged = with_routed_params(body, routed_params(headers)) if headers else body
    carried = json.loads(merged)["kv_transfer_params"]
    assert routed_hit(carried) == hit
    assert fetch_limit(carried) == cut
    assert carried["client"] == 1


@given(st.sampled_from([None, "x", -1, True, 1.5, [3]]))
def test_odd_params_make_no_header(value):
    assert route_headers({HIT_KEY: value, FETCH_LIMIT_KEY: value}) == {}
    assert route_headers(value) == {}


def test_odd_headers_and_bodies_are_left_alone():
    assert routed_params({HIT_HEADER: "-3", CUT_HEADER: "x"}) == {}
    assert with_routed_params(b"not json", {HIT_KEY: 1}) is None
    assert with_routed_params(b"[1, 2]", {HIT_KEY: 1}) is None
    # A client's own cut under the router's key is replaced by the router's.
    body = json.dumps({"prompt": "p", "kv_transfer_params": {FETCH_LIMIT_KEY: 999}}).encode()
    merged = json.loads(with_routed_params(body, {FETCH_LIMIT_KEY: 32}))
    assert merged["kv_transfer_params"][FETCH_LIMIT_KEY] == 32


KEYS = {"tenant-key": "default", "other-key": "other"}
ACCESS = Access.of(KEYS)


def test_refusals_follow_the_ingress_s_rules():
    assert refusal(ACCESS, "default", None)[0] == 401
    assert refusal(ACCESS, "default", "Bearer wrong")[0] == 401
    assert refusal(ACCESS, "default", "Bearer other-key")[0] == 403
    assert refusal(ACCESS, "default", "Bearer tenant-key") is None
    assert refusal(Access(), "default", None) is None  # keyless: loopback only (elsewhere)
    assert ACCESS.key_digests[key_digest("tenant-key")] == "default"


async def _call(path: str, headers: dict, body: bytes = b"", method="POST"):
    """Run one request through `middleware`; (status, what the app received or None)."""
    seen = {}

    async def app(scope, receive, send):
        message = await receive()
        seen["body"] = message.get("body", b"")
        seen["headers"] = dict(scope["headers"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sent = []

    async def send(message):
        sent.append(message)

    chunks = [body[:5], body[5:]]

    async def receive():
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    scope = {"type": "http", "method": method, "path": path,
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    await DirectMiddleware(app, access=ACCESS, namespace="default")(scope, receive, send)
    return sent[0]["status"], seen or None


def test_the_replica_refuses_a_request_without_its_key_before_the_engine_sees_it():
    async def main():
        body = json.dumps({"prompt": "p"}).encode()
        status, seen = await _call("/v1/completions", {}, body)
        assert (status, seen) == (401, None)
        status, seen = await _call("/v1/models", {"authorization": "Bearer x"},
                                   method="GET")
        assert (status, seen) == (401, None)
        status, seen = await _call("/v1/completions",
                                   {"authorization": "Bearer other-key"}, body)
        assert (status, seen) == (403, None)
        status, seen = await _call("/-/healthz", {}, method="GET")
        assert status == 200

    asyncio.run(main())


def test_a_keyed_request_reaches_the_engine_with_the_router_s_decision_in_its_body():
    async def main():
        body = json.dumps({"prompt": "p" * 40, "max_tokens": 1}).encode()
        headers = {"authorization": "Bearer tenant-key", HIT_HEADER: "64", CUT_HEADER: "32",
                   "content-length": str(len(body))}
        status, seen = await _call("/v1/completions", headers, body)
        assert status == 200
        received = json.loads(seen["body"])
        assert received["kv_transfer_params"] == {HIT_KEY: 64, FETCH_LIMIT_KEY: 32}
        assert received["prompt"] == "p" * 40
        assert seen["headers"][b"content-length"] == str(len(seen["body"])).encode()
        # Without the router's headers the body goes through untouched.
        plain = {"authorization": "Bearer tenant-key"}
        status, seen = await _call("/v1/completions", plain, body)
        assert (status, seen["body"]) == (200, body[:5])  # streamed on, not buffered

    asyncio.run(main())


def test_a_routed_body_over_the_limit_is_refused_not_buffered():
    async def main():
        small = Access(ACCESS.key_digests, max_request_bytes=64)
        body = json.dumps({"prompt": "p" * 200}).encode()
        headers = {"authorization": "Bearer tenant-key", HIT_HEADER: "64"}
        chunks = [body[i:i + 16] for i in range(0, len(body), 16)]
        sent, reached = [], []

        async def receive():
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

        async def send(message):
            sent.append(message)

        async def app(scope, receive, send):
            reached.append(scope)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
        await DirectMiddleware(app, access=small, namespace="default")(scope, receive, send)
        assert sent[0]["status"] == 413 and not reached
        assert len(chunks) > 5  # it stopped reading once past the limit

    asyncio.run(main())


def test_only_ray_nodes_may_ask_for_a_route():
    nodes = {"10.0.0.5", "10.0.0.6"}
    assert route_caller_allowed("10.0.0.5", nodes)
    assert route_caller_allowed("127.0.0.1", nodes) and route_caller_allowed("::1", nodes)
    assert not route_caller_allowed("10.0.0.7", nodes)
    assert not route_caller_allowed("203.0.113.9", nodes)
    assert not route_caller_allowed(None, nodes) and not route_caller_allowed("", nodes)


def test_the_route_reads_at_most_its_limit_of_a_body():
    from starlette.requests import Request

    def request(body: bytes, declared: int | None = None) -> Request:
        chunks = [body[i:i + 10] for i in range(0, len(body), 10)] or [b""]

        async def receive():
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

        headers = [] if declared is None else [(b"content-length", str(declared).encode())]
        return Request({"type": "http", "method": "POST", "path": "/internal/route",
                        "headers": headers}, receive)

    async def main():
        assert await capped_body(request(b"x" * 50), 64) == b"x" * 50
        assert await capped_body(request(b"x" * 100), 64) is None
        assert await capped_body(request(b"x" * 10, declared=10_000), 64) is None
        assert await capped_body(request(b""), 64) == b""

    asyncio.run(main())


def _pick_only_router(follower):
    router = RaykvRouter(deployment_id=DeploymentID(name="engine", app_name="raykv"),
                         handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(directory=AsyncFakeDirectory(), engine_events=follower,
                            prompt_keys={"tokenizer_dir": "/unused", "spec": SPEC,
                                         "namespace": "default", "page_tokens": ENGINE_PAGE},
                            picks_expire=True)
    replicas = [PublishingReplica(f"r{i}", node_id=f"node-{i}") for i in range(3)]
    for replica in replicas:
        replica.routing_stats = {}
    advertise_events(replicas, ("r0", "r1", "r2"))
    router.update_replicas(replicas)
    return router, replicas


def test_a_pick_only_caller_s_pick_counts_as_in_flight_until_its_estimate_passes():
    """Direct streaming only picks (Serve never reports the end): the router counts its own
    pick, so the next request sees the chosen replica busy, and the count expires after the
    chosen replica's estimated TTFT."""
    async def main():
        follower = Follower()
        router, replicas = _pick_only_router(follower)
        follower.store("r2", 4 * ENGINE_PAGE)
        assert ids(await router.choose_replicas(replicas, request()))[0] == ["r2"]
        assert router.in_flight["r2"] == 1
        hold_s = router.last_decision.chosen.ttft_s  # the pick's estimated TTFT
        assert hold_s is not None and hold_s > 0
        # Busy: the next request with the same prefix goes elsewhere.
        assert ids(await router.choose_replicas(replicas, request()))[0] != ["r2"]
        await asyncio.sleep(hold_s * 1.5 + 0.05)
        assert router.in_flight["r2"] == 0
        assert sum(router.in_flight.values()) == 0  # the second pick expired too

    asyncio.run(main())


def test_without_picks_expire_the_router_counts_nothing_itself():
    async def main():
        follower = Follower()
        router, replicas = _pick_only_router(follower)
        router.picks_expire = False
        follower.store("r2", 4 * ENGINE_PAGE)
        await router.choose_replicas(replicas, request())
        assert sum(router.in_flight.values()) == 0

    asyncio.run(main())
