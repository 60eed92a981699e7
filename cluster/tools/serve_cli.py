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
Accelerator = Literal["cpu", "gpu"]
APP_NAME = "raykv"
POLL_S = 2.0


def serve_command(
    model: Annotated[str, typer.Option(help="model preset the engines run (random weights)")]
    = "small-llama",
    replicas: Annotated[int | None, typer.Option(help="engine replicas (default: one per kv "
                                                       "node; vLLM: 1)")] = None,
    router: Annotated[Router, typer.Option(help="request router: raykv's KV-aware one, Serve's "
                                                "power-of-two, or Ray Serve LLM's prefix tree")]
    = "raykv",
    engine: Annotated[Engine, typer.Option(help="raykv's transformers engine, or vLLM through "
                                                "Ray Serve LLM (needs the vllm extra)")] = "raykv",
    accelerator: Annotated[Accelerator, typer.Option(help="vLLM on its CPU backend (float32) "
                                                          "or on GPUs (bf16)")] = "cpu",
    host: Annotated[str, typer.Option(help="HTTP bind address; any but a loopback one needs "
                                           "API keys (RAYKV_API_KEYS)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port")] = 8000,
    address: Annotated[str | None, typer.Option(help="Ray cluster address (default: "
                                                     "RAY_ADDRESS, else a local Ray)")] = None,
    admission: Annotated[str | None, typer.Option(
        help='the admission gate as JSON, e.g. \'{"max_in_flight": 16, "max_queued": 32, '
             '"tenants": {"acme": {"rate_per_s": 5, "priority": "low"}}}\'')] = None,
    ready_timeout_s: Annotated[float, typer.Option(help="give up (exit 1, with Serve's "
                                                        "reason) when the app is not ready "
                                                        "by then")] = 900.0,
) -> None:
    """Start the cache service and the Serve app on the current (or a local) Ray cluster and
    serve OpenAI's /v1/completions, /v1/chat/completions and /v1/models until interrupted."""
    console = Console()
    _check_bind(host)
    _start_ray(address)
    args = _app_args(model, replicas, router, admission)
    if engine == "vllm":
        args["accelerator"] = accelerator
        _check_fits(_vllm_args(args))  # refused in seconds, not stuck unscheduled
    app = _start_serve(engine, args, host, port)
    console.print(f"raykv: deploying {model} ({engine} engine, {router} router) ...")
    _run_until_interrupted(app, ready_timeout_s, console,
                           f"[bold]serving[/] OpenAI API at http://{host}:{port}/v1 "
                           f"(models: {model}); Ctrl-C to stop")


def _start_ray(address: str | None) -> None:
    """Join the Ray cluster at `address` (else RAY_ADDRESS, else a local one)."""
    from cluster.api import _ensure_ray
    from cluster.core.config import CacheConfig

    if address:
        os.environ["RAY_ADDRESS"] = address
    _ensure_ray(CacheConfig())


def _app_args(model: str, replicas: int | None, router: Router, admission: str | None) -> dict:
    args = {"model": model, "replicas": replicas, "router": router}
    if admission:
        args["admission"] = json.loads(admission)
    return args


def _start_serve(engine: Engine, args: dict, host: str, port: int):
    """Start Serve's HTTP proxy and build the app; a refused build stops Serve and Ray."""
    from ray import serve

    from cluster.serving.access import KeysRequired

    serve.start(http_options={"host": host, "port": port},
                logging_config={"log_level": logging.WARNING})
    try:
        return _build(engine, args)
    except KeysRequired as error:  # e.g. namespaces besides the default, and no keys
        _shutdown()
        raise typer.BadParameter(str(error)) from None


def _run_until_interrupted(app, ready_timeout_s: float, console: Console, serving: str) -> None:
    """Deploy `app`, say `serving` once it is ready, and block until Ctrl-C; then stop."""
    from ray import serve

    try:
        serve._run(app, _blocking=False, name=APP_NAME, route_prefix="/")
        _wait_ready(ready_timeout_s)
        console.print(serving)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        console.print("stopping")
    finally:
        _shutdown()


def _shutdown() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def _vllm_args(args: dict):
    from cluster.serving.vllm_app import VllmAppArgs

    return VllmAppArgs(model_source="", model_id=args["model"],
                       num_replicas=args["replicas"] or 1, accelerator=args["accelerator"])


def _check_fits(app_args) -> None:
    """Exit 1 at once, naming what is needed, when the app cannot be placed on this Ray
    cluster's resources: Serve would otherwise wait for them without end."""
    import ray

    from cluster.serving.vllm_app import INGRESS_CPUS, resources_needed

    needed = resources_needed(app_args)
    have = ray.cluster_resources()
    short = {name: count for name, count in needed.items() if have.get(name, 0) < count}
    if not short:
        return
    lines = [f"{count:g} {name}s (this Ray cluster has {have.get(name, 0):g})"
             for name, count in short.items()]
    raise _refuse(f"the vLLM app needs {', '.join(lines)}: 1 CPU per LLMServer replica "
                  f"({app_args.num_replicas}) and {INGRESS_CPUS} for the OpenAI ingress"
                  + (", 1 GPU per replica" if app_args.accelerator == "gpu" else "")
                  + ". Pass fewer --replicas, or start Ray with more (ray start --num-cpus N).")


def _refuse(message: str) -> typer.Exit:
    Console(stderr=True).print(f"[red]raykv serve:[/] {message}", soft_wrap=True)
    return typer.Exit(code=1)


def _wait_ready(timeout_s: float) -> None:
    """Until Serve reports the app running; exit 1 with Serve's reason when it failed or is
    not running after `timeout_s`."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    deadline_s = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(APP_NAME)
        state = app.status if app else None
        if state == ApplicationStatus.RUNNING:
            return
        if state == ApplicationStatus.DEPLOY_FAILED or time.monotonic() > deadline_s:
            why = "; ".join(f"{name}: {d.message}" for name, d in app.deployments.items()
                            if d.message) if app else "no application"
            raise _refuse(f"the app is not ready ({state}) after {timeout_s:g} s: "
                          f"{app.message if app else ''} {why}")
        time.sleep(POLL_S)


def _check_bind(host: str) -> None:
    """Refuse a non-loopback --host without API keys before anything starts: both apps (raykv's
    and the vLLM one, behind raykv's keyed ingress) need them there."""
    from cluster.serving.access import (
        Access,
        api_keys_from_env,
        is_loopback,
        require_keys_for_bind,
    )

    if is_loopback(host):
        return
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
                      "router": args["router"], "replicas": args["replicas"] or 1,
                      "accelerator": args["accelerator"]})
