"""`raykv serve`: the cache service and the Serve app (OpenAI API on port 8000), blocking."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Annotated, Literal

import typer
from rich.console import Console

Router = Literal["raykv", "pow2", "prefix"]
Engine = Literal["raykv", "vllm"]


def serve_command(
    model: Annotated[str, typer.Option(help="model preset the engines run (random weights)")]
    = "small-llama",
    replicas: Annotated[int | None, typer.Option(help="engine replicas (default: one per kv "
                                                       "node)")] = None,
    router: Annotated[Router, typer.Option(help="request router: raykv's KV-aware one, Serve's "
                                                "power-of-two, or Ray Serve LLM's prefix tree")]
    = "raykv",
    engine: Annotated[Engine, typer.Option(help="raykv's transformers engine, or vLLM through "
                                                "Ray Serve LLM (needs the vllm extra)")] = "raykv",
    host: Annotated[str, typer.Option(help="HTTP bind address; any but a loopback one needs "
                                           "API keys (RAYKV_API_KEYS)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port")] = 8000,
    address: Annotated[str | None, typer.Option(help="Ray cluster address (default: "
                                                     "RAY_ADDRESS, else a local Ray)")] = None,
    admission: Annotated[str | None, typer.Option(
        help='the admission gate as JSON, e.g. \'{"max_in_flight": 16, "max_queued": 32, '
             '"tenants": {"acme": {"rate_per_s": 5, "priority": "low"}}}\'')] = None,
) -> None:
    """Start the cache service and the Serve app on the current (or a local) Ray cluster and
    serve OpenAI's /v1/completions, /v1/chat/completions and /v1/models until interrupted."""
    import ray
    from ray import serve

    from cluster.api import _ensure_ray
    from cluster.core.config import CacheConfig
    from cluster.serving.access import KeysRequired

    console = Console()
    _check_bind(engine, host)
    if address:
        os.environ["RAY_ADDRESS"] = address
    _ensure_ray(CacheConfig())
    serve.start(http_options={"host": host, "port": port},
                logging_config={"log_level": logging.WARNING})
    args = {"model": model, "replicas": replicas, "router": router}
    if admission:
        args["admission"] = json.loads(admission)
    try:
        app = _build(engine, args)
    except KeysRequired as error:  # e.g. namespaces besides the default, and no keys
        serve.shutdown()
        ray.shutdown()
        raise typer.BadParameter(str(error)) from None
    console.print(f"raykv: deploying {model} ({engine} engine, {router} router) ...")
    serve.run(app, name="raykv", route_prefix="/")
    console.print(f"[bold]serving[/] OpenAI API at http://{host}:{port}/v1 "
                  f"(models: {model}); Ctrl-C to stop")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        console.print("stopping")
    finally:
        serve.shutdown()
        ray.shutdown()


def _check_bind(engine: Engine, host: str) -> None:
    """Refuse a non-loopback --host before anything starts: raykv's app needs API keys
    there, and the vLLM app (Ray Serve LLM's ingress) takes none."""
    from cluster.serving.access import (
        Access,
        api_keys_from_env,
        is_loopback,
        require_keys_for_bind,
    )

    if is_loopback(host):
        return
    if engine == "vllm":
        raise typer.BadParameter(f"{host!r} is not a loopback address, and the vLLM engine's "
                                 "app takes no API keys: serve it on 127.0.0.1",
                                 param_hint="--host")
    try:
        require_keys_for_bind(Access.of(api_keys_from_env()), host)
    except ValueError as error:  # KeysRequired, or RAYKV_API_KEYS malformed
        raise typer.BadParameter(str(error), param_hint="--host") from None


def _build(engine: Engine, args: dict):
    if engine == "raykv":
        from cluster.serving.app import build_app

        return build_app(args)
    try:
        import vllm  # noqa: F401  (vLLM's CPU build lives in its own venv: make test-vllm)
    except ImportError:
        raise typer.BadParameter("the vLLM engine needs the vllm extra: run raykv from "
                                 ".venv-vllm (`make test-vllm` builds it)",
                                 param_hint="--engine") from None
    from cluster.serving.model_dir import save_model_dir
    from cluster.serving.vllm_app import build_app

    model_dir = save_model_dir(os.path.join("out", "models", args["model"]), args["model"])
    return build_app({"model_source": os.path.abspath(model_dir), "model_id": args["model"],
                      "router": args["router"], "replicas": args["replicas"] or 1})
