"""The Serve application: `serve run cluster.serving.app:build_app model=small-llama`.

    HTTP -> Ingress (OpenAI API; tokenizes, computes page keys; its handle's router)
               -> EngineDeployment x N (one per kv node by default), each on raykv's cache

`build_app` starts the cache service on the cluster when it is not running (with the `cache`
settings given, else the defaults) and returns the application. `raykv serve` calls it.

With `local_cache` the engines use no raykv at all: each replica keeps only its own prefix
cache (cluster/serving/local_cache.py), as engines do without raykv, and the service is
neither started nor asked; `raykv bench serve` runs this as its baseline.
"""

from __future__ import annotations

from typing import Literal

import ray
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray.serve.config import RequestRouterConfig

from cluster.api import ensure_running, quotas
from cluster.core.config import CacheConfig
from cluster.core.membership import kv_nodes
from cluster.core.spec import ModelSpec
from cluster.serving.access import (
    Access,
    admin_key_from_env,
    api_keys_from_env,
    check_api_keys,
    require_keys_for_bind,
    require_keys_for_namespaces,
)
from cluster.serving.deployments import EngineDeployment
from cluster.serving.engine import EngineConfig
from cluster.serving.ingress import (
    Ingress,
    IngressSettings,
    serve_bind_host,
    serve_proxy_location,
)
from cluster.serving.local_cache import LocalCacheSettings
from cluster.serving.model import SHAPES
from policies.admission import AdmissionLimits, TenantLimits, priority_rank

ROUTERS = {
    "raykv": "cluster.serving.router:RaykvRouter",
    "pow2": "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter",
    "prefix": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"
              ":PrefixCacheAffinityRouter",
}


class TenantArgs(BaseModel):
    """One tenant's (namespace's) admission settings."""

    model_config = ConfigDict(extra="forbid")

    rate_per_s: float | None = Field(None, gt=0, description="requests per second refilled "
                                     "into its bucket (None: no limit)")
    burst: float | None = Field(None, ge=1, description="the bucket's size (default: "
                                "max(1, rate_per_s))")
    priority: Literal["high", "normal", "low"] = Field("normal", description="the class of "
                                                       "requests without x-raykv-priority")
    max_priority: Literal["high", "normal", "low"] = Field(
        "high", description="the most urgent class its requests may ask for with "
                            "x-raykv-priority (a higher one is lowered to it)")

    @model_validator(mode="after")
    def _default_within_ceiling(self) -> TenantArgs:
        if priority_rank(self.priority) < priority_rank(self.max_priority):
            raise ValueError(f"priority {self.priority!r} is above max_priority "
                             f"{self.max_priority!r}")
        return self

    def limits(self) -> TenantLimits:
        if self.rate_per_s is None:
            return TenantLimits(priority=self.priority, max_priority=self.max_priority)
        return TenantLimits(self.rate_per_s, self.burst or max(1.0, self.rate_per_s),
                            self.priority, self.max_priority)


class AdmissionArgs(BaseModel):
    """The ingress's admission gate (per ingress replica): past it, HTTP 429."""

    model_config = ConfigDict(extra="forbid")

    max_in_flight: int = Field(256, ge=1, description="requests past the gate at once")
    max_queued: int = Field(64, ge=0, description="requests waiting per priority class")
    max_wait_s: float = Field(10.0, gt=0, description="the longest wait at the gate")
    tenants: dict[str, TenantArgs] = Field(default_factory=dict)
    default_tenant: TenantArgs = Field(default_factory=TenantArgs)

    def limits(self) -> AdmissionLimits:
        return AdmissionLimits(self.max_in_flight, self.max_queued, self.max_wait_s,
                               {name: t.limits() for name, t in self.tenants.items()},
                               self.default_tenant.limits())


class LocalCacheArgs(BaseModel):
    """Each engine replica's own prefix cache, instead of raykv's shared one."""

    model_config = ConfigDict(extra="forbid")

    page_tokens: int = Field(16, ge=1, description="tokens per cached page")
    capacity_bytes: int = Field(256 << 20, ge=1, description="KV bytes each replica holds")

    def settings(self) -> LocalCacheSettings:
        return LocalCacheSettings(self.page_tokens, self.capacity_bytes)


