"""The sizes of a `raykv bench vllm-serve` run: the trace's thinning, the rounds, the engines'
shape, and raykv's tiers per node, scaled from a GPU node's (node_tiers)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.core.config import MiB
from cluster.core.sim_profiles import PROFILES
from cluster.core.spec import ModelSpec
from cluster.tools.bench.vllm_serve_setups import EngineShape
from cluster.tools.bench.vllm_serve_trace import Thinning

MODEL = "small-llama"  # trace.replay sends this name
TIERS_PROFILE = "h100-400g"  # the node whose DRAM and NVMe raykv's tiers are scaled from


@dataclass(frozen=True, slots=True)
class Plan:
    """One run's sizes."""

    thinning: Thinning
    num_rounds: int
    engine: EngineShape
    host_bytes: int  # raykv's tiers per node
    disk_bytes: int


def node_tiers(engine: EngineShape, profile: str = TIERS_PROFILE) -> tuple[int, int]:
    """raykv's (host, disk) bytes per node, in the proportion a real node of `profile` has
    them to its engine's own KV cache. On an 8 x H100 node serving LLaMA3-70B, vLLM's cache
    is what the weights (141 GB) and a 10 % reserve leave of 640 GB of HBM (435 GB), while
    raykv's host tier is 1 TB of the DGX's 2 TB DRAM (2.3x) and its disk two 3.84 TB drives
    (17.7x): cluster/core/sim_profiles.py, with its sources. Until 211c56a this benchmark
    gave raykv 12 + 24 MiB a node, 1.1x the engine's 32 MiB, less than any GPU node has."""
    node = PROFILES[profile]
    vllm_kv_bytes = 2 * node.device_kv_bytes  # raykv's device tier is half of vLLM's cache
    return tuple(engine_kv_bytes(engine) * tier_bytes // vllm_kv_bytes // MiB * MiB  # whole MiB
                 for tier_bytes in (node.host_kv_bytes, node.disk_kv_bytes))


def engine_kv_bytes(engine: EngineShape) -> int:
    """One engine's own vLLM cache: its blocks of MODEL's KV."""
    return engine.num_blocks * engine.block_tokens * ModelSpec.preset(MODEL).bytes_per_token


def _plan(thinning: Thinning, engine: EngineShape) -> Plan:
    return Plan(thinning, 3, engine, *node_tiers(engine))


PLAN = _plan(Thinning(every=40, max_blocks=120, speedup=30.0), EngineShape(num_blocks=256))
QUICK_PLAN = _plan(Thinning(every=150, max_blocks=120, speedup=90.0), EngineShape(num_blocks=192))


def plan_for(quick: bool) -> Plan:
    return QUICK_PLAN if quick else PLAN
