"""RaykvRouter: a Ray Serve request router that sends a request where its time to first
token is least, counting every tier of every node.

It runs where the handle is: in the ingress replica. raykv's own ingress tokenized the prompt
and put its page keys on the request; a Ray Serve LLM request carries text, and the router
renders it as its vLLM engine will (cluster/serving/engine_tokens.py: vLLM's renderer,
configured from the engine's arguments), keys those ids and hands them to the engine (a
chat's in its `kv_transfer_params`, a completion's as its prompt), so the prompt is rendered
once. Per request it asks the directory (one call per shard) where each
page of the longest cached prefix lives (node and tier). Then, per candidate replica
(policies/cost_routing.py):

    TTFT = queue wait (policies/queue_wait.py: the predicted seconds of the work this
           router sent there that is still ahead, a virtual queue fed by its routing and
           Serve's on_request_completed, at least one engine step while one of them is in
           flight; plus the requests there that other routers sent,
           Serve's queue-length cache less this router's own, x the replica's compute
           seconds per request)
         + the cheapest cut of: fetch the prefix's first pages from the best source the
           replica can use (its node's device, host or disk tier, or another node's copy),
           recompute the rest
         + prefill at the replica's prefill rate

The rates are measured online by the replicas (cluster/serving/rates.py) and reach routers
through Serve's routing stats (`record_routing_stats`); paths are pooled over replicas. Ranks
go out best first, one replica each; Serve takes the first with room. The chosen cut rides on
the request (`GenerationRequest.max_fetch_tokens`), so the engine recomputes what is cheaper
to recompute. Before any replica has published its page size, it ranks by the weighted
prefix (policies/routing.py); without hits, or when the directory does not answer in time,
it is power-of-two choices.

The engine tier: replicas whose vLLM engines publish KV-cache events advertise where in their
routing stats (ENGINE_EVENTS, cluster/serving/vllm_events_server.py). The router follows them
(cluster/serving/engine_events.py) and counts, per replica, the prompt's leading pages its
engine already holds: those cost nothing to fetch (`best_sources(..., engine_pages=...)`), and
an engine hit is a hit even where the directory has none. vLLM replicas publish the rates their
RaykvConnector measures (its loads per source tier, the engine's prefill rate and compute
seconds per request: cluster/serving/engine_rates.py) in the same form; before a replica has
published any, the cost path takes the page size from the router's own keying and the priors,
and counts each queued request ahead as one prefill of this prompt at the replica's rate.
Without events, routing is as before.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.common import PendingRequest
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    RequestRouter,
    RunningReplica,
)

from actors.handles import DirectoryHandle, merge_shard_prefixes
from cluster.api import running_config
from cluster.core.routed_prefixes import RoutedPrefixes
from cluster.core.spec import ModelSpec
from cluster.serving.engine_tokens import EngineTokens
from cluster.serving.engine_tokens import forward as forward_token_ids
from cluster.serving.prompt_keys import PromptKeys
from cluster.serving.vllm_plan import forced_fetch_limit, with_fetch_limit, with_routed_hit
from policies.cost_routing import (
    Candidate,
    Decision,
    Prompt,
    RateEstimates,
    best_sources,
    decide,
    pooled,
    prior_rates,
    queued_requests,
)
from policies.queue_wait import VirtualQueue, own_or_mean, queue_waits
from policies.routing import ReplicaLoad, has_hits, prefix_scores, rank_replicas

log = logging.getLogger("raykv.router")
KEY_BYTES = 16
ENGINE_EVENTS = "raykv_engine_events"  # routing-stats key: where a replica's engine publishes
# A pick-only caller's pick counts as in flight this long when nothing better is known (a
# prefill of a few hundred tokens on a CPU engine).
PICK_HOLD_S = 0.1


class RaykvRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """KV-aware routing on Serve's RequestRouter API (see module docstring)."""

    def initialize_state(self, max_imbalance: int = 1, lookup_timeout_s: float = 0.5,
                         directory=None, prompt_keys: dict | None = None,
                         engine_events=None, routed_ttl_s: float = 3.0,
                         picks_expire: bool = False) -> None:
        """`max_imbalance`: queue-length lead past which a replica loses its rank (in the
        weighted-prefix ranking, before replicas publish their rates).
        `directory`: a DirectoryHandle (tests pass a fake); found lazily otherwise.
        `prompt_keys`: for requests that carry text, not page keys (Ray Serve LLM's), how to
        key them: {"tokenizer_dir", "spec": ModelSpec fields, "namespace", "page_tokens"},
        and optionally "renderer" (engine_tokens.renderer_spec: render as the engine does)
        and "forward_token_ids" (default true: hand the engine the ids so rendered).
        `engine_events`: the engine tier's follower (watch, held_pages: tests pass a fake);
        made on first need (an EngineEvents over the prompt keys' chain) otherwise.
        `routed_ttl_s`: how long a prompt's pages count as held on the node it was sent to,
        past the directory's answer (cluster/core/routed_prefixes.py).
        `picks_expire`: the caller only picks (Ray's direct streaming: Serve never says when
        the request ends), so each pick counts as in flight at its replica for the time the
        router estimated (`_hold_s`), then expires."""
        self.max_imbalance = max_imbalance
        self.lookup_timeout_s = lookup_timeout_s
        self._directory = directory
        self._prompt_keys = None
        if prompt_keys:
            renderer = prompt_keys.get("renderer")
            self._prompt_keys = PromptKeys(
                prompt_keys["tokenizer_dir"], ModelSpec(**prompt_keys["spec"]),
                prompt_keys.get("namespace", "default"), prompt_keys["page_tokens"],
                engine=EngineTokens(renderer) if renderer else None,
                forward_ids=prompt_keys.get("forward_token_ids", True))
        self.engine_events = engine_events
        self.counters = {"ranked": 0, "fallback": 0, "lookup_failures": 0, "cost_routed": 0,
                         "recomputed": 0, "engine_hits": 0, "predicted": 0}
        self.rates: RateEstimates = prior_rates()  # the latest pooled (for stats and tests)
        self.last_decision: Decision | None = None
        # Per replica: requests this router sent there that have not finished (Serve's
        # send and done hooks below); Serve's own cache stays empty unless strict.
        self.in_flight: dict[str, int] = {}
        # Where this router sent each page key lately, until the directory hears of it.
        self.routed = RoutedPrefixes(routed_ttl_s)
        self.picks_expire = picks_expire
        # Per replica: the predicted seconds of the work this router sent there, not done
        # (the simulator's raykv router keeps the same: policies/queue_wait.py).
        self.virtual_queue = VirtualQueue()

    def on_send_request(self, replica_id) -> None:
        super().on_send_request(replica_id)
        self.in_flight[replica_id.unique_id] = self.in_flight.get(replica_id.unique_id, 0) + 1

    def decrement_queue_len_cache(self, replica_id) -> None:
        """Serve calls this when a request it sent finishes, whatever the outcome (named for
        the cache it keeps only when strict; it is called either way)."""
        super().decrement_queue_len_cache(replica_id)
        count = self.in_flight.get(replica_id.unique_id, 0)
        self.in_flight[replica_id.unique_id] = max(0, count - 1)

    def on_new_queue_len_info(self, replica_id, num_ongoing_requests: int) -> None:
        """The replica's own count (strict mode's accept or reject) replaces the router's."""
        super().on_new_queue_len_info(replica_id, num_ongoing_requests)
        self.in_flight[replica_id.unique_id] = num_ongoing_requests

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """Serve sent the request (strict mode's accepted send): where it went is where its
        work is queued, if not the replica this router ranked first."""
        super().on_request_routed(pending_request, replica_id, result)
        request_id = _request_id(pending_request)
        if request_id is not None:
            self.virtual_queue.moved(request_id, replica_id.unique_id, time.monotonic())

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        """Serve calls this once per dispatched request, when the whole request ends."""
        super().on_request_completed(replica_id, internal_request_id)
        self.virtual_queue.completed(internal_request_id, time.monotonic())

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id.unique_id, None)

    def _queued(self, replica: RunningReplica) -> int:
        return queued_requests(self._replica_queue_len_cache.get(replica.replica_id),
                               self.in_flight.get(replica.replica_id.unique_id, 0))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        keys_blob = await self._keys_of(pending_request)
        request_id = _request_id(pending_request)
        if request_id is not None:  # Serve asks again while no replica has room: once
            self.virtual_queue.withdraw(request_id, time.monotonic())
        ranks, chosen_ttft_s = await self._choose(candidate_replicas, pending_request, keys_blob)
        _force_cut(pending_request)
        if keys_blob and ranks and ranks[0]:
            self.routed.record(_split_keys(keys_blob), ranks[0][0].node_id, time.monotonic())
        self._queue_work(ranks, chosen_ttft_s, request_id)
        if self.picks_expire:
            self._count_pick(ranks, chosen_ttft_s, request_id)
        return ranks

    def _queue_work(self, ranks: list[list[RunningReplica]], ttft_s: float | None,
                    request_id) -> None:
        """The request's predicted work onto the virtual queue of the replica ranked first
        (Serve takes it unless it is full; on_request_routed moves it where strict sends
        say): its fetch and prefill as `decide` priced them when cost-routed, else the
        replica's compute seconds per request (`_hold_s`)."""
        chosen = next((rank[0] for rank in ranks if rank), None)
        if chosen is None or request_id is None:
            return
        estimate = self.last_decision.chosen if ttft_s is not None else None
        work_s = estimate.fetch_s + estimate.prefill_s if estimate is not None \
            else self._hold_s(chosen, None)
        self.virtual_queue.routed(chosen.replica_id.unique_id, request_id, work_s,
                                  time.monotonic())

    def _count_pick(self, ranks: list[list[RunningReplica]], ttft_s: float | None,
                    request_id=None) -> None:
        """Count the replica a pick-only caller takes (the first of the first non-empty rank,
        as Serve's `_choose_replicas_with_backoff` hands them out) as in flight until
        `_hold_s` has passed; then its virtual queue hears the request end too (Serve will
        not say)."""
        chosen = next((rank[0] for rank in ranks if rank), None)
        if chosen is None:
            return
        replica_id = chosen.replica_id
        self.on_send_request(replica_id)
        asyncio.get_running_loop().call_later(self._hold_s(chosen, ttft_s),
                                              self._pick_done, replica_id, request_id)

    def _pick_done(self, replica_id, request_id) -> None:
        self.decrement_queue_len_cache(replica_id)
        if request_id is not None:
            self.virtual_queue.completed(request_id, time.monotonic())

    def _hold_s(self, replica: RunningReplica, ttft_s: float | None) -> float:
        """How long a pick counts as in flight: the chosen replica's estimated TTFT when the
        pick was cost-routed; else the replica's published compute seconds per request, else
        the pooled mean of the replicas'; PICK_HOLD_S before any replica published."""
        if ttft_s is not None:
            return ttft_s
        published = {r.replica_id.unique_id: _published(r) for r in self.curr_replicas.values()}
        busy = _own_or_mean(published, "busy_s_per_request").get(replica.replica_id.unique_id)
        return busy or PICK_HOLD_S

    async def _choose(self, candidate_replicas: list[RunningReplica],
                      pending_request: PendingRequest | None, keys_blob: bytes
                      ) -> tuple[list[list[RunningReplica]], float | None]:
        """The ranks, and the chosen replica's estimated TTFT when cost-routed (else None)."""
        located = await self._locate(keys_blob) if keys_blob else None
        if located is not None and self._prompt_keys is not None:
            _tell_hit(pending_request, len(located) * self._prompt_keys.page_tokens)
        # Pages a request routed moments ago is computing or storing: the directory has not
        # heard of them yet (the told hit above stays the directory's).
        answered = len(located or [])
        located = self.routed.extend(located or [], _split_keys(keys_blob), time.monotonic())
        self.counters["predicted"] += len(located) > answered
        engine_pages = self._engine_pages(candidate_replicas, keys_blob)
        scores = prefix_scores(located, {r.node_id for r in candidate_replicas})
        if not has_hits(scores) and not any(engine_pages.values()):
            self.counters["fallback"] += 1
            ranks = await PowerOfTwoChoicesRequestRouter.choose_replicas(
                self, candidate_replicas=candidate_replicas, pending_request=pending_request)
            # The two choices, the less loaded first, one rank each: the replica the request
            # goes to is then the first (its pages are remembered as there).
            if ranks and len(ranks[0]) > 1:
                ranks = [[r] for r in sorted(ranks[0], key=self._queued)] + ranks[1:]
            return ranks, None
        self.counters["engine_hits"] += any(engine_pages.values())
        ranks = self._by_cost(candidate_replicas, located, pending_request, engine_pages,
                              len(keys_blob) // KEY_BYTES)
        if ranks:
            self.counters["cost_routed"] += 1
            return ranks, self.last_decision.chosen.ttft_s  # set by _by_cost, no await since
        loads = [ReplicaLoad(r.replica_id.unique_id, r.node_id, self._queued(r))
                 for r in candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        self.counters["ranked"] += 1
        return [[by_id[i] for i in rank]
                for rank in rank_replicas(loads, scores, self.max_imbalance)], None

    def _by_cost(self, replicas: list[RunningReplica], located: list,
                 pending_request: PendingRequest | None, engine_pages: dict[str, int],
                 num_keys: int) -> list[list[RunningReplica]]:
        """Ranks by estimated TTFT, one replica each ([] while no replica has published its
        page size, unless engines' events give the router pages to weigh); the best one's cut
        is put on the request. `num_keys`: the prompt's full pages."""
        published = {r.replica_id.unique_id: _published(r) for r in replicas}
        sized = [p for p in published.values() if p.get("page_bytes")]
        geometry = (sized[0]["page_tokens"], sized[0]["page_bytes"]) if sized \
            else self._own_geometry(engine_pages)
        if geometry is None:
            return []
        page_tokens, page_bytes = geometry
        self.rates = pooled(prior_rates(), published)
        prompt = Prompt(_num_tokens(pending_request, max(len(located), num_keys), page_tokens),
                        page_tokens, page_bytes)
        sources = _sources(located, replicas, engine_pages)
        busy = _own_or_mean(published, "busy_s_per_request")
        replicas = random.sample(replicas, len(replicas))  # decide() breaks ties by order
        # The queue waits: policies/queue_wait.py, which the simulator's router calls too:
        # this router's virtual queue, and the requests it did not send (Serve's count, or
        # its own where Serve keeps none, less its own) at a count x mean.
        waits = queue_waits(prompt, self.virtual_queue,
                            {r.replica_id.unique_id: self._queued(r) for r in replicas},
                            busy, self.rates, time.monotonic(),
                            _own_or_mean(published, "step_overhead_s"))
        candidates = [Candidate(r.replica_id.unique_id, sources[r.replica_id.unique_id],
                                waits[r.replica_id.unique_id])
                      for r in replicas]
        decision = decide(prompt, candidates, self.rates)
        self.last_decision = decision
        self.counters["recomputed"] += decision.recompute
        _cut(pending_request, decision.fetch_pages * page_tokens if decision.recompute else None)
        by_id = {r.replica_id.unique_id: r for r in replicas}
        rest = sorted((e for e in decision.estimates if e.replica_id != decision.replica_id),
                      key=lambda e: e.ttft_s)
        return [[by_id[decision.replica_id]], *[[by_id[e.replica_id]] for e in rest]]

    def _own_geometry(self, engine_pages: dict[str, int]) -> tuple[int, int] | None:
        """(page tokens, page bytes) as the router keys prompts, where engines hold pages of
        them (before any replica has published its page size); None otherwise."""
        if self._prompt_keys is None or not any(engine_pages.values()):
            return None
        page_tokens = self._prompt_keys.page_tokens
        return page_tokens, self._prompt_keys.spec.page_bytes(page_tokens)

    def _engine_pages(self, replicas: list[RunningReplica], keys_blob: bytes) -> dict[str, int]:
        """Per replica whose engine publishes events: the prompt's leading pages it holds."""
        advertised = {r.replica_id.unique_id: a for r in self.curr_replicas.values()
                      if (a := _advertised_events(r))}
        if not advertised or not keys_blob or self._follower() is None:
            return {}
        self.engine_events.watch(advertised)
        keys = _split_keys(keys_blob)
        return self.engine_events.held_pages(keys, [r.replica_id.unique_id for r in replicas])

    def _follower(self):
        """The engine tier's follower; made once the prompts' key chain is known."""
        chain = self._prompt_keys.known_chain if self._prompt_keys is not None else None
        if self.engine_events is None and chain is not None:
            from cluster.serving.engine_events import EngineEvents

            self.engine_events = EngineEvents(chain)
        return self.engine_events

    async def _keys_of(self, pending_request: PendingRequest | None) -> bytes:
        """The prompt's page keys: those the request carries, else keyed from the ids the
        engine will prefill, which go to the engine ready-made where they may."""
        keys_blob = _page_keys(pending_request)
        if keys_blob or self._prompt_keys is None or pending_request is None \
                or not pending_request.args:
            return keys_blob
        request = pending_request.args[0]
        prompt = await self._prompt_keys.request_ids(request)
        if prompt.forward:
            forward_token_ids(request, prompt.token_ids)
        if self._prompt_keys.known_chain is not None:  # hashing the pages: microseconds
            return self._prompt_keys.keys(prompt.token_ids)
        # The first time, the chain's secret is asked of the service: off the loop.
        return await asyncio.to_thread(self._prompt_keys.keys, prompt.token_ids)

    async def _locate(self, keys_blob: bytes) -> list | None:
        """Where each page of the prompt's longest cached prefix is; None when the
        directory did not answer in time."""
        keys = _split_keys(keys_blob)
        try:
            directory = await self._directory_handle()
            positions, refs = directory.prefix_refs(keys)
            answers = await asyncio.wait_for(asyncio.gather(*refs), self.lookup_timeout_s)
        except Exception as error:  # a slow or dead directory: route without it
            self.counters["lookup_failures"] += 1
            log.warning("directory lookup for routing failed: %s", error)
            return None
        return merge_shard_prefixes(len(keys), positions, answers)

    async def _directory_handle(self):
        if self._directory is None:
            config = await asyncio.to_thread(running_config)
            self._directory = await asyncio.to_thread(DirectoryHandle.lookup, config)
        return self._directory


def _request_id(pending_request: PendingRequest | None) -> str | None:
    """Serve's id of the request (the one on_request_completed names), None without one."""
    metadata = getattr(pending_request, "metadata", None)
    return getattr(metadata, "internal_request_id", None) or None


def _split_keys(keys_blob: bytes) -> list[bytes]:
    return [keys_blob[i : i + KEY_BYTES] for i in range(0, len(keys_blob), KEY_BYTES)]


def _page_keys(pending_request: PendingRequest | None) -> bytes:
    if pending_request is None or not pending_request.args:
        return b""
    return getattr(pending_request.args[0], "page_keys", b"") or b""


def _advertised_events(replica: RunningReplica) -> dict | None:
    """Where the replica's engine publishes its KV events (None: it does not)."""
    stats = getattr(replica, "routing_stats", None) or {}
    return stats.get(ENGINE_EVENTS)


def _sources(located: list, replicas: list[RunningReplica],
             engine_pages: dict[str, int]) -> dict[str, tuple[str, ...]]:
    """Per replica, the best source of each page: its node's (best_sources), its engine's
    own blocks first where it holds some (replicas on one node hold different blocks)."""
    by_node = best_sources(located, {r.node_id for r in replicas})
    out = {}
    for r in replicas:
        held = engine_pages.get(r.replica_id.unique_id, 0)
        out[r.replica_id.unique_id] = best_sources(located, [r.node_id], {r.node_id: held}
                                                   )[r.node_id] if held else by_node[r.node_id]
    return out


def _published(replica: RunningReplica) -> dict:
    """What the replica's `record_routing_stats` published of its rates ({} before)."""
    stats = getattr(replica, "routing_stats", None) or {}
    return stats.get("rates") or {}


def _own_or_mean(published: dict, figure: str) -> dict[str, float]:
    """Each replica's published `figure` (its compute seconds per request, its step
    overhead); before it has one, the others' mean (policies/queue_wait.py)."""
    return own_or_mean({r: p.get(figure) for r, p in published.items()})


def _num_tokens(pending_request: PendingRequest | None, num_pages: int,
                page_tokens: int) -> int:
    """The prompt's tokens; for a request that carries only text, at least its full pages
    and one token more."""
    token_ids = getattr(pending_request.args[0], "token_ids", None) \
        if pending_request is not None and pending_request.args else None
    return len(token_ids) if token_ids else num_pages * page_tokens + 1


def _request_of(pending_request: PendingRequest | None):
    """The request a pending request carries (its first argument), or None."""
    return pending_request.args[0] if pending_request is not None and pending_request.args \
        else None


def _cut(pending_request: PendingRequest | None, max_fetch_tokens: int | None) -> None:
    """Tell the engine to fetch no more than the cut (it travels with the request; None: the
    whole prefix): raykv's engine reads `max_fetch_tokens`; a vLLM engine's RaykvConnector
    reads it from the request's `kv_transfer_params` (vLLM's own field, which reaches the
    scheduler's Request)."""
    request = _request_of(pending_request)
    if hasattr(request, "max_fetch_tokens"):
        request.max_fetch_tokens = max_fetch_tokens
    elif hasattr(request, "kv_transfer_params"):
        request.kv_transfer_params = with_fetch_limit(request.kv_transfer_params,
                                                      max_fetch_tokens)


def _force_cut(pending_request: PendingRequest | None) -> None:
    """A client's forced cut (vllm_plan.FORCE_KEY) replaces the router's, whatever path routed
    the request; the router's own is then only counted (`last_decision`)."""
    request = _request_of(pending_request)
    params = getattr(request, "kv_transfer_params", None)
    forced = forced_fetch_limit(params)
    if forced is not None and not hasattr(request, "max_fetch_tokens"):
        request.kv_transfer_params = with_fetch_limit(params, forced)


def _tell_hit(pending_request: PendingRequest | None, hit_tokens: int) -> None:
    """Tell a vLLM engine's RaykvConnector what raykv held of the prompt when it was routed
    (in the request's `kv_transfer_params`): it takes that as its lookup's answer and
    schedules the request at once (vllm_plan.HIT_KEY). A request without that field (raykv's
    own engine looks up with its fetch) is left alone."""
    request = _request_of(pending_request)
    if request is not None and hasattr(request, "kv_transfer_params") \
            and not hasattr(request, "max_fetch_tokens"):
        request.kv_transfer_params = with_routed_hit(request.kv_transfer_params, hit_tokens)
