"""The body of tests/vllm/test_direct_app.py, run in a network namespace of its own (HAProxy and
Serve's direct ingress bind every interface): raykv's direct-streaming vLLM app behind HAProxy,
one replica, API keys on; an OpenAI client's calls; what each saw goes to --out as JSON.

Run by the test only (`python -m tests.vllm.direct_app_child --out PATH`), with
RAY_SERVE_ENABLE_HA_PROXY=1 and RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1 set before Ray
is imported.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
import urllib.error
import urllib.request

from tests.vllm.serve_setup import MODEL_ID, cache_config, raykv_app_args, start_local_serve

KEY = "tenant-key-for-the-direct-test"
OTHER_KEY = "another-namespaces-key"
PREFIX_BYTES = 700  # byte tokens: 5 full blocks of 128 and a partial one
START_TIMEOUT_S = 420
SAVE_TIMEOUT_S = 60


def raw(url: str, body: dict | None, key: str | None) -> tuple[int, dict]:
    """(status, JSON answer) of a POST (GET without a body), with `key` as bearer if any."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        text = error.read()
        try:
            return error.code, json.loads(text)
        except ValueError:
            return error.code, {"text": text.decode(errors="replace")[:300]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out: dict = {}
    path = parser.parse_args().out
    try:
        run(out)
    except Exception:
        out["error"] = traceback.format_exc()
    with open(path, "w") as file:
        json.dump(out, file, indent=1)


def run(out: dict) -> None:
    import openai
    import ray
    from ray import serve

    from cluster import stop
    from cluster.api import add_namespace, ensure_running
    from cluster.serving.model_dir import save_model_dir
    from cluster.serving.vllm_app import build_direct_vllm_app

    model_dir = save_model_dir(tempfile.mkdtemp(prefix="raykv-direct-") + "/" + MODEL_ID)
    port = start_local_serve()
    args = raykv_app_args(model_dir, api_keys={KEY: "default", OTHER_KEY: "other"})
    cache = cache_config()
    ensure_running(cache)
    add_namespace("other")  # the other key's namespace: known to raykv, not this app's
    serve.run(build_direct_vllm_app(args, cache), blocking=False, name="direct",
              route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline_s = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline_s:
        status, _ = raw(url + "/v1/models", None, KEY)
        if status == 200:
            break
        time.sleep(3)
    else:
        raise TimeoutError("the direct app did not serve /v1/models")
    out["apps"] = {name: str(app.status) for name, app in serve.status().applications.items()}
    out["deployments"] = sorted(serve.status().applications["direct"].deployments)

    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    prefix = "".join(chr(97 + (i * 7) % 26) for i in range(PREFIX_BYTES))
    first = client.completions.create(model=MODEL_ID, prompt=prefix + " first", max_tokens=2)
    out["first"] = _usage(first)
    # The first request's pages reach raykv in the background: ask until a request hits.
    deadline_s = time.monotonic() + SAVE_TIMEOUT_S
    second = None
    while time.monotonic() < deadline_s:
        second = client.completions.create(model=MODEL_ID, prompt=prefix + " again",
                                           max_tokens=2)
        if _usage(second)["cached_tokens"]:
            break
        time.sleep(1)
    out["second"] = _usage(second)
    chat = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hello"}], max_tokens=2)
    out["chat_choices"] = len(chat.choices)
    # The client's forced cut of 0 reaches the engine only as the router's cut (the connector
    # reads the router's key alone): the held prefix is then recomputed, nothing loaded.
    forced = client.completions.create(
        model=MODEL_ID, prompt=prefix + " forced", max_tokens=2,
        extra_body={"kv_transfer_params": {"raykv_force_max_fetch_tokens": 0}})
    out["forced_zero"] = _usage(forced)
    unforced = client.completions.create(model=MODEL_ID, prompt=prefix + " unforced",
                                         max_tokens=2)
    out["unforced"] = _usage(unforced)

    body = {"model": MODEL_ID, "prompt": prefix, "max_tokens": 1}
    out["no_key"] = raw(url + "/v1/completions", body, None)
    out["wrong_key"] = raw(url + "/v1/completions", body, "not-a-key")
    out["other_namespace_key"] = raw(url + "/v1/completions", body, OTHER_KEY)
    out["models_no_key"] = raw(url + "/v1/models", None, None)[0]
    try:
        openai.OpenAI(base_url=url + "/v1", api_key="not-a-key").completions.create(
            model=MODEL_ID, prompt="x", max_tokens=1)
        out["openai_wrong_key"] = "accepted"
    except openai.AuthenticationError as error:
        out["openai_wrong_key"] = error.status_code
    serve.shutdown()
    stop()
    ray.shutdown()


def _usage(reply) -> dict:
    usage = reply.usage
    details = usage.prompt_tokens_details
    return {"text": reply.choices[0].text, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": (details.cached_tokens or 0) if details else 0}


if __name__ == "__main__":
    main()
