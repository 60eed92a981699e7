"""The two deployments of raykv's direct-streaming vLLM app (cluster/serving/vllm_direct.py):

- `RaykvRouteIngress`: what HAProxy asks for a replica (`POST /internal/route`, the contract of
  Ray's `LLMRouter`); it picks through the LLMServer deployment's request router (raykv's) and
  returns the router's hit and cut as request headers;
- `DirectLLMServer`: RaykvLLMServer (engine events and rates for the router) whose own HTTP
  app checks API keys and takes the router's decision from those headers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from types import SimpleNamespace

from fastapi import FastAPI, HTTPException, Request
from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from cluster.serving.access import Access
from cluster.serving.vllm_direct import (
    MAX_ROUTE_BODY_BYTES,
    DirectMiddleware,
    capped_body,
    check_keys_for_replica,
    route_caller_allowed,
    route_headers,
)
from cluster.serving.vllm_events_server import RaykvLLMServer

log = logging.getLogger("raykv.vllm")
# Ray's contract (ray.serve._private.constants.RAY_SERVE_INGRESS_REQUEST_ROUTER_OPT_HEADERS_FIELD)
HEADERS_FIELD = "request_headers"
ROUTING_FIELDS = ("messages", "prompt")  # a body raykv's router can key (as LLMRouter's)
NODE_HOSTS_REFRESH_S = 1.0  # an unknown caller re-reads the Ray nodes at most this often

route_app = FastAPI()


def routing_copy(body: bytes) -> SimpleNamespace | None:
    """The body as the namespace the request router reads (`.prompt` or `.messages`, and
    `.kv_transfer_params`, which RaykvRouter writes its decision into); None for a body it
    cannot key (empty, not JSON, no prompt): the router then load-balances."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or not any(data.get(f) for f in ROUTING_FIELDS):
        return None
    data.setdefault("kv_transfer_params", None)
    return SimpleNamespace(**data)


@serve.ingress(route_app)
class RaykvRouteIngress:
    """HAProxy's router for raykv's direct app (Ray's LLMRouter contract, raykv's router)."""

    def __init__(self, server: DeploymentHandle):
        self._handle = server
        self._handle._init()
        self._node_hosts: frozenset[str] = frozenset()
        self._node_hosts_at_s = float("-inf")

    @route_app.post("/internal/route")
    async def route(self, request: Request):
        if not await self._from_ray_node(request.client.host if request.client else None):
            raise HTTPException(status_code=403, detail="only HAProxy on a Ray node routes")
        body = await capped_body(request, MAX_ROUTE_BODY_BYTES)
        if body is None:
            raise HTTPException(status_code=413, detail="the body is over "
                                f"{MAX_ROUTE_BODY_BYTES} bytes")
        payload = routing_copy(body)
        args = (payload,) if payload is not None else ()
        try:
            async with self._handle.choose_replica(*args, _reserve=False) as selection:
                replica = selection._replica
                endpoint = replica.backend_http_endpoint
                replica_id = replica.replica_id.to_full_id_str()
        except ValueError as error:
            raise HTTPException(status_code=400, detail=str(error)) from error
        except (RuntimeError, DeploymentUnavailableError) as error:
            raise HTTPException(status_code=503, detail=str(error)) from error
        if endpoint is None:
            raise HTTPException(status_code=503,
                                detail=f"replica {replica_id} has no backend HTTP endpoint")
        host, port = endpoint
        response = {"host": host, "port": port, "replica_id": replica_id}
        headers = route_headers(getattr(payload, "kv_transfer_params", None))
        if headers:
            response[HEADERS_FIELD] = headers
        return response

    async def _from_ray_node(self, host: str | None) -> bool:
        """Whether `host` is a Ray node's address (route_caller_allowed), reading the nodes
        again for an unknown one at most every NODE_HOSTS_REFRESH_S."""
        if route_caller_allowed(host, self._node_hosts):
            return True
        if time.monotonic() - self._node_hosts_at_s < NODE_HOSTS_REFRESH_S:
            return False
        import ray

        nodes = await asyncio.to_thread(ray.nodes)
        self._node_hosts = frozenset(n["NodeManagerAddress"] for n in nodes if n["Alive"])
        self._node_hosts_at_s = time.monotonic()
        return route_caller_allowed(host, self._node_hosts)

    @route_app.get("/health")
    async def health(self):
        return {"status": "ok"}


class DirectLLMServer(RaykvLLMServer):
    """RaykvLLMServer as a direct-streaming ingress: its vLLM app behind DirectMiddleware."""

    async def __init__(self, llm_config, *, key_digests: dict[bytes, str] | None = None,
                       namespace: str = "default", **kwargs):
        self._raykv_access = Access(dict(key_digests or {}))
        self._raykv_namespace = namespace
        check_keys_for_replica(self._raykv_access)  # raises: the replica fails to start
        await super().__init__(llm_config, **kwargs)

    async def __serve_build_asgi_app__(self):
        from ray.llm._internal.serve.core.server.llm_server import _add_middleware_to_built_app

        app = await super().__serve_build_asgi_app__()
        _add_middleware_to_built_app(app, DirectMiddleware, access=self._raykv_access,
                                     namespace=self._raykv_namespace)
        return app
