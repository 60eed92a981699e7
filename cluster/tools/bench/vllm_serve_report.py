"""What `raykv bench vllm-serve` prints and notes: the per-round table and the run's notes."""

from __future__ import annotations

from cluster.core.config import MiB
from cluster.core.trace_scale import ScaledRequest
from cluster.tools.bench import common
from cluster.tools.bench.vllm_serve_breakdown import TTFT_PARTS, split
from cluster.tools.bench.vllm_serve_plan import MODEL, TIERS_PROFILE, Plan, engine_kv_bytes


def print_rounds(rounds: dict[str, list[dict]]) -> None:
    rows = []
    for name, per_round in rounds.items():
        for index, result in enumerate(per_round):
            s = result["summary"]
            parts = split(result["requests"])
            rows.append([f"{name} r{index}", str(s["requests"]), str(s["errors"]),
                         f"{s['ttft_p50_ms']:.0f}", f"{s['ttft_p99_ms']:.0f}",
                         *(_ms(parts[p]["p50"]) for p in TTFT_PARTS[1:]),
                         f"{s['hit_ratio']:.3f}", f"{result['start_s']:.0f}",
                         " ".join(f"{v:.2f}" for v in s["replica_shares"].values())])
    common.print_tables([common.table(
        "the same trace per round, every set-up",
        ["set-up", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "queue p50",
         "prefill p50", "outside p50", "cached/prompt", "app start s", "replica shares"],
        rows)])


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def notes(plan: Plan, traces: list[list[ScaledRequest]]) -> list[str]:
    thin = plan.thinning
    engine_mib = engine_kv_bytes(plan.engine) / MiB
    return [
        f"workload per round: every {thin.every}th conversation of Mooncake's conversation "
        f"trace from the round's offset ({[len(t) for t in traces]} requests), cut to "
        f"{thin.max_blocks} blocks, one trace block = one {plan.engine.block_tokens}-token "
        f"engine block of text, the clock {thin.speedup:g}x faster; open loop, max_tokens 1.",
        f"engines: {MODEL} float32 eager on vLLM's CPU build, {plan.engine.num_blocks} blocks "
        f"of vLLM's own cache each ({engine_mib:g} MiB); raykv's tiers per node: host "
        f"{plan.host_bytes // MiB} MiB + disk {plan.disk_bytes // MiB} MiB, as on a node of the "
        f"{TIERS_PROFILE} profile its DRAM and NVMe stand to its engine's KV (node_tiers).",
        "kv-aware: Ray's KVAwareRouter with direct streaming behind HAProxy (as Ray documents "
        "it); each replica's ZMQ ports moved to free ones (PortedLLMServer), since simulated "
        "nodes share a host. The raykv, prefix and pow2 apps go through the same HAProxy.",
        "Ray 2.60's LLMRouter imports load_chat_template from vllm.entrypoints.chat_utils, "
        "which vLLM 0.32 moved to vllm.renderers.chat_utils (ModuleNotFoundError: every "
        "LLMRouter replica fails to start, so Ray's router never runs); vllm_compat/"
        "sitecustomize.py aliases that one module name for this run's workers. Ray's own "
        "router code runs otherwise unchanged.",
    ]
