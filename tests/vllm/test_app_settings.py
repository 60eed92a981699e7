"""The vLLM Serve app's settings against a running raykv service (no engine is started):
page size and namespace come from the service, dtype and resources from the accelerator."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this "
                                   "tier in .venv-vllm")

import ray  # noqa: E402

from cluster import CacheConfig, start, stop  # noqa: E402
from cluster.serving import vllm_app  # noqa: E402

MODEL_ID = "small-llama"
# What `raykv start` runs with by default: pages of 256 tokens (vLLM's CPU blocks hold 128).
SERVICE_PAGE_TOKENS = 256


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    ray.init(address="local", num_cpus=2, resources={"kv_node": 1}, include_dashboard=False,
             logging_level="WARNING")
    disk_dir = str(tmp_path_factory.mktemp("disk"))
    start(CacheConfig(page_tokens=SERVICE_PAGE_TOKENS, host_bytes=64 << 20, device_bytes=0,
                      disk_bytes=0, disk_dir=disk_dir))
    yield
    stop()
    ray.shutdown()


@pytest.fixture
def built(monkeypatch):
    """The LLMConfig each build_app call hands to Ray Serve LLM's build_openai_app."""
    configs = []
    monkeypatch.setattr("ray.serve.llm.build_openai_app",
                        lambda builder: configs.extend(builder["llm_configs"]) or "app")
    return configs


def _router_keys(config) -> dict:
    return config.deployment_config["request_router_config"]["request_router_kwargs"][
        "prompt_keys"]


def test_the_app_keys_pages_as_the_running_service_does(service, model_dir, built, caplog):
    vllm_app.build_app({"model_source": model_dir, "model_id": MODEL_ID, "router": "raykv"})
    (config,) = built
    assert _router_keys(config)["page_tokens"] == SERVICE_PAGE_TOKENS
    # Its own cache settings are used only when no service runs: here the running one is
    # adopted, and a warning says so.
    with caplog.at_level(logging.WARNING, logger="raykv"):
        vllm_app.build_app({"model_source": model_dir, "model_id": MODEL_ID,
                            "cache": {"page_tokens": 128}})
    assert _router_keys(built[1])["page_tokens"] == SERVICE_PAGE_TOKENS
    assert "adopted" in caplog.text and f"pages of {SERVICE_PAGE_TOKENS} tokens" in caplog.text


def test_an_unknown_namespace_is_refused_at_build(service, model_dir, built):
    with pytest.raises(ValueError, match="tenant-x"):
        vllm_app.build_app({"model_source": model_dir, "model_id": MODEL_ID,
                            "connector": {"raykv.namespace": "tenant-x"}})
    assert built == []


def test_gpu_runs_bf16_on_gpu_bundles_and_cpu_fits_one_cpu_a_replica(service, model_dir, built):
    vllm_app.build_app({"model_source": model_dir, "model_id": MODEL_ID, "accelerator": "gpu"})
    vllm_app.build_app({"model_source": model_dir, "model_id": MODEL_ID, "replicas": 2})
    gpu, cpu = built
    assert gpu.accelerator_config.kind == "gpu"
    assert gpu.engine_kwargs["dtype"] == "bfloat16"
    assert _router_keys(gpu)["spec"]["dtype"] == "bfloat16"  # the router keys as vLLM stores
    assert gpu.placement_group_config is None  # Ray Serve LLM's GPU bundles: one GPU each
    assert "enforce_eager" not in gpu.engine_kwargs
    assert cpu.accelerator_config.kind == "cpu" and cpu.engine_kwargs["dtype"] == "float32"
    # The replica actor asks for no CPU of its own: its bundle's CPU is its engine's.
    assert cpu.deployment_config["ray_actor_options"] == {"num_cpus": 0}
    assert cpu.placement_group_config == {"bundles": [{"CPU": 1}]}
    args = vllm_app.VllmAppArgs("/m", MODEL_ID, num_replicas=2)
    assert vllm_app.resources_needed(args) == {"CPU": 3}  # 2 engines and the ingress


def test_the_pd_app_runs_both_sides_on_raykv_and_registers_its_shaping(service, model_dir,
                                                                       monkeypatch):
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import (
        KVConnectorBackendFactory,
    )

    from cluster.serving.vllm_pd import RaykvPDBackend, registered_in_cluster

    built = []
    monkeypatch.setattr("ray.serve.llm.build_pd_openai_app",
                        lambda builder: built.append(builder) or "app")
    prefill = vllm_app.VllmAppArgs(model_dir, MODEL_ID)
    with pytest.raises(ValueError, match="same model_id"):
        vllm_app.build_pd_vllm_app(prefill, vllm_app.VllmAppArgs(model_dir, "another"))
    with pytest.raises(ValueError, match="tenant-x"):
        tenant = vllm_app.VllmAppArgs(model_dir, MODEL_ID, namespace="tenant-x")
        vllm_app.build_pd_vllm_app(tenant, tenant)
    assert built == []
    router, kwargs = vllm_app.router_settings("raykv", model_dir, MODEL_ID, "default",
                                              "float32", SERVICE_PAGE_TOKENS)
    decode = vllm_app.VllmAppArgs(model_dir, MODEL_ID, request_router_class=router,
                                  request_router_kwargs=kwargs)
    assert vllm_app.build_pd_vllm_app(prefill, decode) == "app"
    (args,) = built
    sides = args["prefill_config"], args["decode_config"]
    transfers = [side.engine_kwargs["kv_transfer_config"] for side in sides]
    assert transfers[0] == transfers[1] and transfers[0]["kv_role"] == "kv_both"
    assert transfers[0]["kv_connector"] == "RaykvConnector"
    assert "request_router_config" not in sides[0].deployment_config
    assert sides[1].deployment_config["request_router_config"]["request_router_class"] == router
    assert args["ingress_cls_config"]["ingress_extra_kwargs"]["namespace"] == "default"
    # Ray Serve LLM finds raykv's P/D shaping by the connector's name, in every process.
    assert KVConnectorBackendFactory.get_backend_class("RaykvConnector") is RaykvPDBackend
    assert registered_in_cluster()
