"""Ray Serve LLM's prefill/decode disaggregated app over raykv (`build_pd_vllm_app`), answering
an OpenAI client: the prefill replica puts each prompt's pages into raykv, the decode replica
loads them (vLLM's own prefix cache is off, so every cached token it reports came from raykv),
and the greedy text is the plain app's."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this "
                                   "tier in .venv-vllm")

import openai  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from cluster import CacheConfig, stop  # noqa: E402
from cluster.serving.vllm_app import (  # noqa: E402
    VllmAppArgs,
    build_pd_vllm_app,
    build_vllm_app,
    router_settings,
)
from cluster.serving.vllm_pd import registered_in_cluster  # noqa: E402
from cluster.tools.redis_server import free_port  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

MODEL_ID = "small-llama"
PREFIX_BYTES = 700  # byte tokens: 5 full blocks of 128, and a partial one
START_TIMEOUT_S = 420
# A plain app beside it, its pages in another raykv namespace: it computes every prompt itself.
PLAIN_NAMESPACE = "plain"


@pytest.fixture(scope="module")
def clients(model_dir):
    # Prefill, decode and the plain app's replica: one CPU each; two ingresses: one each.
    ray.init(address="local", num_cpus=5, resources={"kv_node": 1}, include_dashboard=False,
             logging_level="WARNING")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cache = CacheConfig(page_tokens=128, host_bytes=256 << 20, device_bytes=0, disk_bytes=0,
                        namespaces=("default", PLAIN_NAMESPACE))
    engine = {"enable_prefix_caching": False}
    # raykv's KV-aware router on the decode deployment (its cut travels to the decode).
    router, router_kwargs = router_settings("raykv", model_dir, MODEL_ID, "default", "float32",
                                            page_tokens=128)
    prefill = VllmAppArgs(model_source=model_dir, model_id=MODEL_ID, engine_kwargs=engine)
    decode = VllmAppArgs(model_source=model_dir, model_id=MODEL_ID, engine_kwargs=engine,
                         request_router_class=router, request_router_kwargs=router_kwargs)
    serve.run(build_pd_vllm_app(prefill, decode, cache), blocking=False, name="pd",
              route_prefix="/pd")
    # The decode replicas shape with raykv's backend, read from this cluster's store (the
    # test process registered it in an earlier module's cluster, too).
    assert registered_in_cluster()
    plain = VllmAppArgs(model_source=model_dir, model_id=MODEL_ID, namespace=PLAIN_NAMESPACE,
                        engine_kwargs=engine)
    serve.run(build_vllm_app(plain), blocking=False, name="plain", route_prefix="/plain")
    made = {name: openai.OpenAI(base_url=f"http://127.0.0.1:{port}/{name}/v1",
                                api_key="unused", max_retries=0, timeout=120)
            for name in ("pd", "plain")}
    for client in made.values():
        wait_until(lambda c=client: _serves(c), START_TIMEOUT_S, "the app to serve the model",
                   period_s=2.0)
    yield made
    serve.shutdown()
    stop()
    ray.shutdown()


def _serves(client) -> bool:
    try:
        return any(model.id == MODEL_ID for model in client.models.list().data)
    except openai.OpenAIError:
        return False


def _complete(client, prompt: str):
    return client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=8,
                                     temperature=0)


def test_decode_replicas_load_the_prefill_s_pages_and_answer_as_the_plain_app(clients):
    prefix = "".join(chr(97 + (i * 7) % 26) for i in range(PREFIX_BYTES))
    for question in (" first question", " second question"):
        reply = _complete(clients["pd"], prefix + question)
        details = reply.usage.prompt_tokens_details
        # The first: the prefill's pages, handed over through raykv; the second: the
        # prefix from raykv on both sides, the rest from the prefill.
        assert details is not None and details.cached_tokens >= 5 * 128, reply.usage
        assert reply.usage.prompt_tokens > PREFIX_BYTES
        plain = _complete(clients["plain"], prefix + question)
        assert reply.choices[0].text == plain.choices[0].text, question
        assert reply.usage.prompt_tokens == plain.usage.prompt_tokens
