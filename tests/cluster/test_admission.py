"""Admission in the Serve app over real HTTP: a tenant over its rate and a burst past the
gate's slots and queue get 429 with Retry-After in OpenAI's error shape, at once or within the
wait bound, never a hang."""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest
import requests
from ray import serve

from cluster import CacheConfig, start
from cluster.serving.app import build_app
from cluster.tools.redis_server import free_port

MODEL = "tiny-llama"
ADMISSION = {"max_in_flight": 1, "max_queued": 1, "max_wait_s": 1.0,
             "tenants": {"acme": {"rate_per_s": 0.2, "burst": 1}}}
KEYS = {"default": "key-default", "acme": "key-acme"}  # two tenants: keys are required
AUTH = {"authorization": f"Bearer {KEYS['default']}"}


@pytest.fixture(scope="module")
def url(ray_cluster, disk_root):
    start(CacheConfig(page_tokens=16, device_bytes=0, host_bytes=512 * 8192,
                      disk_bytes=4 << 20, disk_dir=disk_root, namespaces=("default", "acme"),
                      rebalance=False))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    serve.run(build_app({"model": MODEL, "engine_num_cpus": 0, "max_ongoing_requests": 2,
                         "max_context_tokens": 2048, "admission": ADMISSION,
                         "api_keys": {key: namespace for namespace, key in KEYS.items()}}),
              name="raykv", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def post(url: str, headers: dict | None = None, max_tokens: int = 4) -> requests.Response:
    return requests.post(f"{url}/v1/completions", headers={**AUTH, **(headers or {})},
                         timeout=60,
                         json={"model": MODEL, "prompt": "kettles " * 20,
                               "max_tokens": max_tokens})


def test_a_tenant_over_its_rate_gets_429_rate_limited(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["acme"], max_retries=0,
                           default_headers={"x-raykv-namespace": "acme"})
    client.completions.create(model=MODEL, prompt="first", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model=MODEL, prompt="second", max_tokens=2)
    error = refused.value
    assert error.status_code == 429 and error.body["code"] == "rate_limited"
    assert set(error.body) == {"message", "type", "param", "code"}
    assert 1 <= int(error.response.headers["retry-after"]) <= 5
    assert post(url).status_code == 200  # another tenant is not limited


def test_a_burst_past_slots_and_queue_is_429_overloaded_not_a_hang(url):
    start_s = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        replies = list(pool.map(lambda _: post(url, max_tokens=24), range(10)))
    elapsed_s = time.monotonic() - start_s
    statuses = [r.status_code for r in replies]
    assert set(statuses) <= {200, 429} and statuses.count(200) >= 1, statuses
    assert statuses.count(429) >= 7, statuses  # one slot, one queued place
    refused = next(r for r in replies if r.status_code == 429)
    assert refused.json()["error"]["code"] == "overloaded"
    assert int(refused.headers["retry-after"]) >= 1
    assert elapsed_s < 60
    gate = requests.get(f"{url}/v1/raykv/admission", headers=AUTH, timeout=30).json()
    assert gate["in_flight"] == 0 and gate["waiting"] == [0, 0, 0]


def test_priority_header_is_checked(url):
    reply = post(url, {"x-raykv-priority": "urgent"})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "invalid_priority"
    assert post(url, {"x-raykv-priority": "high"}).status_code == 200


def test_a_spiky_trace_replayed_over_http_is_answered_or_refused(url):
    from cluster.tools.replay import replay_http
    from cluster.tools.traces import TraceShape, make_trace

    shape = TraceShape(duration_s=4.0, base_rate_per_s=2.0, first_spike_s=1.0, spike_s=2.0,
                       ramp_s=0.5, num_prefixes=6, prefix_pages=(1, 2), page_tokens=16,
                       models=(MODEL,), tenants=("default", "acme"), seed=5)
    trace = make_trace(shape)
    outcomes = replay_http(trace, url, MODEL, bearer_keys=KEYS)
    statuses = [o.status for o in outcomes]
    assert len(outcomes) == len(trace) and set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 1 and statuses.count(200) >= 1
    assert max(o.fetch_s for o in outcomes) < 60
