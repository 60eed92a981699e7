"""What every `raykv bench` benchmark shares: timing and statistics, the facts of the machine,
the JSON result (figures, "ratios", "goals", "met"), a private Ray with the service started and
stopped cleanly, KV tensors whose pages hold known bytes, and rich tables.

A result is a dict that a benchmark fills and hands to `finish`:

    {"benchmark", "unit", "config", "machine", ...figures..., "ratios", "goals", "notes"}
    finish() adds "met" and machine.loadavg_end, prints the ratio table, writes the JSON.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable

import numpy as np

from cluster.core.spec import ModelSpec

# The rules (rounds, pairing, goals, the JSON) live in the harness; re-exported for callers.
from cluster.tools.bench.harness import (  # noqa: F401
    finish,
    goal_text,
    goals_met,
    machine_info,
    per_round_ratios,
    print_tables,
    ratio_table,
    table,
)

MiB = 1 << 20
# Llama-3.1-8B's KV geometry, bf16: 128 KiB per token, so a 1 MiB page is 8 tokens.
LLAMA_8B_KV = ModelSpec("bench-llama-3.1-8b", 32, 8, 128, "bfloat16")
STOP_TIMEOUT_S = 30.0

# ---- timing and statistics ------------------------------------------------------------------


def timed(run: Callable[[], object]) -> tuple[float, object]:
    """(seconds run() took, what it returned)."""
    start_s = time.perf_counter()
    value = run()
    return time.perf_counter() - start_s, value


def median_s(run: Callable[[], object], reps: int) -> float:
    """Median seconds of `reps` calls of run() (no warm-up: callers whose runs change state,
    such as puts of fresh pages, decide themselves)."""
    return statistics.median(timed(run)[0] for _ in range(reps))


def warm_median_s(run: Callable[[], object], reps: int) -> float:
    """One untimed warm-up call, then median_s."""
    run()
    return median_s(run, reps)


def percentile_ms(times_s: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100, linear interpolation) of times in seconds, in ms."""
    return float(np.percentile(np.fromiter(times_s, dtype=np.float64), q)) * 1e3


def latency_ms(times_s: list[float]) -> dict[str, float]:
    """{"p50_ms", "p99_ms", "mean_ms"} of times in seconds."""
    return {"p50_ms": percentile_ms(times_s, 50), "p99_ms": percentile_ms(times_s, 99),
            "mean_ms": statistics.fmean(times_s) * 1e3}


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median of the pairwise ratios: figures taken side by side in rounds, so that a noisy
    neighbour slowing one round slows both sides of its ratio alike."""
    return statistics.median(per_round_ratios(numerators, denominators))


def geomean(values: Iterable[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def medians(rounds: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in rounds.items()}


# ---- the result -----------------------------------------------------------------------------


# ---- Ray and the service --------------------------------------------------------------------


def ensure_local_ray(object_store_bytes: int, num_cpus: int | None = None) -> bool:
    """Start a private local Ray (this node a kv node) unless one is up; True if started here.

    address="local": never attach to another process's cluster on this machine.
    """
    import ray

    from cluster.core.config import CacheConfig

    if ray.is_initialized():
        return False
    ray.init(address="local", num_cpus=num_cpus, resources={CacheConfig().node_resource: 1},
             include_dashboard=False, object_store_memory=object_store_bytes,
             logging_level=logging.WARNING, log_to_driver=False)
    return True


def _service_actor_names() -> list[str]:
    """Names of the running service's actors (none when it is not running)."""
    import ray

    from actors.handles import CONTROL_LOOP_NAME, CONTROLLER_NAME, DIRECTORY_NAME, NODE_NAME
    from cluster.api import running_config

    try:
        config = running_config()
    except RuntimeError:
        return []
    shards = [DIRECTORY_NAME.format(shard=i) for i in range(config.num_directory_shards)]
    nodes = [NODE_NAME.format(node_id=n["NodeID"]) for n in ray.nodes() if n["Alive"]]
    return shards + nodes + [CONTROLLER_NAME, CONTROL_LOOP_NAME]


def _alive(names: list[str], namespace: str) -> list[str]:
    import ray

    alive = []
    for name in names:
        try:
            ray.get_actor(name, namespace=namespace)
            alive.append(name)
        except ValueError:
            pass
    return alive


def stop_service(stop_fn: Callable[[], None] | None = None) -> None:
    """stop() (node actors release their /dev/shm slabs), or `stop_fn` (cluster.purge: their
    disk slabs too), then wait until the named actors are gone, so that the next start()
    creates fresh ones."""
    from cluster import stop
    from cluster.core.config import CacheConfig

    names = _service_actor_names()
    (stop_fn or stop)()
    namespace = CacheConfig().ray_namespace
    deadline_s = time.monotonic() + STOP_TIMEOUT_S
    while (alive := _alive(names, namespace)) and time.monotonic() < deadline_s:
        time.sleep(0.1)
    if alive:
        raise RuntimeError(f"raykv actors {alive} still alive {STOP_TIMEOUT_S:.0f} s after stop()")


def start_service(config, spec):
    """A fresh service with `config` (any running one stopped first), and a client for spec."""
    from cluster import connect, start

    stop_service()
    start(config)
    return connect(spec)


def map_slabs(client, epoch: int) -> None:
    """Map the client's node slabs of `epoch` (benchmarks that take a get or put apart)."""
    from cluster.calls import run_sync

    if not run_sync(client.view.slabs.ensure(epoch), client.timeout_s):
        raise RuntimeError("could not map the node's slabs")


# ---- KV tensors holding known pages ---------------------------------------------------------


def page_kv(spec, page_tokens: int, num_pages: int):
    """kv [L, 2, H, num_pages * page_tokens, D] whose page i holds peers.page_pool's page i."""
    import torch

    from cluster.tools.bench.peers import page_pool

    page_bytes = spec.page_bytes(page_tokens)
    pool = torch.from_numpy(page_pool(page_bytes, num_pages))
    pages = pool.view(spec.torch_dtype()).view(num_pages, *spec.page_shape(page_tokens))
    shape = spec.page_shape(num_pages * page_tokens)
    return pages.permute(1, 2, 3, 0, 4, 5).reshape(shape).clone()


def touched_like(kv):
    """A tensor like kv whose memory is already faulted in (filled with 0xA5)."""
    import torch

    out = torch.empty_like(kv)
    out.view(torch.uint8).fill_(0xA5)
    return out


def check_same(got, expected, what: str) -> None:
    """Raise RuntimeError unless the two tensors hold the same bytes."""
    import torch

    if not torch.equal(got.view(torch.uint8), expected.view(torch.uint8)):
        raise RuntimeError(f"{what} came back with different bytes than were put")


# ---- tables ---------------------------------------------------------------------------------


class Steps:
    """A progress bar that moves on at each phase, and the seconds each phase took."""

    def __init__(self, progress, name: str, total: int) -> None:
        self.progress, self.name = progress, name
        self.task = progress.add_task(name, total=total)
        self.phase, self.since_s = "", 0.0
        self.phase_s: dict[str, float] = {}

    def __call__(self, phase: str) -> None:
        self._lap()
        self.phase, self.since_s = phase, time.perf_counter()
        self.progress.update(self.task, description=f"{self.name}: {phase}", advance=1)

    def _lap(self) -> None:
        if self.phase:
            self.phase_s[self.phase] = time.perf_counter() - self.since_s

    def laps(self) -> dict[str, float]:
        """The phases so far (the current one closed), and start afresh."""
        self._lap()
        laps, self.phase, self.phase_s = self.phase_s, "", {}
        return laps
