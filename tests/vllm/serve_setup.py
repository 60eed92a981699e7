"""The Serve set-up that the OpenAI-app tests share (test_serve_app.py in process, and
direct_app_child.py in a network namespace of its own): a local Ray with one kv node, Serve on
a free loopback port, and the app's arguments with raykv's router."""

from __future__ import annotations

from cluster.tools.redis_server import free_port

MODEL_ID = "small-llama"
PAGE_TOKENS = 128


def start_local_serve() -> int:
    """A local Ray (4 CPUs, one kv node) and Serve on a free 127.0.0.1 port; returns the port."""
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=4, resources={"kv_node": 1}, include_dashboard=False,
             logging_level="WARNING")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def raykv_app_args(model_dir: str, **extra):
    """The app's arguments with raykv's KV-aware router, keying text prompts as the connector
    keys vLLM's pages, and vLLM's own prefix cache off: every cached token reported came from
    raykv."""
    from cluster.serving.vllm_app import VllmAppArgs, router_settings

    router, router_kwargs = router_settings("raykv", model_dir, MODEL_ID, "default", "float32",
                                            page_tokens=PAGE_TOKENS)
    return VllmAppArgs(model_source=model_dir, model_id=MODEL_ID, request_router_class=router,
                       request_router_kwargs=router_kwargs,
                       engine_kwargs={"enable_prefix_caching": False}, **extra)


def cache_config():
    """The service's settings: pages of PAGE_TOKENS in 256 MiB of host memory, no disk."""
    from cluster import CacheConfig

    return CacheConfig(page_tokens=PAGE_TOKENS, host_bytes=256 << 20, device_bytes=0,
                       disk_bytes=0)
