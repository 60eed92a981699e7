"""`raykv status`'s routing rates: what each engine replica measured online and publishes to
raykv's router (raykv's own engines: cluster/serving/rates.py; vLLM engines through their
RaykvConnector: cluster/serving/engine_rates.py), and the paths pooled as the router pools them
(policies/cost_routing.pooled).

The figures are read as Serve's controller reads them, from each replica actor's
`record_routing_stats` (the replicas are found by class name in the GCS's actor table), so
every replica answers, not whichever a handle would route to.
"""

from __future__ import annotations

import ray
from rich.table import Table

from cluster.core.sizing import format_bytes
from policies.cost_routing import PREFILL_ATTENTION, pooled, prior_rates

# Serve replicas that publish rates: raykv's engine, and Ray Serve LLM's server with raykv's
# router (its deployment is named after the server class: "RaykvLLMServer:<model>").
ENGINE_CLASSES = ("EngineDeployment", "RaykvLLMServer")
TIMEOUT_S = 5.0
ATTENTION_SHOWN_TOKENS = 4096  # the attention column: what it adds to a prompt this long


def replica_rates() -> dict[str, dict]:
    """Replica actor name -> its published rates ({} for none: no Serve app, no engines)."""
    from ray._private.state import actors

    out = {}
    for actor in actors().values():
        class_name = actor.get("ActorClassName", "")
        if actor.get("State") != "ALIVE" or not any(c in class_name for c in ENGINE_CLASSES):
            continue
        try:
            replica = ray.get_actor(actor["Name"], namespace="serve")
            stats = ray.get(replica.record_routing_stats.remote(), timeout=TIMEOUT_S)
        except (ray.exceptions.RayError, ValueError, TimeoutError):
            continue  # gone or busy: the next status asks again
        if "rates" not in stats:  # a vLLM server without RaykvConnector
            continue
        out[actor["Name"]] = {"node_id": stats.get("node_id", ""), **(stats.get("rates") or {})}
    return out


def routing_rates() -> dict:
    """{"replicas": per replica what it publishes, "pooled": the estimates a router makes of
    them (priors where nothing was measured yet)}."""
    replicas = replica_rates()
    return {"replicas": replicas, "pooled": pooled(prior_rates(), replicas).as_dict()}


def rates_tables(rates: dict) -> list[Table]:
    paths = Table(title="routing: fetch paths (measured online, pooled over replicas; "
                        "0 samples = the prior)")
    for column in ("source", "bytes/s", "latency", "samples"):
        paths.add_column(column, justify="left" if column == "source" else "right")
    for name, path in rates["pooled"]["paths"].items():
        bandwidth = path["bytes_per_s"]
        paths.add_row(name, "free" if bandwidth == float("inf") else
                      f"{format_bytes(int(bandwidth))}/s", f"{path['latency_s'] * 1e3:.2f} ms",
                      str(path["num_samples"]))
    replicas = Table(title="routing: engine replicas (measured online)")
    for column in ("replica", "node", "prefill tokens/s", "attention, 4k prompt", "samples",
                   "step overhead", "compute s/request", "lookups past vLLM", "lookup delay",
                   "lookups skipped"):
        replicas.add_column(column, justify="left" if column in ("replica", "node")
                            else "right")
    for name, row in rates["replicas"].items():
        replicas.add_row(name[-24:], row.get("node_id", "")[:12],
                         f"{row.get('prefill_tokens_per_s', 0.0):,.0f}",
                         _attention_cell(row), str(row.get("prefill_samples", 0)),
                         f"{row['step_overhead_s'] * 1e3:.1f} ms" if "step_overhead_s" in row
                         else "",
                         f"{row.get('busy_s_per_request', 0.0):.3f}", *_lookup_cells(row))
    return [paths, replicas]


def _attention_cell(row: dict) -> str:
    """The fitted attention term (prefill_fit.py) as what it adds to a 4,096-token prompt's
    prefill; blank where the replica publishes none."""
    per_pair_s = row.get(PREFILL_ATTENTION)
    return "" if per_pair_s is None else f"{per_pair_s * ATTENTION_SHOWN_TOKENS ** 2 * 1e3:.1f} ms"


def _lookup_cells(row: dict) -> list[str]:
    """A vLLM engine's lookups (cluster/serving/lookup_worth.py): how often raykv held more
    than vLLM's own cache, their delay, and the prompts not asked about; blank for others."""
    if "lookups_timed" not in row:
        return ["", "", ""]
    return [f"{row['lookups_beyond_vllm']:.0%}", f"{row['lookup_delay_ms']:.1f} ms",
            f"{row['lookups_skipped']:,} of {row['lookups_skipped'] + row['lookups_timed']:,}"]
