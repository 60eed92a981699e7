"""raykv's vLLM app with Ray Serve LLM's direct streaming: HAProxy asks a router deployment
for a replica, then sends the client's request straight to that LLMServer replica's own HTTP
port, and the reply comes straight back (no Serve proxy, no OpenAI ingress on the way).

    from cluster.serving.vllm_app import build_direct_vllm_app
    serve.run(build_direct_vllm_app(args))   # HAProxy on: RAY_SERVE_ENABLE_HA_PROXY=1 and
                                             # RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1
                                             # in the cluster's environment

What differs from `build_vllm_app` (the keyed-ingress app, which stays the default):

- **Who routes.** Ray's direct streaming puts `LLMRouter` in front; raykv puts its own route
  deployment (`RaykvRouteIngress`, vllm_direct_server.py) there, with the same HTTP contract
  (`POST /internal/route` -> host, port, replica id, request headers). It picks the replica
  through the LLMServer deployment's request router, raykv's `RaykvRouter`, which keys the
  body HAProxy forwards, asks the directory and weighs every tier as in the ingress app.
- **Where the router's decision rides.** HAProxy forwards the client's body unchanged, so the
  router cannot put its hit and its fetch-or-recompute cut into the request's
  `kv_transfer_params` as it does behind the ingress. It returns them as request headers
  instead (ROUTE_HEADERS): HAProxy deletes every client-sent header under Serve's router
  prefix (`x-serve-router-`) and then sets the ones /internal/route returned, so a client
  cannot forge them through HAProxy. The replica's middleware (`DirectMiddleware`) writes them
  into the body's `kv_transfer_params` under the keys the connector reads (vllm_plan.HIT_KEY,
  FETCH_LIMIT_KEY). The decision stays the router's, not the replica's: only the router sees
  every replica's cost (its queue, its engine's blocks, its node's tiers), and the cut is
  the cheapest over those; a caller that reaches a replica's port directly and sends such a
  header changes only what its own request loads, under its own keys (as a client's own
  `kv_transfer_params` does behind the ingress).
- **Where the keys are checked.** There is no ingress: each replica's own ASGI app (vLLM's
  OpenAI server) checks the bearer key first (`DirectMiddleware`): 401 without a known key,
  403 for another namespace's key, on every path but the health checks. Direct ingress makes
  each replica's port reachable on its own, so the check has to sit there. A replica refuses
  to start keyless unless Serve's HTTP binds a loopback address, as the ingress does.
- **In-flight counts.** The route deployment only picks (Serve's `_reserve=False`): Serve
  never tells the router when a request it placed ends, so `RaykvRouter` is built with
  `picks_expire` and counts each pick as in flight for the time it estimated (the chosen
  replica's TTFT, or its compute seconds per request without an estimate).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from cluster.serving.access import (
    Access,
    is_loopback,
    replay,
    reply_error,
    reply_too_large,
    require_keys_for_bind,
    scope_headers,
)
from cluster.serving.access import namespace_refusal as refusal
from cluster.serving.vllm_plan import FETCH_LIMIT_KEY, HIT_KEY

# Serve's router-owned header prefix (ray.serve._private.constants.
# SERVE_INGRESS_ROUTER_HEADER_PREFIX): HAProxy strips client-sent headers under it.
ROUTER_HEADER_PREFIX = "x-serve-router-"
HIT_HEADER = ROUTER_HEADER_PREFIX + "raykv-hit"
CUT_HEADER = ROUTER_HEADER_PREFIX + "raykv-cut"
ROUTE_HEADERS = {HIT_HEADER: HIT_KEY, CUT_HEADER: FETCH_LIMIT_KEY}
# Paths a replica answers without a key: health checks (HAProxy's, Serve's, an operator's).
OPEN_PATHS = ("/-/healthz", "/-/routes", "/health")
# The request bodies that reach the engine's connector (OpenAI completions and chat).
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
# What /internal/route reads of a body (HAProxy forwards at most its own buffer of it).
MAX_ROUTE_BODY_BYTES = 1 << 20


def route_headers(kv_transfer_params: Any) -> dict[str, str]:
    """The request headers that carry the router's decision, read off the routing copy's
    `kv_transfer_params` (where RaykvRouter wrote it); {} when it decided nothing."""
    if not isinstance(kv_transfer_params, dict):
        return {}
    out = {}
    for header, key in ROUTE_HEADERS.items():
        value = kv_transfer_params.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            out[header] = str(value)
    return out


def routed_params(headers: dict[str, str]) -> dict[str, int]:
    """The connector's keys from a request's headers (lower-case names); {} without any.
    A value that is not a non-negative int is ignored."""
    out = {}
    for header, key in ROUTE_HEADERS.items():
        value = headers.get(header, "")
        if value.isdigit():
            out[key] = int(value)
    return out


def with_routed_params(body: bytes, params: dict[str, int]) -> bytes | None:
    """The JSON body with `params` in its `kv_transfer_params` (the router's replace the
    client's under the same keys; the client's other params kept); None when the body is not
    a JSON object (it goes to the engine as it came, which answers it)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    own = data.get("kv_transfer_params")
    data["kv_transfer_params"] = {**(own if isinstance(own, dict) else {}), **params}
    return json.dumps(data).encode()


class DirectMiddleware:
    """ASGI middleware of a direct-streaming replica's own app: the API key first (module
    docstring), then the router's decision from its headers into the body."""

    def __init__(self, app, *, access: Access, namespace: str):
        self.app, self.access, self.namespace = app, access, namespace

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = scope_headers(scope)
        if path not in OPEN_PATHS:
            refused = refusal(self.access, self.namespace, headers.get("authorization"))
            if refused is not None:
                return await reply_error(send, *refused)
        params = routed_params(headers) if scope.get("method") == "POST" \
            and path in ROUTED_PATHS else {}
        if not params:
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, replay([message], receive), send)
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.access.max_request_bytes:
                return await reply_too_large(send, self.access.max_request_bytes)
        merged = with_routed_params(body, params)
        if merged is not None:
            body = merged
            scope = {**scope, "headers": [
                (k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"
            ] + [(b"content-length", str(len(body)).encode())]}
        await self.app(scope, replay([{"type": "http.request", "body": body,
                                        "more_body": False}], receive), send)


def route_caller_allowed(client_host: str | None, node_hosts: Collection[str]) -> bool:
    """Whether /internal/route answers this caller: HAProxy runs on the Ray nodes, so only a
    Ray node's address (or loopback). The route needs no key (HAProxy sends the router none
    of the client's headers), and its answer tells how much of a prompt is cached, in the
    app's namespace, and where each replica listens: no one else may ask."""
    if not client_host:
        return False
    return is_loopback(client_host) or client_host in node_hosts


async def capped_body(request, limit_bytes: int) -> bytes | None:
    """The request's body, or None once it is over limit_bytes (declared or read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit_bytes:
        return None
    # The bytes are counted whatever the length says: a Transfer-Encoding beside it decides
    # the body's length (RFC 9112, 6.3), so a declared length alone is never trusted.
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit_bytes:
            return None
    return bytes(body)


def check_keys_for_replica(access: Access) -> None:
    """A replica refuses to start keyless unless Serve's HTTP binds loopback (KeysRequired):
    with direct ingress its own port takes requests."""
    from cluster.serving.ingress import serve_bind_host

    require_keys_for_bind(access, serve_bind_host())
