"""KV-aware routing: the pure ranking (policies/routing.py) and RaykvRouter on Serve's
RequestRouter API with fake replicas (ray.serve's FakeRunningReplica) and a fake directory."""

from __future__ import annotations

import asyncio

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.test_utils import FakeRunningReplica

from cluster.core.directory_index import DirectoryIndex
from cluster.serving.engine import GenerationRequest
from cluster.serving.router import RaykvRouter
from policies.routing import (
    REMOTE_WEIGHT,
    TIER_WEIGHTS,
    ReplicaLoad,
    has_hits,
    prefix_scores,
    rank_replicas,
)

DEVICE, HOST, DISK = 0, 1, 2


# ---- the pure ranking ------------------------------------------------------------------


def test_scores_weigh_each_page_by_the_best_copy_a_node_can_use():
    located = [(("a", DEVICE), ("b", DISK)), (("a", HOST),), (("c", DISK),)]
    scores = prefix_scores(located, ["a", "b", "c", "d"])
    assert scores["a"] == pytest.approx(TIER_WEIGHTS[DEVICE] + TIER_WEIGHTS[HOST] + REMOTE_WEIGHT)
    assert scores["b"] == pytest.approx(TIER_WEIGHTS[DISK] + 2 * REMOTE_WEIGHT)
    assert scores["c"] == pytest.approx(2 * REMOTE_WEIGHT + TIER_WEIGHTS[DISK])
    assert scores["d"] == pytest.approx(3 * REMOTE_WEIGHT)
    assert scores["a"] > scores["b"] > scores["d"] and scores["b"] == pytest.approx(scores["c"])


def test_device_beats_host_beats_disk_beats_another_node():
    assert TIER_WEIGHTS[DEVICE] > TIER_WEIGHTS[HOST] > TIER_WEIGHTS[DISK] > REMOTE_WEIGHT > 0


def test_no_prefix_means_no_hits():
    assert not has_hits(prefix_scores([], ["a", "b"]))
    assert has_hits(prefix_scores([(("a", HOST),)], ["b"]))  # remote pages still count


def loads(*specs):
    return [ReplicaLoad(r, n, q) for r, n, q in specs]


def test_rank_by_score_ties_share_a_rank():
    replicas = loads(("r1", "a", 0), ("r2", "b", 0), ("r3", "c", 0), ("r4", "a", 1))
    ranks = rank_replicas(replicas, {"a": 5.0, "b": 1.0, "c": 5.0}, max_imbalance=2)
    assert ranks == [["r1", "r3", "r4"], ["r2"]]


def test_an_overloaded_replica_drops_to_the_last_rank():
    replicas = loads(("r1", "a", 5), ("r2", "b", 1), ("r3", "c", None))
    ranks = rank_replicas(replicas, {"a": 9.0, "b": 1.0, "c": 0.0}, max_imbalance=2)
    assert ranks == [["r2"], ["r3"], ["r1"]]
    assert rank_replicas(replicas, {"a": 9.0}, max_imbalance=5)[0] == ["r1"]


def test_nothing_to_rank():
    assert rank_replicas([], {"a": 1.0}, 2) == []


# ---- RaykvRouter with fake replicas ------------------------------------------------------


class AsyncFakeDirectory:
    """prefix_refs like DirectoryHandle's, answered by real DirectoryIndex shards."""

    def __init__(self, failing: bool = False):
        self.index = DirectoryIndex()
        self.failing = failing
        self.calls = 0

    def place(self, node_id: str, keys: list, tier: int) -> None:
        self.index.replace_node(node_id, 1, [(k, tier) for k in keys], seq=1)

    def prefix_refs(self, keys: list):
        self.calls += 1

        async def answer():
            if self.failing:
                raise TimeoutError("directory down")
            return self.index.prefix_runs(keys)

        return [list(range(len(keys)))], [answer()]


KEYS = [bytes([i]) * 16 for i in range(6)]


def pending(keys: list[bytes]) -> PendingRequest:
    request = GenerationRequest("prompt", [1, 2, 3], page_keys=b"".join(keys))
    metadata = RequestMetadata(request_id="r", internal_request_id="i")
    return PendingRequest(args=[request], kwargs={}, metadata=metadata)


class PublishingReplica(FakeRunningReplica):
    """A fake replica whose routing stats (what Serve polls from record_routing_stats) a
    test sets."""

    routing_stats: dict = {}


