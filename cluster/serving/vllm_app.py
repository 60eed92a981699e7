"""vLLM on raykv behind Ray Serve LLM: the OpenAI-compatible app of `ray.serve.llm`, its
engines running RaykvConnector.

    from ray import serve
    from cluster.serving.vllm_app import VllmAppArgs, build_vllm_app

    serve.run(build_vllm_app(VllmAppArgs(model_source="/models/small-llama",
                                         model_id="small-llama")))

or, from a shell (the builder takes the same fields as strings):

    serve run cluster.serving.vllm_app:app model_source=/models/small-llama model_id=small-llama

The app is Ray Serve LLM's own (`build_openai_app`): an OpenAI ingress and LLMServer replicas.
Replicas are picked by Serve's default request router unless `request_router_class` names
another `ray.serve.request_router.RequestRouter`, such as raykv's KV-aware router
("cluster.serving.router:RaykvRouter").
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.core.config import CacheConfig
from cluster.serving.access import (
    VLLM_MAX_REQUEST_BYTES,
    Access,
    api_keys_from_env,
    check_api_keys,
)
from cluster.serving.vllm_service import RaykvSettings

log = logging.getLogger("raykv.vllm")
CONNECTOR = {"kv_connector": "RaykvConnector",
             "kv_connector_module_path": "cluster.serving.vllm_connector",
             "kv_role": "kv_both"}
# vLLM's dtype by accelerator: float32 is what vLLM's CPU kernels run; bf16 on GPUs.
ENGINE_DTYPES = {"cpu": "float32", "gpu": "bfloat16"}
# The OpenAI ingress replica's CPUs (Serve's default for a replica).
INGRESS_CPUS = 1
RAYKV_ROUTER = "cluster.serving.router:RaykvRouter"
# With raykv's router, each LLMServer turns its engine's KV-cache events on and advertises
# them: the router's engine tier (as Ray's KVAwareRouter has its own turned on).
EVENTS_SERVER = "cluster.serving.vllm_events_server:RaykvLLMServer"
# With any other router, LLMServer with vLLM's tokenization server handed over (Ray Serve LLM
# 2.60 looks for vLLM 0.32's under its old name: /tokenize and /detokenize answered 400).
TOKENIZING_SERVER = "cluster.serving.vllm_events_server:TokenizingLLMServer"
ROUTING_STATS_PERIOD_S = 2.0
# The direct-streaming app's server (build_direct_vllm_app).
DIRECT_SERVER = "cluster.serving.vllm_direct_server:DirectLLMServer"


@dataclass(frozen=True)
class VllmAppArgs:
    """What `build_vllm_app` needs.

    model_source          a model directory (or hub id, where a hub is reachable)
    model_id              the name clients send as "model"; raykv keys pages by it too
    namespace             the raykv namespace of the pages
    num_replicas          LLMServer replicas (each one vLLM engine)
    request_router_class  "module:Class" of a RequestRouter, or None for Serve's default
    engine_kwargs         more vLLM engine arguments (they override the defaults below)
    accelerator           "cpu" (vLLM's CPU backend: float32, one CPU per replica) or "gpu"
                          (one GPU per replica, bf16 unless engine_kwargs name a dtype)
    kv_cache_gib          vLLM's own KV space per replica on CPU (VLLM_CPU_KVCACHE_SPACE)
    api_keys              bearer key -> namespace (default: RAYKV_API_KEYS); without keys the
                          app starts only on a loopback bind (cluster/serving/vllm_ingress.py)
    max_request_bytes     a request body's limit at the ingress (413 beyond it; 32 MiB)
    """

    model_source: str
    model_id: str
    namespace: str = "default"
    num_replicas: int = 1
    request_router_class: str | None = None
    request_router_kwargs: dict = field(default_factory=dict)
    engine_kwargs: dict = field(default_factory=dict)
    accelerator: str = "cpu"
    kv_cache_gib: int = 1
    api_keys: dict = field(default_factory=api_keys_from_env)
    max_request_bytes: int = VLLM_MAX_REQUEST_BYTES

    def __post_init__(self):
        if self.accelerator not in ENGINE_DTYPES:
            raise ValueError(f"accelerator must be 'cpu' or 'gpu', got {self.accelerator!r}")
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be an integer of at least 1024, got "
                             f"{self.max_request_bytes!r}")

    @property
    def dtype(self) -> str:
        """The engine's dtype (and its KV cache's, unless kv_cache_dtype says otherwise)."""
        return str(self.engine_kwargs.get("dtype") or ENGINE_DTYPES[self.accelerator])


def resources_needed(args: VllmAppArgs) -> dict[str, float]:
    """The Ray resources the app asks for. On CPU each replica's engine has a bundle of one
    CPU, which the replica actor shares (it asks for none: the engine is its child process);
    on GPU each engine has its GPUs (tensor-parallel size) and its replica one CPU. The
    ingress takes INGRESS_CPUS; raykv's own actors take none."""
    replicas = args.num_replicas
    if args.accelerator == "cpu":
        return {"CPU": replicas + INGRESS_CPUS}
    gpus = int(args.engine_kwargs.get("tensor_parallel_size", 1))
    return {"CPU": replicas + INGRESS_CPUS, "GPU": replicas * gpus}


