"""Ray Serve LLM's OpenAI app, its vLLM engine on RaykvConnector: the second request with the
same long prefix is served from raykv's pages, and the response says so."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this "
                                   "tier in .venv-vllm")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from cluster import ModelSpec, connect, stop  # noqa: E402
from cluster.serving.vllm_app import VllmAppArgs, build_vllm_app  # noqa: E402
from cluster.serving.vllm_plan import LOADED_KEY, UNFILLED_KEY  # noqa: E402
from tests.vllm.serve_setup import (  # noqa: E402
    MODEL_ID,
    cache_config,
    raykv_app_args,
    start_local_serve,
)
from tests.waiting import wait_until  # noqa: E402

PREFIX_BYTES = 700  # byte tokens: 5 full blocks of 128, and a partial one
START_TIMEOUT_S = 300
SAVE_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def base_url(model_dir):
    port = start_local_serve()
    serve.run(build_vllm_app(raykv_app_args(model_dir), cache_config()), blocking=False,
              name="vllm")
    url = f"http://127.0.0.1:{port}"
    _wait_ready(url)
    yield url
    serve.shutdown()
    stop()
    ray.shutdown()


def _wait_ready(url: str) -> None:
    import time

    deadline_s = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline_s:
        try:
            models = _request(url + "/v1/models")
            if any(m["id"] == MODEL_ID for m in models.get("data", [])):
                return
        except OSError:
            pass
        time.sleep(2)
    raise AssertionError(f"the app did not serve {MODEL_ID} within {START_TIMEOUT_S} s")


def _request(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _complete(url: str, prompt: str) -> dict:
    return _request(url + "/v1/completions", {"model": MODEL_ID, "prompt": prompt,
                                              "max_tokens": 4, "temperature": 0,
                                              "return_token_ids": True})


def test_second_request_loads_the_prefix_from_raykv(base_url):
    prefix = "".join(chr(97 + (i * 7) % 26) for i in range(PREFIX_BYTES))
    first = _complete(base_url, prefix + " first question")
    assert first["usage"]["prompt_tokens"] > PREFIX_BYTES
    # The connector saves in the background, off the response's path: raykv holds the 5 full
    # blocks under the model's name once that put lands (any client of the geometry finds them).
    client = connect(ModelSpec(MODEL_ID, 4, 2, 64, "float32"))
    prompt_ids = first["choices"][0]["prompt_token_ids"]
    wait_until(lambda: client.lookup(prompt_ids) == 5 * 128, SAVE_TIMEOUT_S,
             "the first request's pages in raykv")
    second = _complete(base_url, prefix + " second question")
    cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    # The second request loaded them (vLLM's own prefix cache is off).
    assert cached is not None and cached >= 5 * 128, second["usage"]
    # and the connector says so in the response: all it was to load, filled
    said = second.get("kv_transfer_params") or {}
    assert said.get(LOADED_KEY, 0) >= 5 * 128 and said.get(UNFILLED_KEY) == 0, said


def test_tokenize_and_detokenize_answer(base_url):
    """vLLM's /tokenize and /detokenize through the app (Ray Serve LLM on vLLM 0.32 answered
    400, "This model does not support the 'tokenization' task", before RaykvLLMServer gave
    its engine vLLM's tokenization server): the ids are the ones the engine prefills."""
    text = "hello raykv"
    tokens = _request(base_url + "/tokenize", {"model": MODEL_ID, "prompt": text})
    first = _complete(base_url, text)
    assert tokens["tokens"] == first["choices"][0]["prompt_token_ids"]
    assert tokens["count"] == len(tokens["tokens"]) == first["usage"]["prompt_tokens"]
    back = _request(base_url + "/detokenize", {"model": MODEL_ID, "tokens": tokens["tokens"]})
    assert back["prompt"] == text


def test_with_raykv_s_router_each_replica_advertises_its_engine_s_kv_events(base_url):
    """RaykvLLMServer turned its engine's KV events on, relayed on ports the OS picked behind
    CURVE, and tells routers where and with which keys (record_routing_stats, as Serve's
    controller polls it): a replay asked with those keys is answered by the engine, one asked
    without them is not."""
    import zmq
    from ray._private.state import actors

    from cluster.serving.events_relay import CurveKeys
    from cluster.serving.router import ENGINE_EVENTS

    names = [a["Name"] for a in actors().values() if a.get("State") == "ALIVE"
             and "RaykvLLMServer" in a.get("ActorClassName", "")]
    assert len(names) == 1, names
    replica = ray.get_actor(names[0], namespace="serve")
    advertised = ray.get(replica.record_routing_stats.remote(), timeout=30)[ENGINE_EVENTS]
    assert advertised["endpoint"].startswith("tcp://") and advertised["epoch"]
    assert not advertised["endpoint"].endswith(":0") and advertised["replay_endpoint"]
    keys = CurveKeys.of(advertised["curve"])
    holder, outsider = (zmq.Context.instance().socket(zmq.DEALER) for _ in range(2))
    try:
        keys.apply(holder)
        for sock in (holder, outsider):
            sock.linger = 0
            sock.connect(advertised["replay_endpoint"])
        holder.send_multipart((b"", (0).to_bytes(8, "big")))
        assert holder.poll(10_000), "no replay through the replica's relay"
        while holder.recv_multipart()[2] != (-1).to_bytes(8, "big", signed=True):
            assert holder.poll(10_000)  # its batches, then the end marker
        try:  # refused by the relay: no peer to queue a request for
            outsider.send_multipart((b"", (0).to_bytes(8, "big")), zmq.NOBLOCK)
        except zmq.Again:
            pass
        assert not outsider.poll(2_000), "the relay answered one without its keys"
    finally:
        holder.close()
        outsider.close()


