"""The Serve app on a 3-node cluster (one engine replica per node), called over real HTTP with
the official OpenAI client: completions, chat, streaming, cached tokens, every error status,
greedy output equal with and without the cache, and a replica killed under load."""

from __future__ import annotations

import concurrent.futures
import json
import time

import openai
import pytest
import ray
import requests
from ray import serve

from cluster import CacheConfig, start
from cluster.serving import tokenizer
from cluster.serving.app import build_app
from cluster.tools.redis_server import free_port
from tests.cluster.conftest import wait_until

MODEL = "tiny-llama"
SYSTEM = "You are the support assistant of a shop that sells kettles and teapots. " * 3


@pytest.fixture(scope="module")
def url(ray_cluster, disk_root):
    start(CacheConfig(page_tokens=16, device_bytes=0, host_bytes=512 * 8192,
                      disk_bytes=4 << 20, disk_dir=disk_root))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    serve.run(build_app({"model": MODEL, "engine_num_cpus": 0, "max_ongoing_requests": 2,
                         "max_queued_requests": 6, "max_context_tokens": 2048}),
              name="raykv", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, user: str, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": user}], **kwargs)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_and_cached_tokens_on_a_repeated_prefix(client):
    first = client.completions.create(model=MODEL, prompt=SYSTEM + "Q1", max_tokens=6)
    assert first.choices[0].finish_reason in ("length", "stop")
    assert first.usage.completion_tokens <= 6 and first.usage.prompt_tokens == len(SYSTEM) + 3
    again = client.completions.create(model=MODEL, prompt=SYSTEM + "Q2", max_tokens=6)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= (len(SYSTEM) + 1) // 16 * 16 - 16 and cached % 16 == 0


def test_chat_and_greedy_output_is_the_same_with_and_without_the_cache(client):
    fresh = chat(client, "Which kettle boils fastest? (a question nobody asked yet)",
                 max_tokens=10)
    assert fresh.choices[0].message.role == "assistant"
    repeat = chat(client, "Which kettle boils fastest? (a question nobody asked yet)",
                  max_tokens=10)
    assert repeat.usage.prompt_tokens_details.cached_tokens > \
        fresh.usage.prompt_tokens_details.cached_tokens
    assert repeat.choices[0].message.content == fresh.choices[0].message.content


def test_what_the_openai_client_may_send_is_served(client):
    """Found by a probe with the openai client: models.retrieve was a 404, explicit nulls
    (the client's None) and a prompt of token ids were 400s."""
    assert client.models.retrieve(MODEL).id == MODEL
    nulls = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "nulls"}], max_tokens=4,
        temperature=None, top_p=None, n=None, stream=None)
    assert nulls.choices[0].finish_reason in ("stop", "length")
    text = client.completions.create(model=MODEL, prompt="abc", max_tokens=4)
    abc = tokenizer.encode("abc")  # BOS, then the bytes: ids are taken as they are given
    for prompt in (abc, [abc]):
        ids = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert ids.choices[0].text == text.choices[0].text
        assert ids.usage.prompt_tokens == text.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as outside:
        client.completions.create(model=MODEL, prompt=[97, 10_000], max_tokens=4)
    assert outside.value.body["code"] == "invalid_token_ids"


def test_streaming_chat_in_openai_chunks(client):
    stream = chat(client, "stream please", max_tokens=8, stream=True,
                  stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.created for c in chunks}) == 1 and len({c.id for c in chunks}) == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 8
    whole = chat(client, "stream please", max_tokens=8)
    assert text == whole.choices[0].message.content
    completion = client.completions.create(model=MODEL, prompt="abc", max_tokens=4,
                                           stream=True)
    assert sum(1 for _ in completion) >= 1


def test_error_statuses_in_openai_shape(client, url):
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-17", prompt="x")
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:  # 400, as OpenAI answers it
        client.completions.create(model=MODEL, prompt="x" * 4000)
    assert too_long.value.body["code"] == "context_length_exceeded"
    assert too_long.value.body["param"] == "prompt"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    for body in (b"{not json", b'{"model": "tiny-llama", "prompt": 3}',
                 b'{"model": "tiny-llama", "prompt": "x", "max_tokens": -1}',
                 b'{"model": "tiny-llama", "messages": []}'):
        for path in ("/v1/completions", "/v1/chat/completions"):
            reply = requests.post(url + path, data=body, timeout=30,
                                  headers={"content-type": "application/json"})
            assert reply.status_code == 400, (path, body, reply.text)
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"]
            assert "Traceback" not in reply.text


def test_overload_is_a_503_with_retry_after(url):
    def call(_):
        return requests.post(url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "load " * 200, "max_tokens": 64})

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        replies = list(pool.map(call, range(24)))
    statuses = [r.status_code for r in replies]
    assert set(statuses) <= {200, 503}, statuses
    assert 503 in statuses and 200 in statuses
    busy = next(r for r in replies if r.status_code == 503)
    assert busy.headers["retry-after"] and busy.json()["error"]["code"] == "overloaded"


