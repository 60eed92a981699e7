"""Prefill/decode disaggregation over raykv, engine by engine: a prefill engine on one simulated
node hands its prompt's pages to a decode engine on another through raykv alone, as Ray Serve
LLM's P/D servers drive them (kv_transfer_params in, kv_transfer_params out). The decode asks
right away, never waiting outside vLLM, loads the pages and decodes the same greedy tokens as a
plain vLLM engine; lost event batches only delay it; a lost save costs at most pd_wait_s."""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this "
                                   "tier in .venv-vllm")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from actors.handles import NodeHandle  # noqa: E402
from cluster import CacheConfig, start, stop  # noqa: E402
from cluster.core.tiers.memory import remove_stale_shm  # noqa: E402
from cluster.core.tiers.node_slot import slot_shm_prefix  # noqa: E402
from tests.vllm.conftest import prompt_tokens  # noqa: E402
from tests.vllm.engine import CONNECTOR, ENGINE_ENV, Engine  # noqa: E402

BLOCK_TOKENS = 128
PROMPT_TOKENS = 1000  # 7 full blocks (896 tokens), and a partial one that is always computed
FULL = PROMPT_TOKENS // BLOCK_TOKENS * BLOCK_TOKENS
MAX_TOKENS = 8
PD_WAIT_S = 5.0  # the decode engine's raykv.pd_wait_s
# What Ray Serve LLM's P/D shaping gives the prefill copy of a request (RaykvPDBackend).
PRODUCER = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None}
HANDOFF = {"tokens": FULL, "model": "small-llama", "namespace": "default"}


def node_args(name: str) -> dict:
    return dict(num_cpus=2, resources={"kv_node": 1, name: 1},
                object_store_memory=200 * 1024 * 1024)


def connector(**extra) -> dict:
    return {**CONNECTOR, "kv_connector_extra_config": {
        **CONNECTOR["kv_connector_extra_config"], **extra}}


@pytest.fixture(scope="module")
def engines(model_dir):
    disk_dir = tempfile.mkdtemp(prefix="raykv-pd-", dir="/tmp")
    cluster = Cluster(initialize_head=True, head_node_args=node_args("node_c"))
    for name in ("node_a", "node_b"):
        cluster.add_node(**node_args(name))
    ray.init(address=cluster.address, logging_level="WARNING")
    cluster.wait_for_nodes()
    start(CacheConfig(page_tokens=BLOCK_TOKENS, device_bytes=0, host_bytes=64 << 20,
                      disk_bytes=0, disk_dir=disk_dir, call_timeout_s=3.0))
    started = {  # the three load their models side by side
        "prefill": _engine("node_a", model_dir, CONNECTOR),
        "decode": _engine("node_b", model_dir, connector(**{"raykv.pd_wait_s": PD_WAIT_S})),
        "plain": _engine("node_c", model_dir, None)}  # vLLM without raykv: the reference
    nodes = dict(zip(started, ray.get([e.node.remote() for e in started.values()]),
                     strict=True))
    yield {**started, "nodes": nodes}
    stop()
    ray.shutdown()
    cluster.shutdown()
    remove_stale_shm(slot_shm_prefix(disk_dir))
    shutil.rmtree(disk_dir, ignore_errors=True)


def _engine(resource: str, model_dir: str, transfer: dict | None):
    return Engine.options(resources={resource: 1},
                          runtime_env={"env_vars": ENGINE_ENV}).remote(model_dir, transfer)


def _plain(engines, prompt: list[int]) -> list[int]:
    ids, _ = ray.get(engines["plain"].generate.remote(prompt, MAX_TOKENS))
    return ids


def _prefill(engines, prompt: list[int]) -> tuple[list[int], dict | None]:
    ids, _, params = ray.get(engines["prefill"].generate_handing.remote(prompt, 1, PRODUCER))
    return ids, params


def _decode(engines, prompt: list[int], params: dict | None) -> tuple[list[int], int, float]:
    start_s = time.monotonic()
    ids, cached, _ = ray.get(engines["decode"].generate_handing.remote(prompt, MAX_TOKENS,
                                                                       params))
    return ids, cached, time.monotonic() - start_s


def test_the_decode_loads_the_prefill_s_pages_and_decodes_as_plain_vllm(engines):
    assert len(set(engines["nodes"].values())) == 3
    prompt = prompt_tokens(PROMPT_TOKENS, seed=21)
    first, params = _prefill(engines, prompt)
    assert params == {"raykv_pd": HANDOFF}
    # Right away, on another node: the decode waits inside vLLM until raykv's directory
    # lists the prefill's pages, then loads them.
    ids, cached, _ = _decode(engines, prompt, params)
    assert cached >= FULL  # from raykv: this engine never saw the prompt
    expected = _plain(engines, prompt)
    assert ids == expected and first == expected[:1]
    assert ray.get(engines["decode"].worker_stats.remote())["loaded_tokens"] >= FULL


def test_a_prompt_the_prefill_engine_already_held_is_still_handed_over(engines):
    prompt = prompt_tokens(PROMPT_TOKENS, seed=22)
    ray.get(engines["prefill"].generate.remote(prompt, 1))  # now in vLLM's own cache there
    _, params = _prefill(engines, prompt)
    assert params == {"raykv_pd": HANDOFF}  # looked up and counted, not skipped
    ids, cached, _ = _decode(engines, prompt, params)
    assert cached >= FULL and ids == _plain(engines, prompt)


def test_lost_event_batches_delay_the_decode_not_its_result(engines):
    node = NodeHandle.lookup(engines["nodes"]["prefill"], CacheConfig())
    ray.get(node.inject_fault("event_batches", drop_fraction=0.5, reorder=True, seed=3),
            timeout=30)
    try:
        for seed in range(30, 34):
            prompt = prompt_tokens(PROMPT_TOKENS, seed=seed)
            _, params = _prefill(engines, prompt)
            ids, cached, _ = _decode(engines, prompt, params)
            assert cached >= FULL and ids == _plain(engines, prompt), seed
        faults = ray.get(node.stats(), timeout=30)["faults"]["events"]
        assert faults["timed_out"] + faults["vanished"] > 0, faults
    finally:
        ray.get(node.inject_fault("clear"), timeout=30)


def test_a_lost_save_costs_at_most_pd_wait_s_then_a_recompute(engines):
    prompt = prompt_tokens(PROMPT_TOKENS, seed=41)  # never prefilled: its pages never come
    expected = _plain(engines, prompt)
    ids, cached, elapsed_s = _decode(engines, prompt, {"raykv_pd": HANDOFF})
    assert ids == expected and cached == 0
    assert PD_WAIT_S <= elapsed_s < PD_WAIT_S + 30, elapsed_s
    # A handoff keyed under another model is never found: no wait at all.
    other = {"raykv_pd": {**HANDOFF, "model": "another-llama"}}
    prompt = prompt_tokens(PROMPT_TOKENS, seed=42)
    ids, cached, elapsed_s = _decode(engines, prompt, other)
    assert ids == _plain(engines, prompt) and cached == 0 and elapsed_s < PD_WAIT_S
