"""The manifests run vLLM on GPUs in bf16, start raykv alike from the head and from the Serve
apps (so the order they come up in never matters), and run Ray with token authentication."""

from __future__ import annotations

import typer

from tests.manifests._manifests import (
    MANIFESTS,
    _exec_commands,
    cluster_specs,
    has_gpu,
    invocations,
    of_kind,
    pod_groups,
    serve_files,
)

AUTH_SECRET = "raykv-ray-auth"


def _start_config(argv: list[str]):
    """The CacheConfig a `raykv start ...` command line builds."""
    from cluster.tools.cli import app
    from cluster.tools.ops_cli import start_config

    command = typer.main.get_command(app).commands["start"]
    return start_config(command.make_context("raykv start", argv[2:]).params)


def _head_starts() -> dict[str, list[str]]:
    """RayService name -> the argv of the `raykv start` its head runs (its postStart hook)."""
    starts = {}
    for _, doc in of_kind("RayService"):
        head = doc["spec"]["rayClusterConfig"]["headGroupSpec"]
        (argv,) = [argv for shell in _exec_commands(head)
                   for argv in invocations(shell, "raykv") if argv[1] == "start"]
        starts[doc["metadata"]["name"]] = argv
    return starts


def test_the_vllm_service_runs_vllm_on_gpus_in_bf16():
    from cluster.serving.vllm_app import VllmAppArgs, VllmBuildArgs

    (app,) = serve_files()["vllm-app.yaml"]["applications"]
    args = VllmBuildArgs.model_validate(app["args"])
    assert args.accelerator == "gpu"
    engine = VllmAppArgs(args.model_source, "m", accelerator=args.accelerator,
                         engine_kwargs=args.engine_kwargs)
    assert engine.dtype == "bfloat16"
    (_, service), = [(n, d) for n, d in of_kind("RayService")
                     if d["metadata"]["name"] == "raykv-vllm"]
    groups = pod_groups(service["spec"]["rayClusterConfig"])
    assert any(has_gpu(pod) for _, _, pod in groups[1:]), "no GPU worker group runs vLLM"


def test_serve_apps_start_raykv_as_the_head_does():
    from cluster import CacheConfig

    files = {"raykv-serve": "raykv-app.yaml", "raykv-vllm": "vllm-app.yaml"}
    starts = _head_starts()
    assert sorted(starts) == sorted(files)
    for name, argv in starts.items():
        (app,) = serve_files()[files[name]]["applications"]
        cache = CacheConfig(**(app["args"].get("cache") or {}))
        assert cache == _start_config(argv), f"{name}: the app would start raykv otherwise"


def test_every_kuberay_cluster_runs_ray_with_token_auth():
    for label, spec in cluster_specs():
        assert spec.get("authOptions") == {"mode": "token", "secretName": AUTH_SECRET}, label
    readme = (MANIFESTS / "README.md").read_text()
    assert f"kubectl create secret generic {AUTH_SECRET}" in readme
