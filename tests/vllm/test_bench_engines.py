"""`raykv bench vllm-serve`: raykv's engines and every baseline's get the same CPU binding
(vLLM reserves one more core for an engine with a KV connector; on 2 cores that gave raykv's
engines both cores and the baselines' engines one)."""

from __future__ import annotations

import os
from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this "
                                   "tier in .venv-vllm")

import ray  # noqa: E402

import cluster.serving.app  # noqa: E402,F401 (its Serve ingress is pickled at import: before the mocks)
from cluster.core.config import CacheConfig  # noqa: E402
from cluster.serving.model_dir import save_model_dir  # noqa: E402
from cluster.tools.bench import vllm_serve_setups as setups  # noqa: E402


def test_raykvs_engines_and_the_baselines_reserve_the_same_cores(tmp_path):
    model_dir = save_model_dir(os.path.join(tmp_path, "small-llama"))
    built = {}
    with mock.patch("cluster.api.running_config", return_value=CacheConfig(page_tokens=32)), \
            mock.patch.object(ray, "get_runtime_context",
                              lambda: SimpleNamespace(gcs_address="127.0.0.1:6379")), \
            mock.patch("ray.serve.llm.build_openai_app", side_effect=built.update):
        setups.raykv_app(model_dir, "small-llama", setups.EngineShape(), 3)
    (raykv,) = built["llm_configs"]
    assert raykv.engine_kwargs["kv_transfer_config"]["kv_connector"] == "RaykvConnector"
    envs = {"raykv": raykv.runtime_env["env_vars"]}
    for name in ("kv-aware", "prefix", "pow2"):
        config = setups.baseline_config(name, model_dir, "small-llama", setups.EngineShape(), 3)
        envs[name] = config.runtime_env["env_vars"]
    for name, env in envs.items():
        assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1", name
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "1", name


def test_kv_aware_with_raykvs_connector_differs_from_kv_aware_only_in_the_connector(tmp_path):
    """The extra set-up kv-aware-raykv: Ray's router, server class and engines as kv-aware's,
    RaykvConnector added on the running service; it starts raykv's service, kv-aware does not."""
    model_dir = save_model_dir(os.path.join(tmp_path, "small-llama"))
    shape = setups.EngineShape()
    plain = setups.baseline_config("kv-aware", model_dir, "small-llama", shape, 3)
    both = setups.kv_aware_raykv_config(model_dir, "small-llama", shape, 3, "127.0.0.1:6379")
    transfer = both.engine_kwargs.pop("kv_transfer_config")
    assert transfer["kv_connector"] == "RaykvConnector"
    assert transfer["kv_connector_extra_config"]["raykv.ray_address"] == "127.0.0.1:6379"
    assert both.engine_kwargs == plain.engine_kwargs
    assert both.deployment_config == plain.deployment_config
    assert both.server_cls is plain.server_cls
    assert both.server_cls.__name__ == setups.PORTED_SERVER.rsplit(":", 1)[1]
    assert both.runtime_env == plain.runtime_env
    assert setups.uses_service("kv-aware-raykv") and setups.uses_service("raykv-direct")
    assert not setups.uses_service("kv-aware")


def test_the_ported_server_changes_reach_the_engine_config_the_builder_cached(tmp_path):
    """The builder makes and caches the engine config (placement reads it) and the engine
    starts from that cache: the ports and kv-aware-raykv's rates file must land there too
    (assigning engine_kwargs lost the rates file in the first run)."""
    from cluster.tools.bench.vllm_serve_server import port_config

    model_dir = save_model_dir(os.path.join(tmp_path, "small-llama"))
    config = setups.kv_aware_raykv_config(model_dir, "small-llama", setups.EngineShape(), 3,
                                          "127.0.0.1:6379")
    config.update_engine_kwargs(kv_events_config={"enable_kv_cache_events": True,
                                                  "publisher": "zmq",
                                                  "endpoint": "tcp://*:5557",
                                                  "replay_endpoint": "tcp://*:6557"})
    cached = config.get_engine_config()
    port_config(config, 1, (7001, 7002, 7003), "/tmp/rates/engine.json")
    for kwargs in (config.engine_kwargs, cached.engine_kwargs):
        assert kwargs["kv_events_config"]["endpoint"] == "tcp://*:7000"  # Ray adds the rank
        assert kwargs["kv_events_config"]["replay_endpoint"] == "tcp://*:7001"
        extra = kwargs["kv_transfer_config"]["kv_connector_extra_config"]
        assert extra["raykv.rates_file"] == "/tmp/rates/engine.json"
    assert config.experimental_configs[setups.KV_TOKEN_PORT_BASE_KEY] == 7002
    plain = setups.baseline_config("kv-aware", model_dir, "small-llama", setups.EngineShape(), 3)
    plain.get_engine_config()
    port_config(plain, 0, (7001, 7002, 7003), "/tmp/rates/other.json")
    assert "kv_transfer_config" not in plain.get_engine_config().engine_kwargs  # no connector
