"""raykv's vLLM app with Ray's direct streaming (cluster/serving/vllm_direct.py), end to end:
HAProxy asks raykv's route deployment for a replica and sends the request straight to it.
An OpenAI client gets completions and cached tokens loaded from raykv; the router's cut
reaches the engine (a client's forced cut of 0 loads nothing of a held prefix); a request
without this app's key is refused (401, 403 for another namespace's key).

HAProxy and Serve's direct ingress bind every interface, so the app runs in a child process
in a network namespace of its own (loopback only), as `raykv bench vllm-serve` does:
tests/vllm/direct_app_child.py, which writes what it saw as JSON for the asserts here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this "
                                   "tier in .venv-vllm")

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 900
ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
       "VLLM_HOST_IP": "127.0.0.1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    if shutil.which("unshare") is None:
        pytest.skip("`unshare` (util-linux) is needed to run HAProxy on loopback only")
    out = tmp_path_factory.mktemp("direct") / "seen.json"
    child = f"{sys.executable} -m tests.vllm.direct_app_child --out {out}"
    isolate = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
    env = {**os.environ, **ENV,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([*isolate, "sh", "-c", f"ip link set lo up && exec {child}"],
                          cwd=REPO, env=env, timeout=CHILD_TIMEOUT_S, check=False)
    assert out.exists(), f"the child exited {done.returncode} without a result"
    result = json.loads(out.read_text())
    assert "error" not in result, result["error"]
    return result


def test_the_app_is_direct_streaming_with_raykv_s_route_deployment(seen):
    assert seen["deployments"] == ["DirectLLMServer:small-llama", "RaykvRouteIngress"]
    assert all("RUNNING" in status for status in seen["apps"].values())


def test_an_openai_client_gets_completions_and_tokens_cached_in_raykv(seen):
    assert seen["first"]["text"] and seen["first"]["prompt_tokens"] > 640
    assert seen["first"]["cached_tokens"] == 0  # vLLM's own prefix cache is off
    # The shared prefix's 5 full blocks of 128 tokens, loaded from raykv.
    assert seen["second"]["cached_tokens"] == 640
    assert seen["chat_choices"] == 1


def test_the_router_s_cut_reaches_the_engine_through_haproxy_s_headers(seen):
    assert seen["forced_zero"]["cached_tokens"] == 0
    assert seen["unforced"]["cached_tokens"] == 640


def test_a_request_without_this_app_s_key_is_refused(seen):
    status, body = seen["no_key"]
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert seen["wrong_key"][0] == 401
    status, body = seen["other_namespace_key"]
    assert status == 403 and body["error"]["code"] == "namespace_forbidden"
    assert seen["models_no_key"] == 401
    assert seen["openai_wrong_key"] == 401