def kv_transfer_config(model_id: str, namespace: str, ray_address: str | None) -> dict:
    """The `engine_kwargs["kv_transfer_config"]` that runs RaykvConnector."""
    extra = {"raykv.namespace": namespace, "raykv.model_name": model_id}
    if ray_address:
        extra["raykv.ray_address"] = ray_address
    return {**CONNECTOR, "kv_connector_extra_config": extra}


def llm_config(args: VllmAppArgs, ray_address: str | None = None):
    """The ray.serve.llm.LLMConfig of one model served through RaykvConnector."""
    from ray.serve.llm import LLMConfig

    cpu = args.accelerator == "cpu"
    # On CPU: no graph capture to wait for.
    engine: dict = {"enforce_eager": True} if cpu else {}
    # usage.prompt_tokens_details.cached_tokens: prompt tokens vLLM did not compute
    engine["enable_prompt_tokens_details"] = True
    engine.update(args.engine_kwargs)
    engine["dtype"] = args.dtype
    engine["kv_transfer_config"] = kv_transfer_config(args.model_id, args.namespace,
                                                      ray_address)
    deployment: dict = {"num_replicas": args.num_replicas}
    if args.request_router_class:
        deployment["request_router_config"] = {
            "request_router_class": args.request_router_class,
            "request_router_kwargs": _router_kwargs(args, engine)}
        if args.request_router_class == RAYKV_ROUTER:
            # The replicas' measured rates reach the router this often (Serve's default is
            # every 10 s); publishing them reads a small local file (vllm_events_server.py).
            deployment["request_router_config"]["request_routing_stats_period_s"] = \
                ROUTING_STATS_PERIOD_S
    options: dict = {"accelerator_config": {"kind": args.accelerator},
                     "server_cls": EVENTS_SERVER if args.request_router_class == RAYKV_ROUTER
                     else TOKENIZING_SERVER}
    if cpu:
        deployment["ray_actor_options"] = {"num_cpus": 0}  # it shares its engine's CPU
        options.update({"placement_group_config": {"bundles": [{"CPU": 1}]},
                        "runtime_env": {"env_vars": {
                            "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}}})
    return LLMConfig(model_loading_config={"model_id": args.model_id,
                                           "model_source": args.model_source},
                     engine_kwargs=engine, deployment_config=deployment, **options)


def _router_kwargs(args: VllmAppArgs, engine: dict) -> dict:
    """The router's kwargs; raykv's, keying prompts, also gets how the engine renders them
    (unless the caller set its own), so that it keys and forwards the engine's own ids
    (cluster/serving/engine_tokens.py)."""
    kwargs = dict(args.request_router_kwargs)
    keyed = kwargs.get("prompt_keys")
    if args.request_router_class == RAYKV_ROUTER and keyed and "renderer" not in keyed:
        from cluster.serving.engine_tokens import renderer_spec

        kwargs["prompt_keys"] = {**keyed, "renderer": renderer_spec(
            args.model_source, args.model_id, engine)}
    return kwargs


def build_vllm_app(args: VllmAppArgs, cache: CacheConfig | None = None):
    """Ray Serve LLM's OpenAI app over vLLM engines that run RaykvConnector.

    raykv is started with `cache` (default: CacheConfig(), as `raykv start`) on the Ray
    cluster this process is connected to (or RAY_ADDRESS names) only when none runs; a
    running service is adopted, with its page size, and a warning says so. The namespace
    must be one the service knows, and raykv's router must key pages as the service does
    (ValueError otherwise). The engines reach the same cluster: its address goes into the
    connector's settings, so that an engine process never attaches to another Ray.
    """
    from ray.serve.llm import build_openai_app

    address = _adopted_service([args], cache)
    return build_openai_app({"llm_configs": [llm_config(args, address)],
                             "ingress_cls_config": keyed_ingress(args)})


def build_direct_vllm_app(args, cache=None, placement: dict | None = None):
    """raykv's vLLM app (`VllmAppArgs`, its router must be raykv's) with direct streaming:
    RaykvRouteIngress in front (Serve runs it on every proxy node:
    RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE), LLMServer replicas
    (DirectLLMServer: engine events, rates, keys, the router's decision) as the ingress.
    raykv is started or adopted as by `build_vllm_app`. Serve must run HAProxy with the body
    forwarded to the router (cluster/serving/vllm_direct.py), else requests are
    load-balanced, unkeyed by prompt."""
    from ray import serve
    from ray.llm._internal.serve.core.ingress.builder import (
        _build_direct_streaming_llm_deployment,
    )

    from cluster.serving.access import require_keys_for_bind
    from cluster.serving.ingress import serve_bind_host
    from cluster.serving.vllm_direct_server import DirectLLMServer, RaykvRouteIngress

    if args.request_router_class != RAYKV_ROUTER:
        raise ValueError(f"the direct app routes with raykv's router ({RAYKV_ROUTER}), got "
                         f"{args.request_router_class!r}")
    access = Access.of(check_api_keys(args.api_keys))
    bind_host = serve_bind_host()
    if bind_host is not None:
        require_keys_for_bind(access, bind_host)
    address = _adopted_service([args], cache)
    config = llm_config(args, address)
    config.server_cls = DIRECT_SERVER
    if placement is not None:
        config.placement_group_config = placement
    router = config.deployment_config["request_router_config"]
    router["request_router_kwargs"] = {**router["request_router_kwargs"], "picks_expire": True}
    server = _build_direct_streaming_llm_deployment(
        config, deployment_cls=DirectLLMServer,
        bind_kwargs={"key_digests": access.key_digests, "namespace": args.namespace})
    front = serve.deployment(RaykvRouteIngress, max_ongoing_requests=1000,
                             ray_actor_options={"num_cpus": 0})
    return server._with_ingress_request_router(front.bind(server=server))


def build_pd_vllm_app(prefill: VllmAppArgs, decode: VllmAppArgs,
                      cache: CacheConfig | None = None):
    """Ray Serve LLM's prefill/decode disaggregated OpenAI app (`build_pd_openai_app`) over
    raykv: prefill replicas put each prompt's KV into raykv through RaykvConnector, and
    decode replicas load it from there, with any other prefix raykv holds on any node
    (cluster/serving/vllm_pd.py).

        serve.run(build_pd_vllm_app(
            VllmAppArgs(model_source="/models/small-llama", model_id="small-llama"),
            VllmAppArgs(model_source="/models/small-llama", model_id="small-llama",
                        request_router_class=router, request_router_kwargs=router_kwargs)))

    Both sides must key pages alike: the same model_source, model_id (raykv.model_name) and
    namespace, and the running service's page size (ValueError otherwise); their vLLM block
    sizes must divide it. raykv is started and adopted as for `build_vllm_app`. Clients reach
    the decode deployment through raykv's keyed ingress; a router on `decode` (raykv's, with
    its fetch-or-recompute cut) routes decode replicas, one on `prefill` prefill replicas.
    The decode replicas are Ray's PDDecodeServer, so raykv's router sees the directory and
    the service's tiers there, not the engines' own KV events. Each replica takes one CPU on
    CPU, the ingress one more.
    """
    from ray.serve.llm import build_pd_openai_app

    from cluster.serving.vllm_pd import register_backend

    for name in ("model_source", "model_id", "namespace"):
        if getattr(prefill, name) != getattr(decode, name):
            raise ValueError(f"prefill and decode must have the same {name}: "
                             f"{getattr(prefill, name)!r} != {getattr(decode, name)!r}")
    address = _adopted_service([prefill, decode], cache)
    register_backend()  # Ray Serve LLM's P/D shaping for RaykvConnector (vllm_pd.py)
    return build_pd_openai_app({"prefill_config": llm_config(prefill, address),
                                "decode_config": llm_config(decode, address),
                                "ingress_cls_config": keyed_ingress(decode)})


def _adopted_service(apps: list[VllmAppArgs], cache: CacheConfig | None) -> str:
    """Start raykv with `cache` unless one runs; check that it knows each app's namespace and
    pages as each router keys them (ValueError otherwise). The Ray cluster's address."""
    import ray

    from cluster.api import ensure_running, quotas

    running = ensure_running(cache)
    known = quotas()["namespaces"]
    for args in apps:
        if args.namespace not in known:
            raise ValueError(f"raykv namespace {args.namespace!r} is not one the running "
                             f"service knows: {sorted(known)}; add it with `raykv quota "
                             f"namespace`")
        keyed = args.request_router_kwargs.get("prompt_keys") or {}
        if keyed and keyed["page_tokens"] != running.page_tokens:
            raise ValueError(f"the router keys pages of {keyed['page_tokens']} tokens, the "
                             f"running raykv service's pages are {running.page_tokens}: build "
                             "its settings with router_settings(..., page_tokens=<the "
                             "service's>)")
    return ray.get_runtime_context().gcs_address


def keyed_ingress(args: VllmAppArgs) -> dict:
    """Ray Serve LLM's ingress_cls_config for raykv's keyed OpenAI ingress. Refuses
    (KeysRequired) a keyless app where Serve already binds beyond loopback; each ingress
    replica checks again as it starts (Serve may start after this builder runs)."""
    from cluster.serving.access import require_keys_for_bind
    from cluster.serving.ingress import serve_bind_host
    from cluster.serving.vllm_ingress import KeyedOpenAiIngress

    access = Access.of(check_api_keys(args.api_keys))
    bind_host = serve_bind_host()
    if bind_host is not None:
        require_keys_for_bind(access, bind_host)
    return {"ingress_cls": KeyedOpenAiIngress,
            "ingress_extra_kwargs": {"key_digests": access.key_digests,
                                     "namespace": args.namespace,
                                     "max_request_bytes": args.max_request_bytes}}


def router_settings(router: str, model_source: str, model_id: str, namespace: str,
                    dtype: str, page_tokens: int, engine_kwargs: dict | None = None
                    ) -> tuple[str | None, dict]:
    """(request_router_class, request_router_kwargs) for a router name: raykv's KV-aware one
    keys each request's prompt as RaykvConnector does (the model's tokenizer and geometry,
    the engine's `dtype` and the running service's `page_tokens`). Given the engine's
    `engine_kwargs`, it renders prompts as the engine does and hands the ids to the engine
    (cluster/serving/engine_tokens.py; `build_vllm_app` adds them itself)."""
    from cluster.serving.app import ROUTERS

    if router not in ROUTERS:
        raise ValueError(f"router must be one of {sorted(ROUTERS)}, got {router!r}")
    if router != "raykv":
        return ROUTERS[router], {}
    with open(os.path.join(model_source, "config.json")) as file:
        config = json.load(file)
    heads = config["num_attention_heads"]
    spec = {"name": model_id, "num_layers": config["num_hidden_layers"],
            "num_kv_heads": config.get("num_key_value_heads", heads),
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
            "dtype": dtype}
    keyed = {"tokenizer_dir": model_source, "spec": spec, "namespace": namespace,
             "page_tokens": page_tokens}
    if engine_kwargs is not None:
        from cluster.serving.engine_tokens import renderer_spec

        keyed["renderer"] = renderer_spec(model_source, model_id, engine_kwargs)
    return ROUTERS["raykv"], {"prompt_keys": keyed}


class VllmBuildArgs(BaseModel):
    """What a Serve config gives `cluster.serving.vllm_app:build_app`."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_source: str = Field(description="a local model directory")
    model_id: str | None = Field(None, description="the served name (default: "
                                 "connector's raykv.model_name, else the directory's name)")
    router: Literal["raykv", "pow2", "prefix"] = "raykv"
    replicas: int = Field(1, ge=1, description="LLMServer replicas")
    accelerator: Literal["cpu", "gpu"] = Field("cpu", description="vLLM's CPU backend "
                                               "(float32) or GPUs (bf16 by default)")
    engine_kwargs: dict = Field(default_factory=dict, description="more vLLM engine arguments")
    connector: dict | None = Field(None, description="RaykvConnector settings: "
                                   "raykv.namespace, raykv.model_name")
    cache: dict | None = Field(None, description="CacheConfig fields raykv is started with "
                               "when it does not run yet (a running service is adopted)")


def build_app(args: VllmBuildArgs):
    """The builder Serve config files name (`import_path: cluster.serving.vllm_app:build_app`);
    Serve validates the config's args into VllmBuildArgs (a dict is taken too)."""
    settings = VllmBuildArgs.model_validate(args)
    connector = RaykvSettings.from_extra(settings.connector)
    source = settings.model_source
    model_id = settings.model_id or connector.model_name or \
        os.path.basename(source.rstrip("/"))
    from cluster.api import ensure_running

    running = ensure_running(None if settings.cache is None else CacheConfig(**settings.cache))
    app_args = VllmAppArgs(source, model_id, connector.namespace, settings.replicas,
                           engine_kwargs=settings.engine_kwargs,
                           accelerator=settings.accelerator)
    router_class, router_kwargs = router_settings(settings.router, source, model_id,
                                                  connector.namespace, app_args.dtype,
                                                  running.page_tokens)
    return build_vllm_app(VllmAppArgs(source, model_id, connector.namespace, settings.replicas,
                                      router_class, router_kwargs, settings.engine_kwargs,
                                      settings.accelerator), running)


def app(args: dict):
    """The builder `serve run cluster.serving.vllm_app:app key=value ...` calls."""
    fields = dict(args)
    if "num_replicas" in fields:
        fields["num_replicas"] = int(fields["num_replicas"])
    if "kv_cache_gib" in fields:
        fields["kv_cache_gib"] = int(fields["kv_cache_gib"])
    return build_vllm_app(VllmAppArgs(**fields))