def make_router(directory) -> tuple[RaykvRouter, list[FakeRunningReplica]]:
    router = RaykvRouter(deployment_id=DeploymentID(name="engine", app_name="raykv"),
                         handle_source=DeploymentHandleSource.UNKNOWN,
                         use_replica_queue_len_cache=True)
    router.initialize_state(max_imbalance=2, directory=directory)
    replicas = [PublishingReplica(f"r{i}", node_id=node) for i, node in
                enumerate(("node-a", "node-b", "node-c"))]
    router.update_replicas(replicas)
    return router, replicas


def ids(ranks) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_the_replica_on_the_node_holding_the_prefix_ranks_first():
    async def main():
        directory = AsyncFakeDirectory()
        directory.place("node-b", KEYS[:4], HOST)
        router, replicas = make_router(directory)
        ranks = await router.choose_replicas(replicas, pending(KEYS))
        assert ids(ranks) == [["r1"], ["r0", "r2"]]
        assert router.counters == {"ranked": 1, "fallback": 0, "lookup_failures": 0,
                                   "cost_routed": 0, "recomputed": 0, "engine_hits": 0,
                                   "predicted": 0}

    asyncio.run(main())


def test_a_busy_replica_loses_its_rank_to_the_balance_bound():
    async def main():
        directory = AsyncFakeDirectory()
        directory.place("node-b", KEYS[:4], DEVICE)
        router, replicas = make_router(directory)
        router._replica_queue_len_cache.update(replicas[1].replica_id, 3)
        router._replica_queue_len_cache.update(replicas[0].replica_id, 0)
        ranks = await router.choose_replicas(replicas, pending(KEYS))
        assert ids(ranks) == [["r0", "r2"], ["r1"]]

    asyncio.run(main())


@pytest.mark.parametrize("case", ["no keys", "no hits", "directory down"])
def test_without_hits_it_falls_back_to_power_of_two(case):
    async def main():
        directory = AsyncFakeDirectory(failing=case == "directory down")
        router, replicas = make_router(directory)
        request = pending([] if case == "no keys" else KEYS)
        ranks = await router.choose_replicas(replicas, request)
        # two random choices, the less loaded first, one rank each
        assert 1 <= len(ranks) <= 2 and all(len(rank) == 1 for rank in ranks)
        assert {i for rank in ids(ranks) for i in rank} <= {"r0", "r1", "r2"}
        assert router.counters["fallback"] == 1
        assert router.counters["lookup_failures"] == (case == "directory down")
        assert directory.calls == (0 if case == "no keys" else 1)

    asyncio.run(main())


# ---- RaykvRouter by cost, once replicas publish their measured rates ---------------------

PAGE_TOKENS, PAGE_BYTES = 16, 1 << 20


def publish(replicas, disk_bytes_per_s: float, busy_s: float = 0.01) -> None:
    """Each replica's routing stats as EngineDeployment.record_routing_stats makes them:
    2,000 prefill tokens/s (8 ms a page), host at 1 GB/s, another node's pages at 200 MB/s
    (5 ms a page), disk at `disk_bytes_per_s`."""
    for replica in replicas:
        replica.routing_stats = {"rates": {
            "paths": {"host": [1e9, 0.0, 5], "disk": [disk_bytes_per_s, 0.0, 5],
                      "remote": [2e8, 0.0, 5]},
            "prefill_tokens_per_s": 2000.0, "prefill_samples": 5,
            "page_tokens": PAGE_TOKENS, "page_bytes": PAGE_BYTES,
            "busy_s_per_request": busy_s}}


def pending_tokens(keys: list[bytes], num_tokens: int) -> PendingRequest:
    request = pending(keys)
    request.args[0].token_ids = list(range(num_tokens))
    return request


def test_by_cost_the_least_estimated_ttft_ranks_first_and_the_rest_follow():
    async def main():
        directory = AsyncFakeDirectory()
        directory.place("node-b", KEYS[:4], HOST)
        directory.place("node-c", KEYS[:2], HOST)
        router, replicas = make_router(directory)
        publish(replicas, disk_bytes_per_s=1e9)
        request = pending_tokens(KEYS, 100)
        ranks = await router.choose_replicas(replicas, request)
        assert ids(ranks) == [["r1"], ["r2"], ["r0"]]  # 4 pages here, 2 there, none
        assert router.counters["cost_routed"] == 1 and router.counters["recomputed"] == 0
        assert request.args[0].max_fetch_tokens is None  # fetch the whole prefix
        assert router.rates.prefill_rate("r1") == 2000.0
        assert router.last_decision.chosen.fetch_pages == 4

    asyncio.run(main())


