"""The operator's admin endpoints over real Serve on one local Ray node: a tenant's key and
no key are refused, the admin key pins, warms and unpins a prompt the completions endpoint
would look up. (The rules without Ray, no admin key configured included:
tests/unit/test_admin_access.py.)"""

from __future__ import annotations

import pytest
import ray
import requests
from ray import serve

from cluster import ModelSpec, connect
from cluster.serving import tokenizer
from cluster.serving.app import build_app
from cluster.tools.redis_server import free_port
from tests.kv import kv_for
from tests.waiting import wait_until

MODEL = "tiny-llama"
ADMIN, TENANT = "admin-key-for-tests", "tenant-key-for-tests"
PROMPT = "the system prompt an operator keeps warm for tomorrow's launch. " * 2


@pytest.fixture(scope="module")
def url(service):
    service()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    app = build_app({"model": MODEL, "replicas": 1, "engine_num_cpus": 0,
                     "max_context_tokens": 1024, "api_keys": {TENANT: "default"},
                     "admin_key": ADMIN})
    serve.run(app, name="raykv", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def admin(url: str, action: str, body: dict, key: str | None = ADMIN) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(f"{url}/v1/raykv/admin/{action}", json=body, headers=headers,
                         timeout=60)


def test_tenant_keys_and_no_key_are_refused(url):
    for action in ("pin", "unpin", "warm"):
        body = {"prompt": PROMPT, "ttl_s": 5, "node": "x"}
        assert admin(url, action, body, key=None).status_code == 401
        refused = admin(url, action, body, key=TENANT)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "admin_only"
    wrong = requests.post(f"{url}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {ADMIN}"},
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert wrong.status_code == 401  # and the admin key is no tenant's key


def test_the_admin_key_pins_warms_and_unpins(url):
    spec = ModelSpec.preset(MODEL)
    tokens = tokenizer.encode(PROMPT)  # what the completions endpoint keys the prompt by
    client = connect(spec)
    assert client.put(tokens, kv_for(spec, len(tokens))) > 0
    num_pages = len(tokens) // 16
    keys = client.keys(tokens)
    wait_until(lambda: len(client.locate_keys(keys)) == num_pages, 10, "the directory")
    pinned = admin(url, "pin", {"prompt": PROMPT, "ttl_s": 30})
    assert pinned.status_code == 200, pinned.text
    assert pinned.json()["pinned_pages"] == num_pages == pinned.json()["prompt_pages"]
    assert client.stats()["node"]["pins"]["pinned_pages"] == num_pages
    here = ray.get_runtime_context().get_node_id()
    warmed = admin(url, "warm", {"prompt": PROMPT, "node": here})
    assert warmed.status_code == 200 and warmed.json()["node_pages"] == num_pages
    unknown = admin(url, "warm", {"prompt": PROMPT, "node": "no-such-node"})
    assert unknown.status_code == 400 and "not a raykv node" in unknown.json()["error"]["message"]
    assert admin(url, "pin", {"prompt": PROMPT, "ttl_s": -1}).status_code == 400
    assert admin(url, "pin", {"prompt": PROMPT, "ttl_s": 5, "namespace": "nobody"}
                 ).status_code == 400
    unpinned = admin(url, "unpin", {"tokens": tokens})
    assert unpinned.status_code == 200 and unpinned.json()["unpinned_pages"] == num_pages
    assert client.stats()["node"]["pins"]["pinned_pages"] == 0
