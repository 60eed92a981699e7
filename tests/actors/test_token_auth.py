"""raykv on a Ray cluster with token authentication (Ray 2.60 turns it on for every new local
cluster), used from processes outside the cluster's process tree, as a user's other shell
would: `raykv start`, a client's put and get, `raykv status`, `raykv stop`.

Ray itself adopts a token for address "auto" only; given RAY_ADDRESS, a process without
RAY_AUTH_MODE=token cannot connect. raykv joins with the token at hand, or says what to export.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster.core.tiers.memory import remove_stale_shm
from cluster.core.tiers.node_slot import slot_shm_prefix
from tests.ray_head import Head, token_auth_head

RUN_TIMEOUT_S = 180
# A put of 2 pages of 16 tokens and a get of them back, byte for byte.
CLIENT = """
import torch
from cluster import ModelSpec, connect
spec = ModelSpec.preset("tiny-llama")
client = connect(spec)
tokens = list(range(40))
kv = torch.randn(spec.num_layers, 2, spec.num_kv_heads, len(tokens), spec.head_dim)
stored = client.put(tokens, kv)
n, got = client.get(tokens, out=torch.empty_like(kv))
assert (stored, n) == (32, 32), (stored, n)
assert torch.equal(got, kv[:, :, :, :32])
print("PUT-GET-OK")
"""


@pytest.fixture(scope="module")
def head():
    with token_auth_head() as started:
        yield started
        remove_stale_shm(slot_shm_prefix(f"{started.root}/disk"))


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


def _raykv(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return _run(["-m", "cluster.tools.cli", *args], env)


def test_without_a_token_it_says_what_to_export(head: Head):
    """Only RAY_ADDRESS, no token anywhere: refused, with the variables to export named."""
    refused = _raykv(["status", "--json"], head.env())
    assert refused.returncode != 0
    said = refused.stderr + refused.stdout
    assert "RAY_AUTH_MODE=token" in said and "RAY_AUTH_TOKEN_PATH" in said, said[-3000:]


def test_cli_and_client_join_with_the_users_token(head: Head):
    """RAY_ADDRESS only, the token where a new local Ray keeps it (~/.ray/auth_token): the CLI
    and a client join; then the documented exports (RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH)."""
    same_user = {**head.env(), "HOME": head.home}
    started = _raykv(["start", "--page-tokens", "16", "--host-bytes", "64MiB",
                      "--device-bytes", "0", "--disk-bytes", "0"], same_user)
    assert started.returncode == 0, started.stderr[-3000:]
    client = _run(["-c", CLIENT], same_user)
    assert "PUT-GET-OK" in client.stdout, client.stderr[-3000:]
    exported = head.env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=head.token_path)
    status = _raykv(["status", "--json"], exported)
    assert status.returncode == 0, status.stderr[-3000:]
    report = json.loads(status.stdout)
    assert report["config"]["page_tokens"] == 16
    assert [node["pages"]["host"] for node in report["nodes"]] == [2]
    stopped = _raykv(["stop", "--purge"], exported)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