def test_each_replica_publishes_its_engine_s_measured_rates(base_url):
    """The engine core's RaykvConnector measured its loads (the second request above loaded
    its prefix from raykv's host tier) and its prefill, and the replica publishes them to
    routers beside its events; `raykv status` shows them."""
    from ray._private.state import actors

    from cluster.tools.rates_status import routing_rates

    names = [a["Name"] for a in actors().values() if a.get("State") == "ALIVE"
             and "RaykvLLMServer" in a.get("ActorClassName", "")]
    replica = ray.get_actor(names[0], namespace="serve")
    prompt = "".join(chr(97 + (i * 11) % 26) for i in range(PREFIX_BYTES))
    _complete(base_url, prompt + " one")  # a prefill of 700 tokens, the rates file rewritten

    def published() -> dict:
        return ray.get(replica.record_routing_stats.remote(), timeout=30).get("rates") or {}

    wait_until(lambda: published().get("paths", {}).get("host")
               and published().get("prefill_samples", 0) >= 2, SAVE_TIMEOUT_S,
               "the replica's measured rates", period_s=0.5)
    rates = published()
    assert rates["page_tokens"] == 128 and rates["page_bytes"] > 0
    assert rates["prefill_tokens_per_s"] > 0 and rates["busy_s_per_request"] > 0
    host_bytes_per_s, _, num_samples = rates["paths"]["host"]
    assert host_bytes_per_s > 0 and num_samples >= 1
    shown = routing_rates()
    assert names[0] in shown["replicas"]
    assert shown["pooled"]["paths"]["host"]["num_samples"] >= 1


