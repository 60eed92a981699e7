"""Replaying a trace (cluster/tools/traces.py), open loop: each request starts at its arrival
time, whatever the ones before it are doing.

    replay_client(trace, ...)   straight through the client: one small replica actor per node
                                (pinned with NodeAffinitySchedulingStrategy), a KVClient per
                                (model, tenant) in it. Per request: aget the prompt's cached
                                prefix (the fetch latency), then, for what was not cached, a
                                stand-in prefill (a sleep per token) and a put, as an engine
                                does; at most `max_ongoing` requests per replica at a time
    replay_http(trace, url)     through the Serve app's OpenAI API (/v1/completions), tenant
                                and priority in the x-raykv-* headers; 429s and 503s recorded

A sampler reads every node actor's stats once a second (memory per model, or per tier until
the node reports models) while a client replay runs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from cluster.tools.traces import TraceRequest, prompt_tokens

START_DELAY_S = 2.0


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    max_ongoing: int = 4  # requests a replica runs at once (an engine's batch)
    prefill_s_per_token: float = 20e-6  # the stand-in prefill of uncached tokens
    sample_period_s: float = 1.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """One replayed request. Times are seconds from the replay's start."""

    request_id: int
    node: int
    model: str
    spike: bool
    arrival_s: float
    start_s: float  # the fetch began (after waiting for a replica slot)
    fetch_s: float
    prefix_tokens: int
    cached_tokens: int
    remote_pages: int = 0  # pages fetched from other nodes (by the client's counter: while
    # requests of the same client overlap, one's pages may be counted in another's)
    status: int = 200  # HTTP replays: the status code


class Replica:
    """The body of a replay replica actor (see ReplayWorkers): clients, slots, the loop."""

    def __init__(self, settings: ReplaySettings):
        self.settings = settings
        self.clients: dict[tuple[str, str], object] = {}
        self.stores: set[asyncio.Task] = set()
        self.slots: asyncio.Semaphore | None = None

    def client(self, model: str, tenant: str):
        from cluster import connect
        from cluster.core.spec import ModelSpec

        if (model, tenant) not in self.clients:
            self.clients[(model, tenant)] = connect(ModelSpec.preset(model), tenant)
        return self.clients[(model, tenant)]

    async def prepare(self, names: list[tuple[str, str]]) -> int:
        """Connect the clients of these (model, tenant) pairs before the clock starts."""
        for model, tenant in names:
            await asyncio.to_thread(self.client, model, tenant)
        return len(self.clients)

    async def run(self, requests: list[TraceRequest], start_wall_s: float) -> list[Outcome]:
        self.slots = asyncio.Semaphore(self.settings.max_ongoing)
        outcomes = await asyncio.gather(*(self._one(r, start_wall_s) for r in requests))
        await asyncio.gather(*self.stores, return_exceptions=True)
        return list(outcomes)

    async def _one(self, request: TraceRequest, start_wall_s: float) -> Outcome:
        await asyncio.sleep(max(0.0, start_wall_s + request.arrival_s - time.time()))
        client = self.clients[(request.model, request.tenant)]
        tokens = prompt_tokens(request)
        async with self.slots:
            begin_wall_s = time.time()
            remote_before = client.counters["remote_pages"]
            cached, _ = await client.aget(tokens)
            fetch_s = time.time() - begin_wall_s
            remote_pages = client.counters["remote_pages"] - remote_before
            missing = len(tokens) - cached
            await asyncio.sleep(missing * self.settings.prefill_s_per_token)
        if cached < request.prefix_tokens:
            task = asyncio.get_running_loop().create_task(self._store(client, tokens))
            self.stores.add(task)
            task.add_done_callback(self.stores.discard)
        return Outcome(request.request_id, request.node, request.model, request.spike,
                       request.arrival_s, begin_wall_s - start_wall_s, fetch_s,
                       request.prefix_tokens, min(cached, request.prefix_tokens), remote_pages)

    async def _store(self, client, tokens: list[int]) -> None:
        import torch

        kv = torch.zeros(client.spec.page_shape(len(tokens)), dtype=client.spec.torch_dtype())
        await client.aput(tokens, kv)


def _replica_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class ReplayReplica(Replica):
        async def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

    return ReplayReplica


