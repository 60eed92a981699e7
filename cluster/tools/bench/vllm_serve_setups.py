"""The four set-ups of `raykv bench vllm-serve`: the same vLLM engines (CPU build) behind Ray
Serve LLM, routed four ways.

    raykv      RaykvConnector (raykv's tiers) and raykv's KV-aware router
    kv-aware   vLLM's own prefix cache, Ray's KVAwareRouter (Dynamo's SelectionService fed by
               vLLM's KV events), as Ray documents it: direct streaming behind HAProxy
    prefix     vLLM's own prefix cache, Ray Serve LLM's PrefixCacheAffinityRouter
    pow2       vLLM's own prefix cache, Serve's power-of-two choices router

Every engine is the same: float32, eager, `BLOCK_TOKENS`-token blocks, `num_gpu_blocks_override`
blocks of vLLM's own cache (below the trace's working set), prompt-token details and vLLM's
per-request timings (`enable_per_request_metrics`: queue and prefill per reply) on, one CPU
bundle holding the node's one `engine_slot` (one replica per simulated node).

Ray's KVAwareRouter binds its engines' ZMQ ports at a base plus the replica's *node-local*
rank (ray.llm._internal.serve.routing_policies.kv_aware.vllm.kv_events). Simulated nodes
share one host, so every replica would bind the same ports: `PortedLLMServer` gives each
replica free ports before its engine starts (vllm_serve_server.py), the only change to Ray's
router set-up. This module imports no vLLM (its unit tests run without it).
"""

from __future__ import annotations

from dataclasses import dataclass

SETUPS = ("raykv", "kv-aware", "prefix", "pow2")
# Run only when named (`--setups`): raykv's app with Ray's direct streaming (vllm_direct.py),
# raykv's router behind HAProxy as kv-aware's is; raykv's app with its connector's
# `raykv.load_mode` "async" (every lookup and load off the engine's step, as before
# step_budget.py), to measure what waiting in the step gives; and raykv's app with its
# `raykv.save_mode` "async" (no step waits for a save's flush), to measure what those waits cost;
# and kv-aware's app with RaykvConnector on its engines (Ray's router, raykv's tiers behind
# it, as an offload connector runs behind Ray's router), to measure what raykv's router adds
# over its connector, and the connector's lookups behind a router that gives it no hit;
# and raykv's app as it was before its router rendered prompts as the engine does: keyed with
# the tokenizer's own template, every prompt rendered again by the engine (engine_tokens.py).
EXTRA_SETUPS = ("raykv-direct", "raykv-async", "raykv-save-async", "kv-aware-raykv",
                "raykv-rerender")
KV_AWARE_ROUTER = "ray.serve.llm.request_router:KVAwareRouter"
PORTED_SERVER = "cluster.tools.bench.vllm_serve_server:PortedLLMServer"
ENGINE_SLOT = "engine_slot"  # one per simulated node: one replica per node
# Ray's direct streaming (LLMRouter as the ingress request router) needs both, read at import.
DIRECT_STREAMING_ENV = {"RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1"}
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
# ray.llm._internal.serve.routing_policies.kv_aware.constants.KV_TOKEN_PORT_BASE_KEY (that
# package needs vLLM to import): the experimental_configs key of the prompt-token port base.
KV_TOKEN_PORT_BASE_KEY = "KV_TOKEN_PORT_BASE"


@dataclass(frozen=True, slots=True)
class EngineShape:
    """What every set-up's engines share."""

    block_tokens: int = 32
    max_model_len: int = 4096
    num_blocks: int = 512  # vLLM's own cache per engine (num_gpu_blocks_override)
    max_num_seqs: int = 8
    prefix_caching: bool = True  # vLLM's own (off: the recompute part, vllm_serve_recompute)

    def engine_kwargs(self) -> dict:
        return {"enforce_eager": True, "dtype": "float32", "block_size": self.block_tokens,
                "max_model_len": self.max_model_len,
                "num_gpu_blocks_override": self.num_blocks, "max_num_seqs": self.max_num_seqs,
                "enable_prompt_tokens_details": True,
                # each reply's vLLM timings (queue, prefill): the bench's per-request split
                "enable_per_request_metrics": True,
                "enable_prefix_caching": self.prefix_caching}


