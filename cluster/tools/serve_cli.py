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
    host: Annotated[str, typer.Option(help="HTTP bind address")] = "127.0.0.1",
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

    console = Console()
    if address:
        os.environ["RAY_ADDRESS"] = address
    _ensure_ray(CacheConfig())
    serve.start(http_options={"host": host, "port": port},
                logging_config={"log_level": logging.WARNING})
    args = {"model": model, "replicas": replicas, "router": router}
    if admission:
        args["admission"] = json.loads(admission)
    app = _build(engine, args)
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
