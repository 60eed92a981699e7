"""The vLLM app's HTTP is behind raykv's API keys (issue 17, finding 3): Ray Serve LLM's own
ingress takes none, so without this any caller reaching a non-loopback bind could use the
engines and read cached_tokens. No engine here: the rules, the routes and the app's wiring."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS
from starlette.requests import Request

from cluster.serving import vllm_ingress
from cluster.serving.access import Access, KeysRequired
from cluster.serving.vllm_app import VllmAppArgs, keyed_ingress
from cluster.serving.vllm_ingress import KeyedOpenAiIngress

KEYS = {"key-a": "default", "key-b": "tenant-b"}


def request(authorization: str | None = None) -> Request:
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                    "headers": headers, "query_string": b""})


def ingress(keys: dict[str, str], namespace: str = "default") -> KeyedOpenAiIngress:
    """The ingress's request rules without its engines (no deployment handles needed)."""
    made = object.__new__(KeyedOpenAiIngress)
    made._access, made._namespace = Access.of(keys), namespace
    return made


def test_every_route_of_ray_serve_llms_ingress_checks_the_key():
    for name in DEFAULT_ENDPOINTS:
        method = KeyedOpenAiIngress.__dict__.get(name)
        assert method is not None, f"route {name} is not keyed"
        assert "request" in inspect.signature(method).parameters, name


@pytest.mark.parametrize(("authorization", "status"), [
    (None, 401), ("Bearer wrong", 401), ("Basic key-a", 401), ("Bearer key-b", 403)])
def test_a_request_without_the_apps_key_is_refused(authorization, status):
    refused = ingress(KEYS)._refused(request(authorization))
    assert refused is not None and refused.status_code == status


def test_the_apps_own_key_passes_and_keyless_loopback_needs_none():
    assert ingress(KEYS)._refused(request("Bearer key-a")) is None
    assert ingress({})._refused(request()) is None


def test_a_refused_request_never_reaches_an_engine():
    """The route answers 401 itself: the engines (none here) are never called."""
    reply = asyncio.run(ingress(KEYS).chat(None, request()))
    assert reply.status_code == 401 and b"invalid_api_key" in reply.body


def test_a_replica_refuses_to_start_keyless_on_a_non_loopback_bind(monkeypatch):
    import cluster.serving.ingress as raykv_ingress

    monkeypatch.setattr(raykv_ingress, "serve_bind_host", lambda: "0.0.0.0")
    with pytest.raises(KeysRequired, match="0.0.0.0"):
        KeyedOpenAiIngress({}, {}, key_digests={}, namespace="default")


def replica_app(keys: dict[str, str], max_request_bytes: int = 4096):
    """The replica's app as Serve readies it: the class make_fastapi_ingress builds, set up
    by Serve's own ASGIAppReplicaWrapper.__init__ (the last step of a replica's start)."""
    from ray.llm._internal.serve.core.ingress.ingress import init, make_fastapi_ingress
    from ray.serve._private.http_util import ASGIAppReplicaWrapper

    app = init()
    replica = object.__new__(make_fastapi_ingress(KeyedOpenAiIngress, app=app))
    replica._access = Access.of(keys, max_request_bytes)
    replica._namespace = "default"
    ASGIAppReplicaWrapper.__init__(replica, app)
    return replica.app


def asgi_post(app, headers: dict[str, str], body: bytes) -> tuple[int, int]:
    """(status, receive() calls) of a POST to /v1/completions sent in 1 KiB pieces."""
    pieces = [body[i:i + 1024] for i in range(0, len(body), 1024)] or [b""]
    messages = [{"type": "http.request", "body": piece, "more_body": i < len(pieces) - 1}
                for i, piece in enumerate(pieces)]
    received, statuses = [0], []

    async def receive():
        received[0] += 1
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    scope = {"type": "http", "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "",
             "query_string": b"", "server": ("127.0.0.1", 8000), "client": ("10.0.0.9", 5),
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(app(scope, receive, send))
    return statuses[0], received[0]


@pytest.mark.parametrize(("authorization", "status"), [(None, 401), ("Bearer key-b", 403)])
def test_a_request_without_the_apps_key_is_refused_before_its_body_is_read(authorization,
                                                                            status):
    """FastAPI reads and parses a route's whole body before the route runs: without the
    middleware a caller with no key could send any body, of any size, to be parsed."""
    headers = {"content-type": "application/json", "transfer-encoding": "chunked"}
    if authorization:
        headers["authorization"] = authorization
    assert asgi_post(replica_app(KEYS), headers, b"x" * (64 << 10)) == (status, 0)


def test_the_apps_key_holder_gets_413_for_a_body_over_the_limit():
    headers = {"content-type": "application/json", "authorization": "Bearer key-a"}
    status, received = asgi_post(replica_app(KEYS), {**headers, "transfer-encoding": "chunked"},
                                 b"x" * (64 << 10))
    assert status == 413 and received == 5  # stopped once past 4 KiB
    declared = {**headers, "content-length": str(64 << 10)}
    assert asgi_post(replica_app(KEYS), declared, b"x" * (64 << 10)) == (413, 0)


def test_the_apps_key_holder_reaches_the_routes():
    """Past the middleware: an invalid body gets the route's own validation answer."""
    headers = {"content-type": "application/json", "authorization": "Bearer key-a"}
    status, _ = asgi_post(replica_app(KEYS), headers, b'{"max_tokens": "abc"}')
    assert status not in (401, 403, 413)


def test_the_app_is_built_with_the_keyed_ingress_holding_only_digests(monkeypatch):
    import cluster.serving.ingress as raykv_ingress

    monkeypatch.setattr(raykv_ingress, "serve_bind_host", lambda: None)  # Serve not up yet
    config = keyed_ingress(VllmAppArgs("/models/m", "m", "default", api_keys=KEYS))
    assert config["ingress_cls"] is vllm_ingress.KeyedOpenAiIngress
    extra = config["ingress_extra_kwargs"]
    assert extra["namespace"] == "default" and len(extra["key_digests"]) == 2
    assert extra["max_request_bytes"] == 32 << 20
    assert "key-a" not in repr(extra) and "key-b" not in repr(extra)


def test_the_builder_refuses_a_keyless_app_where_serve_binds_beyond_loopback(monkeypatch):
    import cluster.serving.ingress as raykv_ingress

    monkeypatch.setattr(raykv_ingress, "serve_bind_host", lambda: "0.0.0.0")
    with pytest.raises(KeysRequired):
        keyed_ingress(VllmAppArgs("/models/m", "m", "default", api_keys={}))