def ported_engine_kwargs(engine_kwargs: dict, experimental: dict, rank: int,
                         ports: tuple[int, int, int]) -> tuple[dict, dict]:
    """(engine_kwargs, experimental_configs) with Ray's KV-events endpoints and the prompt-token
    port base moved to `ports` (events, replay, tokens). Ray adds the node-local `rank` to each
    later, so it is taken off here."""
    events = dict(engine_kwargs.get("kv_events_config") or {})
    if not events:
        return engine_kwargs, experimental
    events["endpoint"] = f"tcp://*:{ports[0] - rank}"
    events["replay_endpoint"] = f"tcp://*:{ports[1] - rank}"
    return ({**engine_kwargs, "kv_events_config": events},
            {**experimental, KV_TOKEN_PORT_BASE_KEY: ports[2] - rank})


# vLLM's CPU engines bind their OpenMP threads to the cores left after reserving one per worker
# for the engine's scheduler, and one more when a KV connector is configured (vLLM's
# ompmultiprocessing.py: "reserve at one more core for nixl_connector under p/d case"). On this
# 2-core machine that gave raykv's engines (RaykvConnector) 2 threads on cores 0 and 1 with
# nothing reserved, and every baseline's 1 thread on core 0 with core 1 reserved: set-ups
# differed in their engines' CPU, not only in routing and caching (runs before this change).
# The same reservation for every engine (the baselines' own default) takes that away.
ENGINE_CPU_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def engine_env(kv_cache_gib: int) -> dict[str, str]:
    """Every set-up's engine environment: vLLM's own KV space, and the same CPU binding."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), **ENGINE_CPU_ENV}


def placement(kv_cache_gib: int) -> dict:
    """LLMConfig options that put one engine per simulated node on CPU."""
    return {"accelerator_config": {"kind": "cpu"},
            "placement_group_config": {"bundles": [{"CPU": 1, ENGINE_SLOT: 1}]},
            "runtime_env": {"env_vars": engine_env(kv_cache_gib)}}


def baseline_config(setup: str, model_source: str, model_id: str, shape: EngineShape,
                    num_replicas: int):
    """The LLMConfig of a baseline set-up (kv-aware, prefix, pow2): vLLM's own cache only."""
    from ray.serve.llm import LLMConfig

    from cluster.serving.app import ROUTERS

    routers = {"kv-aware": KV_AWARE_ROUTER, "prefix": ROUTERS["prefix"], "pow2": ROUTERS["pow2"]}
    options = placement(1)
    if setup == "kv-aware":
        options["server_cls"] = PORTED_SERVER
        options["runtime_env"]["env_vars"].update(DIRECT_STREAMING_ENV)
    deployment = {"num_replicas": num_replicas, "ray_actor_options": {"num_cpus": 0},
                  "request_router_config": {"request_router_class": routers[setup]}}
    return LLMConfig(model_loading_config={"model_id": model_id, "model_source": model_source},
                     engine_kwargs=shape.engine_kwargs(), deployment_config=deployment,
                     **options)


def uses_service(setup: str) -> bool:
    """Whether the set-up's engines run RaykvConnector (the run starts raykv's service)."""
    return setup.startswith("raykv") or setup == "kv-aware-raykv"


def kv_aware_raykv_config(model_source: str, model_id: str, shape: EngineShape,
                          num_replicas: int, ray_address: str):
    """kv-aware's LLMConfig with RaykvConnector on its engines (the running service at
    `ray_address`): Ray's KVAwareRouter over vLLM's own cache, with no hit from a router,
    so the connector looks each request up itself (lookup_worth.py decides)."""
    from cluster.serving.vllm_app import kv_transfer_config

    config = baseline_config("kv-aware", model_source, model_id, shape, num_replicas)
    config.engine_kwargs = {**config.engine_kwargs,
                            "kv_transfer_config": kv_transfer_config(model_id, "default",
                                                                     ray_address)}
    return config


