"""Two vLLM engines on two simulated Ray nodes share prefixes through raykv: engine A prefills,
a fresh engine B loads the prefix and decodes the same greedy tokens; a dead node is a
recompute, never an error."""

from __future__ import annotations

import shutil
import tempfile

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this "
                                   "tier in .venv-vllm")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from cluster import CacheConfig, ModelSpec, connect, start, stop  # noqa: E402
from cluster.core.tiers.memory import remove_stale_shm  # noqa: E402
from cluster.core.tiers.node_slot import slot_shm_prefix  # noqa: E402
from tests.vllm.conftest import prompt_tokens  # noqa: E402
from tests.vllm.engine import engine_on  # noqa: E402

BLOCK_TOKENS = 128
PROMPT_TOKENS = 1000  # 7 full blocks, and a partial one that is always computed
MAX_TOKENS = 8
SMALL_LLAMA = ModelSpec.preset("small-llama")


def node_args(name: str) -> dict:
    return dict(num_cpus=2, resources={"kv_node": 1, name: 1},
                object_store_memory=200 * 1024 * 1024)


@pytest.fixture(scope="module")
def engines(model_dir):
    disk_dir = tempfile.mkdtemp(prefix="raykv-vllm-", dir="/tmp")
    cluster = Cluster(initialize_head=True, head_node_args=node_args("node_c"))
    nodes = {name: cluster.add_node(**node_args(name)) for name in ("node_a", "node_b")}
    ray.init(address=cluster.address, logging_level="WARNING")
    cluster.wait_for_nodes()
    # Short call timeouts: a load from a dead node gives up quickly and is recomputed.
    start(CacheConfig(page_tokens=BLOCK_TOKENS, device_bytes=0, host_bytes=64 << 20,
                      disk_bytes=0, disk_dir=disk_dir, call_timeout_s=3.0))
    yield {"a": engine_on("node_a", model_dir), "b": engine_on("node_b", model_dir),
           "cluster": cluster, "nodes": nodes}
    stop()
    ray.shutdown()
    cluster.shutdown()
    remove_stale_shm(slot_shm_prefix(disk_dir))
    shutil.rmtree(disk_dir, ignore_errors=True)


def test_engine_b_loads_what_engine_a_prefilled(engines):
    prompt = prompt_tokens(PROMPT_TOKENS, seed=1)
    ids_a, cached_a = ray.get(engines["a"].generate.remote(prompt, MAX_TOKENS))
    assert cached_a == 0
    # A's full prompt pages are in raykv (saved off A's critical path: wait for them).
    client = connect(SMALL_LLAMA)
    full = PROMPT_TOKENS // BLOCK_TOKENS * BLOCK_TOKENS
    _wait_for(lambda: client.lookup(prompt) == full, "engine A's pages in raykv")
    ids_b, cached_b = ray.get(engines["b"].generate.remote(prompt, MAX_TOKENS))
    assert cached_b == full  # every full block came from raykv: B computed only the tail
    assert ids_b == ids_a and len(ids_b) == MAX_TOKENS


def test_pages_from_vllm_are_raykvs_own_engines_kv(engines):
    """vLLM's pages, read by raykv's client, are the KV raykv's transformers engine computes
    for the same tokens (same weights: the same preset and seed), in raykv's layout; and that
    engine, continuing from them, picks vLLM's first greedy token."""
    import torch

    from cluster.serving.model import build_llama, continue_from, prefill

    prompt = prompt_tokens(PROMPT_TOKENS, seed=3)
    ids_a, _ = ray.get(engines["a"].generate.remote(prompt, MAX_TOKENS))
    client = connect(SMALL_LLAMA)
    full = PROMPT_TOKENS // BLOCK_TOKENS * BLOCK_TOKENS
    _wait_for(lambda: client.lookup(prompt) == full, "engine A's pages in raykv")
    num_tokens, kv = client.get(prompt)
    model, spec = build_llama("small-llama", seed=0)
    assert num_tokens == full and spec == SMALL_LLAMA
    _, expected = prefill(model, prompt[:full])
    assert torch.allclose(kv, expected, atol=1e-3, rtol=1e-3), (kv - expected).abs().max()
    assert int(continue_from(model, kv, prompt).argmax()) == ids_a[0]


def test_a_dead_node_is_a_recompute(engines):
    prompt = prompt_tokens(PROMPT_TOKENS, seed=2)
    ids_a, _ = ray.get(engines["a"].generate.remote(prompt, MAX_TOKENS))
    client = connect(SMALL_LLAMA)
    _wait_for(lambda: client.lookup(prompt) > 0, "engine A's pages in raykv")
    # The pages live on node A only. Remove it: B's load finds them gone (or the directory
    # has already forgotten them) and vLLM computes the prompt itself.
    engines["cluster"].remove_node(engines["nodes"]["node_a"], allow_graceful=False)
    ids_b, _ = ray.get(engines["b"].generate.remote(prompt, MAX_TOKENS), timeout=120)
    assert ids_b == ids_a


def _wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    import time

    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline_s, f"timed out waiting for {what}"
        time.sleep(0.2)
