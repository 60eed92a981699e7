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

from cluster.core.config import CacheConfig
from cluster.serving.vllm_service import RaykvSettings

log = logging.getLogger("raykv.vllm")
CONNECTOR = {"kv_connector": "RaykvConnector",
             "kv_connector_module_path": "cluster.serving.vllm_connector",
             "kv_role": "kv_both"}
# vLLM's CPU backend: its paged blocks hold 128 tokens, so raykv pages of 128 map one to one.
CPU_BLOCK_TOKENS = 128


@dataclass(frozen=True)
class VllmAppArgs:
    """What `build_vllm_app` needs.

    model_source          a model directory (or hub id, where a hub is reachable)
    model_id              the name clients send as "model"; raykv keys pages by it too
    namespace             the raykv namespace of the pages
    num_replicas          LLMServer replicas (each one vLLM engine)
    request_router_class  "module:Class" of a RequestRouter, or None for Serve's default
    engine_kwargs         more vLLM engine arguments (they override the CPU defaults below)
    accelerator           "cpu" (vLLM's CPU backend, one CPU per replica) or "gpu"
    kv_cache_gib          vLLM's own KV space per replica on CPU (VLLM_CPU_KVCACHE_SPACE)
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


def kv_transfer_config(model_id: str, namespace: str, ray_address: str | None) -> dict:
    """The `engine_kwargs["kv_transfer_config"]` that runs RaykvConnector."""
    extra = {"raykv.namespace": namespace, "raykv.model_name": model_id}
    if ray_address:
        extra["raykv.ray_address"] = ray_address
    return {**CONNECTOR, "kv_connector_extra_config": extra}


def llm_config(args: VllmAppArgs, ray_address: str | None = None):
    """The ray.serve.llm.LLMConfig of one model served through RaykvConnector."""
    from ray.serve.llm import LLMConfig

    if args.accelerator not in ("cpu", "gpu"):
        raise ValueError(f"accelerator must be 'cpu' or 'gpu', got {args.accelerator!r}")
    cpu = args.accelerator == "cpu"
    # On CPU: no graph capture to wait for, and float32 (the dtype vLLM's CPU kernels run).
    engine = {"enforce_eager": True, "dtype": "float32"} if cpu else {}
    # usage.prompt_tokens_details.cached_tokens: prompt tokens vLLM did not compute
    engine["enable_prompt_tokens_details"] = True
    engine.update(args.engine_kwargs)
    engine["kv_transfer_config"] = kv_transfer_config(args.model_id, args.namespace,
                                                      ray_address)
    deployment: dict = {"num_replicas": args.num_replicas}
    if args.request_router_class:
        deployment["request_router_config"] = {
            "request_router_class": args.request_router_class,
            "request_router_kwargs": dict(args.request_router_kwargs)}
    options: dict = {}
    if cpu:
        options = {"accelerator_config": {"kind": "cpu"},
                   "placement_group_config": {"bundles": [{"CPU": 1}]},
                   "runtime_env": {"env_vars": {
                       "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}}}
    return LLMConfig(model_loading_config={"model_id": args.model_id,
                                           "model_source": args.model_source},
                     engine_kwargs=engine, deployment_config=deployment, **options)


def build_vllm_app(args: VllmAppArgs, cache: CacheConfig | None = None):
    """Ray Serve LLM's OpenAI app over vLLM engines that run RaykvConnector.

    raykv is started on the Ray cluster this process is connected to (or RAY_ADDRESS names)
    unless it already runs; `cache` is its config (default: pages of one vLLM CPU block).
    The engines reach the same cluster: its address goes into the connector's settings, so
    that an engine process never attaches to another Ray on the same machine.
    """
    import ray
    from ray.serve.llm import build_openai_app

    ensure_service(cache or CacheConfig(page_tokens=CPU_BLOCK_TOKENS))
    address = ray.get_runtime_context().gcs_address
    return build_openai_app({"llm_configs": [llm_config(args, address)]})


def ensure_service(cache: CacheConfig) -> None:
    """Start raykv with `cache` unless a raykv service already runs on this cluster."""
    import ray

    from cluster import start
    from cluster.api import running_config

    if ray.is_initialized():
        try:
            log.info("raykv already runs: %s", running_config().model_dump())
            return
        except (RuntimeError, ray.exceptions.RayError):
            pass
    start(cache)


def router_settings(router: str, model_source: str, model_id: str, namespace: str,
                    dtype: str = "float32") -> tuple[str | None, dict]:
    """(request_router_class, request_router_kwargs) for a router name: raykv's KV-aware one
    keys each request's prompt as RaykvConnector does (the model's tokenizer and geometry)."""
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
    return ROUTERS["raykv"], {"prompt_keys": {"tokenizer_dir": model_source, "spec": spec,
                                              "namespace": namespace,
                                              "page_tokens": CPU_BLOCK_TOKENS}}


def build_app(args: dict):
    """The builder Serve config files name (`import_path: cluster.serving.vllm_app:build_app`):

        model_source  a local model directory (required)
        model_id      the served name (default: the directory's name)
        router        raykv | pow2 | prefix (default raykv)
        replicas      LLMServer replicas (default 1)
        connector     RaykvConnector settings: raykv.namespace, raykv.model_name
    """
    fields = dict(args)
    connector = RaykvSettings.from_extra(fields.pop("connector", None))
    source = fields.pop("model_source")
    model_id = fields.pop("model_id", None) or connector.model_name or \
        os.path.basename(source.rstrip("/"))
    router_class, router_kwargs = router_settings(fields.pop("router", "raykv"), source,
                                                  model_id, connector.namespace)
    replicas = int(fields.pop("replicas", 1))
    if fields:
        raise ValueError(f"unknown vLLM app arguments {sorted(fields)}")
    return build_vllm_app(VllmAppArgs(source, model_id, connector.namespace, replicas,
                                      router_class, router_kwargs))


def app(args: dict):
    """The builder `serve run cluster.serving.vllm_app:app key=value ...` calls."""
    fields = dict(args)
    if "num_replicas" in fields:
        fields["num_replicas"] = int(fields["num_replicas"])
    if "kv_cache_gib" in fields:
        fields["kv_cache_gib"] = int(fields["kv_cache_gib"])
    return build_vllm_app(VllmAppArgs(**fields))
