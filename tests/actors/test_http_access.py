"""HTTP isolation over real Serve on one local Ray node: without API keys the app serves the
default namespace only, on loopback only. A header naming another tenant is a 403 (its
cached_tokens cannot be probed, its rate limit not spent); a second namespace, or a
non-loopback bind, makes the app refuse to start. The rules without Ray:
tests/unit/test_access.py."""

from __future__ import annotations

import pytest
import requests
from ray import serve

from cluster import ModelSpec, add_namespace, connect
from cluster.serving import tokenizer
from cluster.serving.access import Access, KeysRequired, require_keys_for_bind
from cluster.serving.app import build_app
from cluster.serving.ingress import serve_bind_host
from cluster.tools.redis_server import free_port
from tests.kv import kv_for

MODEL = "tiny-llama"
SECRET_PROMPT = "tenant-b's confidential system prompt: the merger closes on friday. " * 2
APP_ARGS = {"model": MODEL, "replicas": 1, "engine_num_cpus": 0, "max_context_tokens": 1024,
            "api_keys": {}}


@pytest.fixture(scope="module")
def keyless(service):
    """A keyless app on 127.0.0.1 (one namespace): it starts. Yields (url, the app)."""
    service()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    app = build_app(APP_ARGS)
    serve.run(app, name="raykv", route_prefix="/")
    yield f"http://127.0.0.1:{port}", app
    serve.shutdown()


def complete(url: str, prompt: str, headers: dict | None = None) -> requests.Response:
    return requests.post(f"{url}/v1/completions", headers=headers or {}, timeout=60,
                         json={"model": MODEL, "prompt": prompt, "max_tokens": 1})


def test_without_keys_another_tenants_prefixes_cannot_be_probed(keyless):
    url, _ = keyless
    assert serve_bind_host() == "127.0.0.1"
    add_namespace("tenant-b")
    spec = ModelSpec.preset(MODEL)
    tokens = tokenizer.encode(SECRET_PROMPT)  # what the ingress keys the prompt by
    assert connect(spec, "tenant-b").put(tokens, kv_for(spec, len(tokens))) >= 64
    for _ in range(2):  # the second would be the probe's hit (and a second rate-limit token)
        probe = complete(url, SECRET_PROMPT, {"x-raykv-namespace": "tenant-b"})
        assert probe.status_code == 403, probe.text
        assert probe.json()["error"]["code"] == "namespace_forbidden"
        assert "usage" not in probe.json() and "x-raykv-cached-tokens" not in probe.headers
    own = complete(url, SECRET_PROMPT)  # the default namespace: tenant-b's pages unseen
    assert own.status_code == 200, own.text
    assert own.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    named = complete(url, "hello", {"x-raykv-namespace": "default"})
    assert named.status_code == 200, named.text


def test_a_second_namespace_without_keys_refuses_to_start(keyless):
    add_namespace("tenant-b")
    with pytest.raises(KeysRequired, match="tenant-b.*RAYKV_API_KEYS"):
        build_app(APP_ARGS)
    with pytest.raises(KeysRequired, match="acme"):  # named by the admission settings too
        build_app({**APP_ARGS, "admission": {"tenants": {"acme": {"rate_per_s": 1}}}})
    build_app({**APP_ARGS, "api_keys": {"key-a": "default", "key-b": "tenant-b"}})


def test_a_non_loopback_bind_without_keys_refuses_to_start(keyless):
    """Serve's controller says 0.0.0.0 (its proxies disabled: nothing binds it here). The
    app built while Serve was on loopback refuses in its ingress replica, as it starts."""
    _, app = keyless
    serve.shutdown()
    serve.start(http_options={"host": "0.0.0.0", "port": free_port()},
                proxy_location="Disabled")
    assert serve_bind_host() == "0.0.0.0"
    with pytest.raises(KeysRequired, match="'0.0.0.0'.*RAYKV_API_KEYS"):
        require_keys_for_bind(Access(), serve_bind_host())  # what build_app checks
    with pytest.raises(RuntimeError, match="Ingress"):
        serve.run(app, name="raykv", route_prefix="/")
    status = serve.status().applications["raykv"]
    why = status.deployments["Ingress"].message  # the replica's error, as Serve reports it
    assert "refuses to start without API keys" in why and "'0.0.0.0'" in why, why
    assert "RAYKV_API_KEYS" in why
