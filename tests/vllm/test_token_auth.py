"""vLLM on raykv on a Ray cluster with token authentication, every process outside the
cluster's process tree (a clean environment: RAY_ADDRESS and the auth exports the README
gives): `raykv start`, a vLLM engine whose connector gets cached tokens, and `raykv serve
--engine vllm` on a 2-CPU Ray: refused at once when it cannot fit, ready when it can."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this "
                                   "tier in .venv-vllm")

from cluster.core.tiers.memory import remove_stale_shm  # noqa: E402
from cluster.core.tiers.node_slot import slot_shm_prefix  # noqa: E402
from tests.ray_head import Head, token_auth_head  # noqa: E402

REFUSE_WITHIN_S = 90
READY_WITHIN_S = 420
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
PREFIX_TOKENS = 700  # 2 full raykv pages of 256 tokens (5 vLLM CPU blocks of 128)
# One engine, vLLM's own prefix cache off: the second prompt's cached tokens come from raykv.
ENGINE = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from cluster import ModelSpec, connect
model_dir, prefix_len = sys.argv[1], int(sys.argv[2])
llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
          enable_prefix_caching=False, kv_transfer_config=KVTransferConfig(
              kv_connector="RaykvConnector",
              kv_connector_module_path="cluster.serving.vllm_connector", kv_role="kv_both",
              kv_connector_extra_config={"raykv.model_name": "small-llama"}))
params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
prefix = [(i * 7 + i * i) % 251 for i in range(prefix_len)]
llm.generate([{"prompt_token_ids": prefix + [1, 2]}], params, use_tqdm=False)
client = connect(ModelSpec("small-llama", 4, 2, 64, "float32"))
deadline = time.monotonic() + 60
while client.lookup(prefix) < client.page_tokens and time.monotonic() < deadline:
    time.sleep(0.5)  # the connector puts in the background
(out,) = llm.generate([{"prompt_token_ids": prefix + [3, 4]}], params, use_tqdm=False)
print("RESULT " + json.dumps({"cached": out.num_cached_tokens or 0,
                              "page_tokens": client.page_tokens}))
"""


@pytest.fixture(scope="module")
def head():
    with token_auth_head(num_cpus=2) as started:
        yield started
        remove_stale_shm(slot_shm_prefix(f"{started.root}/disk"))


def _auth_env(head: Head) -> dict[str, str]:
    """What the README says to export in a shell outside the cluster's process tree."""
    return head.env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=head.token_path, **ENGINE_ENV)


def _same_user_env(head: Head) -> dict[str, str]:
    """Another shell of the user who started the cluster: RAY_ADDRESS only, the token where
    the new local Ray put it (~/.ray/auth_token). Ray alone refuses it (InvalidAuthToken)."""
    return {**head.env(**ENGINE_ENV), "HOME": head.home}


def _raykv(args: list[str], env: dict, **options) -> subprocess.Popen:
    options.setdefault("stdout", subprocess.PIPE)
    return subprocess.Popen([sys.executable, "-m", "cluster.tools.cli", *args], env=env,
                            stderr=subprocess.STDOUT, text=True, **options)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_engine_outside_the_tree_gets_cached_tokens(head: Head, model_dir):
    """The README's engine set-up (the connector, RAY_ADDRESS), run from the user's shell."""
    env = _same_user_env(head)
    started = _raykv(["start", "--host-bytes", "128MiB", "--device-bytes", "0",
                      "--disk-bytes", "0"], env)
    output, _ = started.communicate(timeout=180)
    assert started.returncode == 0, output[-3000:]
    engine = subprocess.run([sys.executable, "-c", ENGINE, model_dir, str(PREFIX_TOKENS)],
                            env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in engine.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, engine.stderr[-4000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["page_tokens"] == 256  # `raykv start`'s default, adopted by the connector
    assert result["cached"] >= 2 * 256, (result, engine.stderr[-4000:])


def test_raykv_serve_vllm_refuses_at_once_what_two_cpus_cannot_hold(head: Head, tmp_path):
    began_s = time.monotonic()
    serve = _raykv(["serve", "--engine", "vllm", "--replicas", "2",
                    "--port", str(_free_port())], _auth_env(head), cwd=tmp_path)
    try:
        output, _ = serve.communicate(timeout=REFUSE_WITHIN_S)
    finally:
        serve.kill()
    assert serve.returncode != 0
    assert "3 CPUs" in output and "has 2" in output, output[-3000:]
    assert time.monotonic() - began_s < REFUSE_WITHIN_S


def test_raykv_serve_vllm_is_ready_on_two_cpus(head: Head, tmp_path):
    port = _free_port()
    log = open(tmp_path / "serve.log", "w+")  # read back when the CLI exits early
    serve = _raykv(["serve", "--engine", "vllm", "--port", str(port),
                    "--ready-timeout-s", str(READY_WITHIN_S)], _auth_env(head), cwd=tmp_path,
                   start_new_session=True, stdout=log)
    try:
        reply = _first_reply(serve, f"http://127.0.0.1:{port}/v1/completions", log)
        assert reply["usage"]["completion_tokens"] == 2, reply
    finally:
        os.killpg(serve.pid, signal.SIGINT)  # the CLI's Ctrl-C: it shuts Serve down
        try:
            serve.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
        log.close()


def _first_reply(serve: subprocess.Popen, url: str, log) -> dict:
    body = json.dumps({"model": "small-llama", "prompt": "hello " * 40, "max_tokens": 2,
                       "temperature": 0}).encode()
    deadline_s = time.monotonic() + READY_WITHIN_S + 30
    while time.monotonic() < deadline_s:
        if serve.poll() is not None:
            log.seek(0)
            raise AssertionError(f"raykv serve exited: {log.read()[-3000:]}")
        request = urllib.request.Request(url, data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())
        except OSError:
            time.sleep(3)
    raise AssertionError(f"raykv serve --engine vllm was not ready within {READY_WITHIN_S} s")