def kv_aware_raykv_app(model_source: str, model_id: str, shape: EngineShape,
                       num_replicas: int):
    """kv-aware's app (direct streaming, Ray's KVAwareRouter) over engines that run
    RaykvConnector on the running service (kv_aware_raykv_config)."""
    import ray

    return direct_streaming_app(kv_aware_raykv_config(
        model_source, model_id, shape, num_replicas, ray.get_runtime_context().gcs_address))


def raykv_app(model_source: str, model_id: str, shape: EngineShape, num_replicas: int,
              bundle: dict | None = None, load_mode: str | None = None,
              save_mode: str | None = None, engine_render: bool = True):
    """raykv's set-up: `build_vllm_app`'s app (RaykvConnector, raykv's router over the running
    service, the keyed ingress), its engines placed one per node like the baselines' (or by
    `bundle`, each engine's placement-group bundle); `load_mode`, `save_mode`: the
    connector's `raykv.load_mode` and `raykv.save_mode` (None: its defaults);
    `engine_render` false: the router keys with the tokenizer's own template and hands the
    engine no ids (cluster/serving/engine_tokens.py)."""
    import ray
    from ray.serve.llm import build_openai_app

    from cluster.api import running_config
    from cluster.serving.vllm_app import VllmAppArgs, keyed_ingress, llm_config, router_settings

    page_tokens = running_config().page_tokens
    router, router_kwargs = router_settings("raykv", model_source, model_id, "default",
                                            "float32", page_tokens)
    if not engine_render:
        router_kwargs["prompt_keys"]["renderer"] = None
    args = VllmAppArgs(model_source, model_id, "default", num_replicas, router, router_kwargs,
                       shape.engine_kwargs())
    config = llm_config(args, ray.get_runtime_context().gcs_address)
    config.placement_group_config = {"bundles": [bundle]} if bundle \
        else placement(1)["placement_group_config"]
    config.runtime_env = {**(config.runtime_env or {}),
                          "env_vars": {**(config.runtime_env or {}).get("env_vars", {}),
                                       **engine_env(1)}}
    extra = config.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]
    for name, mode in (("raykv.load_mode", load_mode), ("raykv.save_mode", save_mode)):
        if mode is not None:
            extra[name] = mode
    return build_openai_app({"llm_configs": [config], "ingress_cls_config": keyed_ingress(args)})


def raykv_direct_app(model_source: str, model_id: str, shape: EngineShape, num_replicas: int):
    """raykv's set-up with direct streaming (`build_direct_vllm_app`): the same engines,
    connector and router as `raykv_app`, HAProxy sending each request straight to the replica
    raykv's router picked."""
    from cluster.api import running_config
    from cluster.serving.vllm_app import VllmAppArgs, build_direct_vllm_app, router_settings

    page_tokens = running_config().page_tokens
    router, router_kwargs = router_settings("raykv", model_source, model_id, "default",
                                            "float32", page_tokens)
    args = VllmAppArgs(model_source, model_id, "default", num_replicas, router, router_kwargs,
                       shape.engine_kwargs())
    return build_direct_vllm_app(args, placement=placement(1)["placement_group_config"])


def direct_streaming_app(config):
    """Ray Serve LLM's app for `config` with direct streaming on, as
    RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1 at import would build it (the builder reads it once;
    this process builds the other set-ups without it)."""
    from unittest import mock

    from ray.llm._internal.serve.core.ingress import builder
    from ray.serve.llm import build_openai_app

    with mock.patch.object(builder, "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING", True):
        return build_openai_app({"llm_configs": [config]})