class AppArgs(BaseModel):
    """What `serve run ... key=value` or `raykv serve` may set."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("small-llama", description=f"one of {sorted(SHAPES)}")
    replicas: int | None = Field(None, ge=1, description="engine replicas (default: one per "
                                 "kv node)")
    router: Literal["raykv", "pow2", "prefix"] = "raykv"
    max_context_tokens: int = Field(8192, ge=64, le=16384)
    default_max_tokens: int = Field(16, ge=1)
    max_ongoing_requests: int = Field(4, ge=1)
    max_queued_requests: int = Field(64, ge=-1, description="past it: HTTP 503 (-1: no limit)")
    engine_num_cpus: float = Field(1.0, ge=0)
    seed: int = 0
    cache: dict | None = Field(None, description="CacheConfig fields, used when raykv is not "
                               "running yet")
    local_cache: LocalCacheArgs | None = Field(None, description="each engine replica keeps "
                                               "only its own prefix cache (as vLLM's automatic "
                                               "prefix caching does); raykv is not used")
    admission: AdmissionArgs = Field(default_factory=AdmissionArgs)
    api_keys: dict[str, str] = Field(default_factory=api_keys_from_env, description="bearer "
                                     "keys -> the namespace each may use (default: "
                                     "RAYKV_API_KEYS, a JSON object). Without keys only the "
                                     "default namespace is served, and only on a loopback "
                                     "bind: the app refuses to start otherwise")
    max_request_bytes: int = Field(1 << 20, ge=1024, description="a request body's limit (413)")
    admin_key: str | None = Field(default_factory=admin_key_from_env, description="the bearer "
                                  "key of the admin endpoints (/v1/raykv/admin/pin, unpin, "
                                  "warm; default: RAYKV_ADMIN_KEY); without it they answer "
                                  "404. Only its digest is kept")
    ingress_placement: Literal["auto", "head", "any"] = Field(
        "auto", description="where the HTTP ingress runs: 'head' pins it to the head node; "
        "'any' leaves it to Serve; 'auto' is 'head' when Serve's proxies run only there "
        "(proxy_location HeadOnly), else 'any'")

    @model_validator(mode="after")
    def _router_has_its_cache(self):
        if self.local_cache is not None and self.router == "raykv":
            raise ValueError("router 'raykv' routes by raykv's cache; with local_cache choose "
                             "'pow2' or 'prefix'")
        return self

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys_valid(cls, value):
        return check_api_keys(value)


def ensure_cache(cache: dict | None) -> CacheConfig:
    """The running service's config (a running service is adopted as it is, and a warning
    names what differs from `cache` when one was given); the service is started with
    `cache` (None: the defaults) when none runs."""
    return ensure_running(None if cache is None else CacheConfig(**cache))


def require_keys(front_door: Access, settings: AppArgs) -> None:
    """Refuse (KeysRequired) to build a keyless app that would serve namespaces other than
    the default (registered on the service, or given admission settings), or bind HTTP
    beyond loopback. The bind is checked here when Serve already runs, and again by each
    ingress replica as it starts (a builder may run before Serve does)."""
    registered = quotas()["namespaces"] if settings.local_cache is None else ()
    require_keys_for_namespaces(front_door, {*registered, *settings.admission.tenants})
    bind_host = serve_bind_host()
    if bind_host is not None:
        require_keys_for_bind(front_door, bind_host)


def build_app(args: dict | None = None):
    """A Serve application of the OpenAI API over engines on raykv's cache (or, with
    `local_cache`, each on its own)."""
    settings = AppArgs(**(args or {}))
    if settings.model not in SHAPES:
        raise ValueError(f"unknown model {settings.model!r}; known: {sorted(SHAPES)}")
    local = settings.local_cache.settings() if settings.local_cache else None
    config = ensure_cache(settings.cache) if local is None else CacheConfig()
    replicas = settings.replicas or len(kv_nodes(config.node_resource, ray.nodes()))
    engine_config = EngineConfig(settings.model, settings.seed, settings.max_context_tokens,
                                 settings.max_ongoing_requests)
    engine = EngineDeployment.options(
        num_replicas=replicas, max_ongoing_requests=settings.max_ongoing_requests,
        max_queued_requests=settings.max_queued_requests,
        ray_actor_options={"num_cpus": settings.engine_num_cpus,
                           "resources": {config.node_resource: 0.001}},
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[settings.router]),
    ).bind(engine_config, settings.model, local)
    front_door = Access.of(settings.api_keys, settings.max_request_bytes, settings.admin_key)
    require_keys(front_door, settings)
    ingress = IngressSettings(settings.max_context_tokens, settings.default_max_tokens,
                              settings.admission.limits(), front_door, local)
    placed = Ingress.options(**ingress_options(settings.ingress_placement))
    return placed.bind(engine, ModelSpec.preset(settings.model), ingress)


HEAD_RESOURCE = "node:__internal_head__"  # Ray's own resource of the head node


def ingress_options(placement: str) -> dict:
    """The ingress deployment's options for `placement` (AppArgs.ingress_placement).

    Behind a proxy on the head only, an ingress replica on another node is a hop out and
    back, and a node's death fails every request that replica holds with Serve's own HTTP
    500 (not an OpenAI error: the proxy answers, not the ingress). On the head it lives as
    long as the proxy that feeds it. It takes no CPU, so the head need not offer any.
    Serve's options replace the deployment's ray_actor_options whole: the ingress's own are
    kept, the head's resource added."""
    head = placement == "head" or (placement == "auto" and serve_proxy_location() == "HeadOnly")
    if not head:
        return {}
    actor = dict(Ingress.ray_actor_options or {})
    actor["resources"] = {**actor.get("resources", {}), HEAD_RESOURCE: 0.001}
    return {"ray_actor_options": actor}