class ReplayWorkers:
    """One replay replica per node, pinned there; the only place this replay calls .remote()."""

    def __init__(self, node_ids: list[str], settings: ReplaySettings):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cls = _replica_class()
        self.node_ids = node_ids
        self.actors = [cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node_id=n, soft=False)).remote(settings) for n in node_ids]

    def prepare(self, trace: list[TraceRequest]) -> None:
        import ray

        names = sorted({(r.model, r.tenant) for r in trace})
        ray.get([actor.prepare.remote(names) for actor in self.actors])

    def run(self, trace: list[TraceRequest], start_wall_s: float) -> list[Outcome]:
        import ray

        parts = [[r for r in trace if r.node % len(self.actors) == i]
                 for i in range(len(self.actors))]
        refs = [actor.run.remote(part, start_wall_s)
                for actor, part in zip(self.actors, parts, strict=True)]
        return sorted((o for part in ray.get(refs) for o in part), key=lambda o: o.request_id)

    def kill(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)


class NodeSampler:
    """Every node actor's stats, once a period, on a thread: (time from start, node, stats)."""

    def __init__(self, node_ids: list[str], period_s: float):
        self.node_ids, self.period_s = node_ids, period_s
        self.samples: list[tuple[float, str, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.start_wall_s = 0.0

    def start(self, start_wall_s: float) -> None:
        self.start_wall_s = start_wall_s
        self._thread.start()

    def stop(self) -> list[tuple[float, str, dict]]:
        self._stop.set()
        self._thread.join()
        return self.samples

    def _run(self) -> None:
        import ray

        from actors.handles import NodeHandle
        from cluster.api import running_config

        config = running_config()
        handles = [h for n in self.node_ids if (h := NodeHandle.lookup(n, config))]
        while not self._stop.wait(self.period_s):
            try:
                stats = ray.get([h.stats() for h in handles], timeout=10)
            except Exception:  # a slow sample is skipped, not fatal
                continue
            now_s = time.time() - self.start_wall_s
            self.samples += [(now_s, h.node_id, s) for h, s in zip(handles, stats, strict=True)]


def replay_client(trace: list[TraceRequest], node_ids: list[str],
                  settings: ReplaySettings = ReplaySettings()
                  ) -> tuple[list[Outcome], list[tuple[float, str, dict]]]:
    """Run `trace` through the client on these nodes (request.node indexes them); returns the
    outcomes and the node samples."""
    workers = ReplayWorkers(node_ids, settings)
    sampler = NodeSampler(node_ids, settings.sample_period_s)
    try:
        workers.prepare(trace)
        start_wall_s = time.time() + START_DELAY_S
        sampler.start(start_wall_s)
        outcomes = workers.run(trace, start_wall_s)
    finally:
        samples = sampler.stop()
        workers.kill()
    return outcomes, samples


# ---- through the Serve app ---------------------------------------------------------------------


def prompt_text(request: TraceRequest) -> str:
    """A text prompt of the request's shape (the byte tokenizer makes a char a token)."""
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do".split()
    prefix = " ".join(words[(request.prefix_id * 7 + i) % len(words)] + str(i % 97)
                      for i in range(request.prefix_tokens // 4))
    return f"[{request.prefix_id}] {prefix[: request.prefix_tokens]} #{request.request_id}"


def _post(url: str, model: str, request: TraceRequest, start_wall_s: float,
          bearer_keys: dict[str, str]) -> Outcome:
    import requests

    time.sleep(max(0.0, start_wall_s + request.arrival_s - time.time()))
    begin_wall_s = time.time()
    headers = {"x-raykv-namespace": request.tenant, "x-raykv-priority": request.priority}
    if request.tenant in bearer_keys:
        headers["authorization"] = f"Bearer {bearer_keys[request.tenant]}"
    body = {"model": model, "prompt": prompt_text(request), "max_tokens": 2}
    cached = 0
    try:
        reply = requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
        status = reply.status_code
        if status == 200:
            details = reply.json()["usage"].get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens", 0)
    except requests.RequestException:
        status = 0
    return Outcome(request.request_id, request.node, request.model, request.spike,
                   request.arrival_s, begin_wall_s - start_wall_s, time.time() - begin_wall_s,
                   request.prefix_tokens, cached, 0, status)


def replay_http(trace: list[TraceRequest], url: str, model: str, max_connections: int = 64,
                bearer_keys: dict[str, str] | None = None) -> list[Outcome]:
    """Run `trace` against the Serve app at `url` (every request as `model`, each with its
    tenant's API key in `bearer_keys`, namespace -> key, where the app has keys); an
    Outcome's fetch_s is the whole request's latency there, its status the HTTP status."""
    start_wall_s = time.time() + START_DELAY_S
    keys = bearer_keys or {}
    with ThreadPoolExecutor(max_connections) as pool:
        futures = [pool.submit(_post, url, model, r, start_wall_s, keys) for r in trace]
        return [f.result() for f in futures]