def engine_replicas() -> list:
    from ray._private.state import actors

    return [a for a in actors().values() if a["State"] == "ALIVE"
            and "EngineDeployment" in a.get("ActorClassName", "")]


def test_the_ingress_runs_on_the_head_beside_serve_s_only_proxy(url):
    """A worker node's death must not take the ingress (and every request it holds) with
    it: behind a HeadOnly proxy, the ingress is pinned to the head (ingress_options)."""
    from ray._private.state import actors

    ingresses = [a for a in actors().values() if a["State"] == "ALIVE"
                 and a.get("ActorClassName", "").endswith(":Ingress")]
    head_id = ray.get_runtime_context().get_node_id()  # the driver runs on the head
    assert ingresses and {a["Address"]["NodeID"] for a in ingresses} == {head_id}


def test_a_replica_killed_under_load_gives_no_wrong_text(client):
    prompts = [f"{SYSTEM} customer {i}: my kettle whistles" for i in range(6)]
    expected = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=8)
                .choices[0].text for p in prompts}
    outcomes = {"ok": 0, "wrong": 0, "failed": 0}

    def one(prompt):
        try:
            text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                             timeout=60).choices[0].text
            outcomes["ok" if text == expected[prompt] else "wrong"] += 1
        except openai.APIError:
            outcomes["failed"] += 1

    deadline_s = time.monotonic() + 8
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(one, prompts[i % 6]) for i in range(6)]
        victim = engine_replicas()[0]
        ray.kill(ray.get_actor(victim["Name"], namespace="serve"), no_restart=True)
        while time.monotonic() < deadline_s:
            futures += [pool.submit(one, p) for p in prompts]
            concurrent.futures.wait(futures[-6:])
    concurrent.futures.wait(futures)
    assert outcomes["wrong"] == 0, outcomes
    assert outcomes["ok"] >= 12 and outcomes["failed"] <= 2, outcomes
    wait_until(lambda: len(engine_replicas()) == 3, 60, "Serve to replace the replica")


# ---- access: API keys and the request size limit ---------------------------------------------


@pytest.fixture(scope="module")
def secure(url):
    from cluster import add_namespace

    add_namespace("tenant-b")
    serve.run(build_app({"model": MODEL, "engine_num_cpus": 0, "max_context_tokens": 2048,
                         "api_keys": {"key-a": "default", "key-b": "tenant-b"},
                         "max_request_bytes": 4096}), name="secure", route_prefix="/secure")
    return f"{url}/secure"


def test_keys_are_required_and_name_the_namespace(secure):
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "key-a"}):
        reply = requests.post(secure + "/v1/completions", json=body, headers=headers, timeout=60)
        assert reply.status_code == 401, (headers, reply.text)
        assert reply.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(secure + "/v1/models", timeout=30).status_code == 401
    client = openai.OpenAI(base_url=f"{secure}/v1", api_key="key-a", max_retries=0)
    assert client.completions.create(model=MODEL, prompt="hello", max_tokens=2).usage
    forbidden = requests.post(secure + "/v1/completions", json=body, timeout=60, headers={
        "authorization": "Bearer key-b", "x-raykv-namespace": "default"})
    assert forbidden.status_code == 403
    assert forbidden.json()["error"]["code"] == "namespace_forbidden"
    own = requests.post(secure + "/v1/completions", json=body, timeout=60, headers={
        "authorization": "Bearer key-b"})
    assert own.status_code == 200, own.text


def test_a_body_past_the_limit_is_refused_unread(secure):
    headers = {"authorization": "Bearer key-a", "content-type": "application/json"}
    big = json.dumps({"model": MODEL, "prompt": "x" * 10_000}).encode()
    reply = requests.post(secure + "/v1/completions", data=big, headers=headers, timeout=60)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    chunked = requests.post(secure + "/v1/completions", headers=headers, timeout=60,
                            data=(big[i:i + 1000] for i in range(0, len(big), 1000)))
    assert chunked.status_code == 413, chunked.text


def test_http_fuzz_gets_only_documented_statuses_and_the_app_lives(secure):
    """Malformed JSON, wrong types, unknown models, huge prompts, odd methods, paths, keys and
    namespaces (cluster/tools/fuzz.py): every reply a documented status in OpenAI's error shape,
    never a 500 or a hang, and a good request still served at the end."""
    from cluster.tools.fuzz import run_http_fuzz

    assert run_http_fuzz(secure, "key-a", HTTP_FUZZ_CASES) >= HTTP_FUZZ_CASES * 0.95


HTTP_FUZZ_CASES = 2500