def test_by_cost_a_slow_tier_is_recomputed_and_the_engine_is_told():
    async def main():
        directory = AsyncFakeDirectory()
        directory.place("node-b", KEYS[:4], DISK)
        router, replicas = make_router(directory)
        publish(replicas, disk_bytes_per_s=1e6)  # ~1 s a page against 8 ms to recompute
        for replica in replicas:  # and another node's copy as slow (it is on a disk there)
            replica.routing_stats["rates"]["paths"]["remote"] = [1e6, 0.0, 5]
        request = pending_tokens(KEYS, 100)
        await router.choose_replicas(replicas, request)
        assert router.last_decision.recompute and router.last_decision.fetch_pages == 0
        assert request.args[0].max_fetch_tokens == 0
        assert router.counters["recomputed"] == 1

    asyncio.run(main())


def test_by_cost_a_long_queue_outweighs_the_prefix():
    async def main():
        directory = AsyncFakeDirectory()
        directory.place("node-b", KEYS[:4], HOST)
        router, replicas = make_router(directory)
        publish(replicas, disk_bytes_per_s=1e9, busy_s=1.0)
        router._replica_queue_len_cache.update(replicas[1].replica_id, 3)  # ~3 s of wait
        ranks = await router.choose_replicas(replicas, pending_tokens(KEYS, 100))
        assert ids(ranks)[-1] == ["r1"]

    asyncio.run(main())


def test_a_replica_whose_request_outlives_its_prediction_loses_a_tie_to_idle_ones(
        monkeypatch):
    """Every node holds the prefix; a request goes to one replica and is still in flight
    after the work the router priced it at (8 ms here). The next request, of equal cost
    everywhere, goes to an idle replica: the busy one waits its published step overhead
    (policies/queue_wait.py). Before, it read as idle and took a third of such ties."""
    clock = [100.0]
    monkeypatch.setattr("cluster.serving.router.time.monotonic", lambda: clock[0])

    async def main():
        directory = AsyncFakeDirectory()
        for node in ("node-a", "node-b", "node-c"):
            directory.place(node, KEYS[:4], HOST)
        router, replicas = make_router(directory)
        publish(replicas, disk_bytes_per_s=1e9)
        for replica in replicas:
            replica.routing_stats["rates"]["step_overhead_s"] = 0.02
        first = pending_tokens(KEYS, 100)
        busy = (await router.choose_replicas(replicas, first))[0][0].replica_id.unique_id
        clock[0] += 1.0  # long past its priced work; Serve has not said it ended
        second = pending_tokens(KEYS, 100)
        second.metadata.internal_request_id = "j"
        ranks = await router.choose_replicas(replicas, second)
        assert ids(ranks)[0] != [busy] and ids(ranks)[-1] == [busy]
        waits = {e.replica_id: e.queue_wait_s for e in router.last_decision.estimates}
        assert waits[busy] == pytest.approx(0.02)

    for _ in range(12):  # the first pick is random among equals
        asyncio.run(main())


def test_a_repeated_prefix_follows_its_first_request_before_the_directory_hears(monkeypatch):
    """The first request's pages are not in the directory yet (its engine is computing
    them): the second request with the same prefix goes to the same node all the same, and
    once the memory has expired it is routed as if new."""
    clock = [100.0]
    monkeypatch.setattr("cluster.serving.router.time.monotonic", lambda: clock[0])

    async def main():
        directory = AsyncFakeDirectory()
        router, replicas = make_router(directory)
        router.routed.ttl_s = 3.0
        first = await router.choose_replicas(replicas, pending(KEYS))
        node = first[0][0].node_id
        assert router.counters["fallback"] == 1
        for _ in range(5):
            again = await router.choose_replicas(replicas, pending(KEYS[:5]))
            assert again[0][0].node_id == node
        assert router.counters["ranked"] == 5 and router.counters["fallback"] == 1
        assert router.counters["predicted"] == 5
        clock[0] += 3.5  # past the TTL: nothing is predicted any more
        await router.choose_replicas(replicas, pending(KEYS))
        assert router.counters["fallback"] == 2

    asyncio.run(main())


def test_the_directory_s_answer_comes_before_the_routed_memory():
    async def main():
        directory = AsyncFakeDirectory()
        router, replicas = make_router(directory)
        router.routed.record(KEYS, "node-a", 0.0)  # routed long ago... but not expired
        router.routed.ttl_s = 1e9
        directory.place("node-c", KEYS, DEVICE)  # the directory knows where they are now
        ranks = await router.choose_replicas(replicas, pending(KEYS))
        assert ids(ranks)[0] == ["r2"]

    asyncio.run(main())


# ---- the virtual queue (policies/queue_wait.py), fed by routing and Serve's completions ---