def test_the_router_keys_a_chat_with_the_engine_s_own_ids_and_hands_them_over(base_url,
                                                                              model_dir):
    """raykv's router renders a chat as the engine does (vLLM's renderer, configured from the
    engine's arguments: cluster/serving/engine_tokens.py) and hands the ids over: the engine
    prefilled them, and they are the ids it renders itself (an echo, for which vLLM takes no
    ids ready-made). A completion's likewise (its echo keeps its text)."""
    import asyncio
    from types import SimpleNamespace

    from cluster.serving.engine_tokens import EngineTokens
    from cluster.serving.vllm_app import llm_config

    messages = [{"role": "system", "content": "answer briefly"},
                {"role": "user", "content": "".join(chr(97 + i % 26) for i in range(300))}]
    body = {"model": MODEL_ID, "messages": messages, "max_tokens": 2, "temperature": 0,
            "return_token_ids": True}
    handed = _request(base_url + "/v1/chat/completions", body)
    own = _request(base_url + "/v1/chat/completions", {**body, "echo": True})
    router = llm_config(raykv_app_args(model_dir)).deployment_config["request_router_config"]
    spec = router["request_router_kwargs"]["prompt_keys"]["renderer"]
    assert spec["model_source"] == model_dir and "kv_transfer_config" not in spec[
        "engine_kwargs"]

    async def render(request):
        tokens = EngineTokens(spec)
        await tokens.token_ids(request)  # starts the renderer's build
        for _ in range(600):
            if (ids := await tokens.token_ids(request)) is not None:
                return ids
            await asyncio.sleep(0.1)
        raise AssertionError("vLLM's renderer was not built in 60 s")

    rendered = asyncio.run(render(SimpleNamespace(model=MODEL_ID, messages=messages,
                                                  kv_transfer_params=None)))
    assert len(rendered) > 300
    assert rendered == handed["prompt_token_ids"] == own["prompt_token_ids"]
    assert handed["choices"][0]["message"]["content"] == own["choices"][0]["message"][
        "content"]
    # A completion's ids are handed over as its prompt; an echo's prompt stays text.
    prompt = "".join(chr(97 + i % 26) for i in range(200))
    completed = _complete(base_url, prompt)["choices"][0]
    echoed = _request(base_url + "/v1/completions", {
        "model": MODEL_ID, "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "return_token_ids": True, "echo": True})["choices"][0]
    rendered = asyncio.run(render(SimpleNamespace(model=MODEL_ID, prompt=prompt)))
    assert rendered == completed["prompt_token_ids"] == echoed["prompt_token_ids"]


def test_the_engine_prefills_the_ids_the_router_handed_over(base_url, model_dir):
    """A second app whose router renders with another chat template than its engine's: the
    engine prefilled the router's ids (the byte tokenizer's ids are the text's bytes), so it
    took them ready-made and did not render the chat itself."""
    from cluster.serving.engine_tokens import renderer_spec
    from cluster.serving.vllm_app import llm_config

    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    args = raykv_app_args(model_dir)
    engine = llm_config(args).engine_kwargs
    args.request_router_kwargs["prompt_keys"]["renderer"] = renderer_spec(
        model_dir, MODEL_ID, {**engine, "chat_template": template})
    serve.run(build_vllm_app(args), blocking=False, name="handover", route_prefix="/handover")
    try:
        _wait_ready(base_url + "/handover")
        body = {"model": MODEL_ID, "max_tokens": 1, "temperature": 0, "return_token_ids": True,
                "messages": [{"role": "user", "content": "hello there"}]}
        # The router builds its renderer in the background: the first requests go unrendered.
        wait_until(lambda: bytes(_request(base_url + "/handover/v1/chat/completions", body)[
            "prompt_token_ids"]) == b"<<hello there>>", START_TIMEOUT_S,
            "the engine prefilling the router's rendering", period_s=1.0)
        # An echo is rendered by the engine itself (vLLM takes no ids for it): its template.
        own = _request(base_url + "/handover/v1/chat/completions", {**body, "echo": True})
        assert b"hello there" in bytes(own["prompt_token_ids"])
        assert bytes(own["prompt_token_ids"]) != b"<<hello there>>"
    finally:
        serve.delete("handover")


def test_llm_config_runs_the_connector_on_cpu_with_a_chosen_router(model_dir):
    from cluster.serving.vllm_app import llm_config
    from cluster.serving.vllm_events_server import RaykvLLMServer, TokenizingLLMServer

    # Any RequestRouter by import path (Serve imports it: it must exist); raykv's KV-aware
    # router will be "cluster.serving.router:RaykvRouter".
    chosen = "ray.serve.llm.request_router:PrefixCacheAffinityRouter"
    args = VllmAppArgs(model_source="/models/m", model_id="m", namespace="tenant-a",
                       num_replicas=2, request_router_class=chosen,
                       engine_kwargs={"max_model_len": 2048})
    config = llm_config(args, ray_address="127.0.0.1:6379")
    transfer = config.engine_kwargs["kv_transfer_config"]
    assert transfer["kv_connector"] == "RaykvConnector"
    assert transfer["kv_connector_module_path"] == "cluster.serving.vllm_connector"
    assert transfer["kv_connector_extra_config"] == {
        "raykv.namespace": "tenant-a", "raykv.model_name": "m",
        "raykv.ray_address": "127.0.0.1:6379"}
    assert config.engine_kwargs["max_model_len"] == 2048
    assert config.deployment_config["num_replicas"] == 2
    router = config.deployment_config["request_router_config"]
    assert router["request_router_class"] == chosen
    assert config.placement_group_config == {"bundles": [{"CPU": 1}]}
    # vLLM's tokenization server is handed over whatever the router (TokenizingLLMServer;
    # raykv's router's server is one too: test_tokenize_and_detokenize_answer)
    assert config.server_cls is TokenizingLLMServer
    assert issubclass(RaykvLLMServer, TokenizingLLMServer)
    # raykv's router renders prompts as the engine does: the builder gives it the engine's
    # arguments, less the connector's; a caller's own choice (None: the tokenizer's) stays.
    raykv = llm_config(raykv_app_args(model_dir))
    spec = raykv.deployment_config["request_router_config"]["request_router_kwargs"][
        "prompt_keys"]["renderer"]
    assert spec["engine_kwargs"]["enable_prefix_caching"] is False
    assert spec["engine_kwargs"]["dtype"] == "float32" and "kv_transfer_config" not in spec[
        "engine_kwargs"]
    args = raykv_app_args(model_dir)
    args.request_router_kwargs["prompt_keys"]["renderer"] = None
    kept = llm_config(args).deployment_config["request_router_config"]
    assert kept["request_router_kwargs"]["prompt_keys"]["renderer"] is None
    default = llm_config(VllmAppArgs(model_source="/models/m", model_id="m"))
    assert "request_router_config" not in default.deployment_config  # Serve's own router
    with pytest.raises(ValueError, match="accelerator"):
        llm_config(VllmAppArgs(model_source="/m", model_id="m", accelerator="tpu"))
