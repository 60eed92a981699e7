"""RaykvRouter with the engine tier: replicas that advertise their engines' KV events are
routed with the pages their engines hold (an engine hit is free to fetch), through
cost_routing.best_sources; without events, as before. The follower here is the real pure core
(EngineStream) fed directly, in place of the ZMQ subscriber."""

from __future__ import annotations

import asyncio

from cluster.core.engine_blocks import Stored
from cluster.core.engine_stream import EngineStream
from cluster.core.keys import KeyChain
from cluster.core.spec import ModelSpec
from cluster.serving.router import ENGINE_EVENTS, RaykvRouter
from policies.cost_routing import ENGINE
from tests.unit.test_routing import (
    HOST,
    AsyncFakeDirectory,
    DeploymentHandleSource,
    DeploymentID,
    PublishingReplica,
    ids,
    pending_tokens,
    publish,
)

PAGE = 16
SPEC = {"name": "m", "num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32"}
CHAIN = KeyChain.of(ModelSpec(**SPEC), "default", PAGE)
PROMPT = [(i * 13 + 5) % 700 for i in range(4 * PAGE + 4)]
KEYS = CHAIN.keys(PROMPT)


class Follower:
    """The router's engine-tier follower over real EngineStreams, fed by the test."""

    def __init__(self):
        self.streams: dict[str, EngineStream] = {}
        self.watched: dict = {}

    def watch(self, sources) -> None:
        self.watched = dict(sources)
        for replica_id in sources:
            self.streams.setdefault(replica_id, EngineStream(CHAIN))

    def held_pages(self, keys, replica_ids) -> dict[str, int]:
        return {r: self.streams[r].held_pages(keys) for r in replica_ids if r in self.streams}

    def store(self, replica_id: str, num_tokens: int, block_size: int = 8) -> None:
        """The replica's engine stores the prompt's first `num_tokens` (one batch)."""
        stream = self.streams.setdefault(replica_id, EngineStream(CHAIN))
        count = num_tokens // block_size
        stream.on_batch(stream.next_seq, [Stored(tuple(range(count)), None,
                                                 tuple(PROMPT[: count * block_size]),
                                                 block_size)])


def make_router(directory, follower, advertise=("r2",)):
    router = RaykvRouter(deployment_id=DeploymentID(name="engine", app_name="raykv"),
                         handle_source=DeploymentHandleSource.UNKNOWN,
                         use_replica_queue_len_cache=True)
    router.initialize_state(directory=directory, engine_events=follower, prompt_keys={
        "tokenizer_dir": "/unused", "spec": SPEC, "namespace": "default", "page_tokens": PAGE})
    replicas = [PublishingReplica(f"r{i}", node_id=f"node-{i}") for i in range(3)]
    for replica in replicas:
        replica.routing_stats = {}
    advertise_events(replicas, advertise)
    router.update_replicas(replicas)
    return router, replicas


def advertise_events(replicas, names) -> None:
    """The named replicas' routing stats say where their engines publish KV events."""
    for replica in replicas:
        if replica.replica_id.unique_id in names:
            replica.routing_stats[ENGINE_EVENTS] = {"endpoint": "tcp://10.0.0.2:5000",
                                                    "replay_endpoint": None, "epoch": "e"}


def request():
    return pending_tokens([bytes(k) for k in KEYS], len(PROMPT))


def test_an_engine_hit_routes_by_cost_where_the_directory_has_nothing():
    async def main():
        follower = Follower()
        router, replicas = make_router(AsyncFakeDirectory(), follower)
        follower.store("r2", 4 * PAGE)
        ranks = await router.choose_replicas(replicas, request())
        assert ids(ranks)[0] == ["r2"]
        assert router.counters["cost_routed"] == 1 and router.counters["engine_hits"] == 1
        assert router.last_decision.chosen.fetch_pages == 4
        assert set(follower.watched) == {"r2"}  # only replicas that advertise are followed

    asyncio.run(main())


def test_the_engine_s_own_blocks_beat_this_node_s_host_tier():
    async def main():
        directory, follower = AsyncFakeDirectory(), Follower()
        directory.place("node-0", KEYS, HOST)
        router, replicas = make_router(directory, follower, advertise=("r0", "r2"))
        publish(replicas, disk_bytes_per_s=1e9)
        for replica in replicas:  # host reads cost: 1 MiB pages at 1 MB/s
            replica.routing_stats["rates"]["paths"]["host"] = [1e6, 0.0, 5]
        advertise_events(replicas, ("r0", "r2"))
        follower.store("r2", 4 * PAGE)
        ranks = await router.choose_replicas(replicas, request())
        assert ids(ranks)[0] == ["r2"]
        assert router.last_decision.chosen.fetch_s == 0.0  # the engine's blocks are free

    asyncio.run(main())


def test_a_partial_engine_hit_counts_only_whole_pages():
    async def main():
        follower = Follower()
        router, replicas = make_router(AsyncFakeDirectory(), follower)
        follower.store("r2", 2 * PAGE + 8)  # two pages and half of the third
        assert router._engine_pages(replicas, b"".join(KEYS)) == {"r2": 2}
        ranks = await router.choose_replicas(replicas, request())
        assert ids(ranks)[0] == ["r2"] and router.last_decision.num_cached_pages == 2

    asyncio.run(main())


def test_vllm_replicas_without_rates_count_a_queued_request_as_a_prefill():
    async def main():
        follower = Follower()
        router, replicas = make_router(AsyncFakeDirectory(), follower)
        follower.store("r2", 4 * PAGE)
        router._replica_queue_len_cache.update(replicas[2].replica_id, 3)
        for replica in replicas[:2]:
            router._replica_queue_len_cache.update(replica.replica_id, 0)
        ranks = await router.choose_replicas(replicas, request())
        assert ids(ranks)[-1] == ["r2"]  # 3 prefills of wait outweigh 4 of 4.25 pages

    asyncio.run(main())