def pending_id(keys: list[bytes], num_tokens: int, request_id: str) -> PendingRequest:
    request = GenerationRequest("prompt", list(range(num_tokens)), page_keys=b"".join(keys))
    metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id)
    return PendingRequest(args=[request], kwargs={}, metadata=metadata)


def test_a_routed_requests_predicted_work_queues_on_its_replica_until_serve_says_it_ended(
        monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("cluster.serving.router.time.monotonic", lambda: clock[0])

    async def main():
        directory = AsyncFakeDirectory()
        directory.place("node-b", KEYS[:4], HOST)
        router, replicas = make_router(directory)
        publish(replicas, disk_bytes_per_s=1e9, busy_s=0.001)
        ranks = await router.choose_replicas(replicas, pending_id(KEYS, 20_000, "big"))
        assert ids(ranks)[0] == ["r1"]
        chosen = router.last_decision.chosen
        work_s = chosen.fetch_s + chosen.prefill_s  # ~9.97 s of prefill at 2,000 tokens/s
        assert router.virtual_queue.wait_s("r1", 100.0) == pytest.approx(work_s)
        assert work_s > 9.0
        # 1 request in flight x 1 ms (a count x mean) would keep the next one on r1; the
        # virtual queue knows ~9 s are left there a second later.
        clock[0] = 101.0
        ranks = await router.choose_replicas(replicas, pending_id(KEYS, 100, "small"))
        assert ids(ranks)[0] != ["r1"] and ids(ranks)[-1] == ["r1"]
        assert router.last_decision.chosen.queue_wait_s == 0.0
        router.on_request_completed(replicas[1].replica_id, "big")  # Serve: it ended
        assert router.virtual_queue.wait_s("r1", 101.0) == 0.0  # drained
        ranks = await router.choose_replicas(replicas, pending_id(KEYS, 100, "third"))
        assert ids(ranks)[0] == ["r1"]

    asyncio.run(main())


def test_requests_other_routers_sent_count_at_the_replicas_seconds_per_request():
    async def main():
        directory = AsyncFakeDirectory()
        directory.place("node-b", KEYS[:4], HOST)
        router, replicas = make_router(directory)
        publish(replicas, disk_bytes_per_s=1e9, busy_s=1.0)
        # Serve's count for r1: 3 in flight, none this router's: 3 x 1 s.
        router._replica_queue_len_cache.update(replicas[1].replica_id, 3)
        await router.choose_replicas(replicas, pending_id(KEYS, 100, "a"))
        estimates = {e.replica_id: e for e in router.last_decision.estimates}
        assert estimates["r1"].queue_wait_s == pytest.approx(3.0)
        # "a" went elsewhere (its work is this router's own there); Serve counts it among
        # that replica's 1 in flight: no other router's request, so "a" is not counted twice.
        where, _, a_s = router.virtual_queue.entries["a"]
        assert where != "r1"
        by_id = {r.replica_id.unique_id: r for r in replicas}
        router._replica_queue_len_cache.update(by_id[where].replica_id, 1)
        await router.choose_replicas(replicas, pending_id(KEYS, 100, "b"))
        estimates = {e.replica_id: e for e in router.last_decision.estimates}
        assert 0.0 < estimates[where].queue_wait_s <= a_s
        assert estimates["r1"].queue_wait_s == pytest.approx(3.0)

    asyncio.run(main())


def test_a_request_chosen_again_counts_once_and_moves_where_serve_sent_it(monkeypatch):
    monkeypatch.setattr("cluster.serving.router.time.monotonic", lambda: 50.0)

    async def main():
        directory = AsyncFakeDirectory()
        directory.place("node-b", KEYS[:4], HOST)
        router, replicas = make_router(directory)
        publish(replicas, disk_bytes_per_s=1e9)
        request = pending_id(KEYS, 4_000, "x")
        await router.choose_replicas(replicas, request)
        await router.choose_replicas(replicas, request)  # Serve's backoff asks again
        assert router.virtual_queue.in_flight == {"r1": 1}
        work_s = router.virtual_queue.entries["x"][2]
        router.on_request_routed(request, replicas[2].replica_id, None)  # r1 was full
        assert router.virtual_queue.in_flight == {"r2": 1}
        assert router.virtual_queue.wait_s("r2", 50.0) == pytest.approx(work_s)
        assert router.virtual_queue.wait_s("r1", 50.0) == 0.0
        router.on_request_completed(replicas[2].replica_id, "x")
        assert router.virtual_queue.entries == {}

    asyncio.run(main())