def test_without_events_routing_is_as_before():
    async def main():
        follower = Follower()
        router, replicas = make_router(AsyncFakeDirectory(), follower, advertise=())
        follower.store("r2", 4 * PAGE)  # (not advertised: never asked)
        ranks = await router.choose_replicas(replicas, request())
        assert router.counters["fallback"] == 1 and router.counters["engine_hits"] == 0
        assert 1 <= len(ranks) <= 2 and follower.watched == {}  # the two choices

    asyncio.run(main())


def test_engine_sources_lead_the_replica_s_pages():
    from cluster.serving.router import _sources

    replicas = [PublishingReplica(f"r{i}", node_id=f"node-{i}") for i in range(3)]
    located = [[("node-0", 1)], [("node-0", 1)]]
    sources = _sources(located, replicas, {"r0": 1, "r2": 3})
    assert sources["r0"] == (ENGINE, "host")
    assert sources["r1"] == ("remote", "remote")
    assert sources["r2"] == (ENGINE, ENGINE, ENGINE)


def test_the_router_counts_its_own_in_flight_requests_where_serve_keeps_no_queue_lengths():
    """Serve's default (no strict max_ongoing_requests) keeps no queue-length cache: every
    replica reads as idle and the replica holding the prefix would take every request. The
    router's own count of what it sent and has not finished makes a busy replica lose."""
    async def main():
        follower = Follower()
        router = RaykvRouter(deployment_id=DeploymentID(name="engine", app_name="raykv"),
                             handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(directory=AsyncFakeDirectory(), engine_events=follower,
                                prompt_keys={"tokenizer_dir": "/unused", "spec": SPEC,
                                             "namespace": "default", "page_tokens": PAGE})
        replicas = [PublishingReplica(f"r{i}", node_id=f"node-{i}") for i in range(3)]
        for replica in replicas:
            replica.routing_stats = {}
        advertise_events(replicas, ("r0", "r1", "r2"))
        router.update_replicas(replicas)
        follower.store("r2", 4 * PAGE)
        assert ids(await router.choose_replicas(replicas, request()))[0] == ["r2"]
        router.on_send_request(replicas[2].replica_id)
        assert router._replica_queue_len_cache.get(replicas[2].replica_id) is None
        # One prefill of wait outweighs the 4 of 4.25 pages r2's engine holds.
        assert ids(await router.choose_replicas(replicas, request()))[0] != ["r2"]
        assert router.last_decision.chosen.queue_wait_s == 0.0
        r2 = next(e for e in router.last_decision.estimates if e.replica_id == "r2")
        assert r2.queue_wait_s > 0.0
        router.decrement_queue_len_cache(replicas[2].replica_id)  # it finished
        assert ids(await router.choose_replicas(replicas, request()))[0] == ["r2"]
        router.decrement_queue_len_cache(replicas[2].replica_id)  # never below zero
        assert router.in_flight["r2"] == 0

    asyncio.run(main())


def test_ties_spread_over_replicas_that_are_busy_alike():
    """With no prefix anywhere worth the wait, each request goes to a replica with the fewest
    of this router's requests in flight: three requests in a row reach three replicas."""
    async def main():
        follower = Follower()
        router, replicas = make_router(AsyncFakeDirectory(), follower,
                                       advertise=("r0", "r1", "r2"))
        for replica in replicas:
            router._replica_queue_len_cache.invalidate_key(replica.replica_id)
        for name in ("r0", "r1", "r2"):
            follower.store(name, 4 * PAGE)
        chosen = []
        for _ in range(3):
            first = ids(await router.choose_replicas(replicas, request()))[0][0]
            chosen.append(first)
            router.on_send_request(next(r for r in replicas
                                        if r.replica_id.unique_id == first).replica_id)
        assert sorted(chosen) == ["r0", "r1", "r2"]

    asyncio.run(main())


def test_queued_requests_takes_the_larger_count():
    from policies.cost_routing import queued_requests

    assert queued_requests(None, 2) == 2
    assert queued_requests(5, 2) == 5  # the cache heard of other routers' requests
    assert queued_requests(0, 0) == 0


def vllm_request(kv_transfer_params):
    """A request as Ray Serve LLM hands it to the router: the prompt's page keys put on by
    the keyed ingress, vLLM's kv_transfer_params field."""
    from types import SimpleNamespace

    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    request = SimpleNamespace(page_keys=b"".join(bytes(k) for k in KEYS),
                              token_ids=list(range(len(PROMPT))),
                              kv_transfer_params=kv_transfer_params)
    return PendingRequest(args=[request], kwargs={},
                          metadata=RequestMetadata(request_id="r", internal_request_id="i"))


def test_a_forced_cut_replaces_the_router_s_own_which_is_still_decided():
    from cluster.serving.vllm_plan import FETCH_LIMIT_KEY, FORCE_KEY

    async def main():
        follower = Follower()
        router, replicas = make_router(AsyncFakeDirectory(), follower)
        follower.store("r2", 4 * PAGE)
        forced = vllm_request({FORCE_KEY: 0})
        await router.choose_replicas(replicas, forced)
        assert router.last_decision.fetch_pages == 4  # the router would fetch
        assert forced.args[0].kv_transfer_params[FETCH_LIMIT_KEY] == 0  # the client's cut
        plain = vllm_request(None)
        await router.choose_replicas(replicas, plain)
        assert FETCH_LIMIT_KEY not in (plain.args[0].kv_transfer_params or {})

    asyncio.run(main())
