"""RaykvConnector: raykv as a vLLM KV connector (vLLM's KVConnectorBase_V1).

    KVTransferConfig(kv_connector="RaykvConnector",
                     kv_connector_module_path="cluster.serving.vllm_connector",
                     kv_role="kv_both",
                     kv_connector_extra_config={"raykv.namespace": "default",
                                                "raykv.ray_address": "auto",
                                                "raykv.model_name": "small-llama"})

Scheduler side (vLLM's engine-core process): one raykv lookup per request, through `prefetch`,
which also starts pulling pages held by other nodes toward this node. The lookup runs in a
background thread; vLLM hears None ("ask again") while it is out, then the hit, cut to whole
vLLM blocks. A hit is loaded asynchronously: vLLM holds the request in WAITING_FOR_REMOTE_KVS
until the worker reports the load finished (get_finished), and schedules other requests
meanwhile. Both cost the request whole engine steps, so the scheduler waits for a lookup, and
has a load made in the step (vLLM's synchronous load), when its measured cost fits what the
step can afford: the step's measured time over its requests (cluster/serving/step_budget.py,
`raykv.load_mode`). A request that raykv's router placed
carries the hit the router's own directory lookup found (kv_transfer_params, vllm_plan.HIT_KEY):
that is its answer at the first ask, with no lookup. Nor is a prompt asked about that vLLM's
own cache holds part of, when lookups of such prompts rarely found more than vLLM held, for
the wait they cost (both measured on this engine: cluster/serving/lookup_worth.py; its
figures are in the published rates). An "ask again" costs a request a whole
engine step: vLLM asks again only after the step it runs meanwhile, and under load the wait
for raykv's answer was the step (0.65 s at the median, where the lookup took 0.05 s:
docs/benchmarks.md, vllm-serve).

Worker side: the hit goes into the request's paged blocks from a loader thread
(cluster/serving/vllm_io.py), and each step's new full prompt pages, and only those, are saved
in the background. A save is also flushed into raykv's directory, and by default the step after
it waits for that (`raykv.save_mode`, step_budget.py), so that another engine finds a prompt's
pages once its request is out.

Rates for raykv's router (cluster/serving/engine_rates.py): the worker times each load per
source tier and hands the samples to the scheduler side on vLLM's own stats path
(get_kv_connector_stats -> update_connector_output: RaykvLoadStats, which vLLM also logs);
the scheduler side times each step (build_connector_meta to its output) and fits the prefill
rate, and writes what it measured, at most once a second, to `raykv.rates_file`, which its
Serve replica publishes to routers (cluster/serving/vllm_events_server.py).

Prefill/decode disaggregation (Ray Serve LLM's P/D; cluster/serving/vllm_pd.py): a prefill
(`do_remote_decode` in its kv_transfer_params) is looked up and saved whole, even what vLLM's
own cache held, and its request_finished returns {"raykv_pd": {"tokens": ...}}; a decode given
those params asks raykv again (None to vLLM, never blocking its scheduler) until the pages are
in the directory, for at most `raykv.pd_wait_s`, then loads them (vllm_plan.py, "P/D").

Pages are keyed by the model's geometry as vLLM runs it (layers of the PP stage, KV heads per
TP rank, head size, cache dtype), by `raykv.model_name` (default: vLLM's served model name),
by the namespace, and per request by what else its KV depends on (its LoRA adapter,
cache_salt, multimodal inputs: cluster/serving/vllm_keys.py). A request with none of these
shares pages with raykv's own engine when both name the same model. The page size is the
running service's: it must be whole vLLM blocks.

A configuration raykv cannot key or store safely (several KV-cache groups, a cache dtype raykv
has no pages for, pages that are not whole blocks) turns the connector off with one log line:
it never writes, and never stops the engine. Every failure is a miss: no service means no
hits, and a load that falls short reports its blocks as invalid, which vLLM recomputes (this
connector sets kv_load_failure_policy to "recompute": a cache miss must never fail a request).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from cluster.core import cpu_sets
from cluster.serving.engine_rates import EngineMeter, RatesFile, Step
from cluster.serving.prefill_fit import attention_pairs, scheduled_spans
from cluster.serving.step_budget import StepBudget
from cluster.serving.vllm_checks import unsupported_groups
from cluster.serving.vllm_handoff import DecodeGate
from cluster.serving.vllm_io import KVMover
from cluster.serving.vllm_keys import is_plain, request_salt
from cluster.serving.vllm_layout import BlockLayout
from cluster.serving.vllm_plan import (
    Handoff,
    NewRequest,
    RunningRequest,
    StepPlanner,
    asked_tokens,
    fetch_limit,
    handoff_of,
    handoff_params,
    is_plain_params,
    is_producer,
    loadable_tokens,
    page_misfit,
    raykv_can_add,
    routed_hit,
)
from cluster.serving.vllm_service import (
    Answer,
    Lookups,
    RaykvSettings,
    ServiceLink,
    UnsupportedConfig,
    spec_of,
)
from cluster.serving.vllm_stats import IN_STEP, LOADS, RaykvLoadStats, RaykvWorkerOff
from cluster.serving.vllm_worker_side import RaykvMetadata, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = init_logger(__name__)  # vLLM's handlers: these lines land in the engine's log
# P/D: how soon a decode asks raykv again for its prefill's pages (the directory hears of a
# put at the node's next event flush, 0.05 s by default).
HANDOFF_RETRY_S = 0.02
RATES_WRITE_S = 1.0  # how often the scheduler side rewrites its rates file (at most)


class RaykvConnector(WorkerSide, KVConnectorBase_V1):
    """vLLM KV connector backed by raykv; see the module docstring. Its worker side is
    vllm_worker_side.WorkerSide."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # A raykv miss must be recomputed, never fail the request (vLLM's default is "fail");
        # the scheduler reads this right after creating its connector.
        self._kv_transfer_config.kv_load_failure_policy = "recompute"
        settings = RaykvSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self._block_size = vllm_config.cache_config.block_size
        self._planner: StepPlanner | None = None
        self._mover: KVMover | None = None
        self._layers: list[torch.Tensor] = []
        self._layout: BlockLayout | None = None
        self._failed_blocks: set[int] = set()
        self._unloaded: list[tuple[str, set[int]]] = []  # loads with no mover to run them
        self._loads_failed_in_step, self.skipped_saves = False, 0
        self._worker_off: str | None = None
        self._link: ServiceLink | None = None
        self._lookups: Lookups | None = None
        self._gate: DecodeGate | None = None  # P/D decodes' waits, with the link
        self._meter: EngineMeter | None = None  # scheduler side, once the page size is known
        self._rates: RatesFile | None = None  # scheduler side, with the meter
        self.num_routed_answers = 0  # requests answered by the router's hit, no lookup
        self._first_asked_s: dict[str, float] = {}  # id -> when its lookup was first polled
        # What a step may wait on raykv
        self._budget = StepBudget(settings.load_mode, save_mode=settings.save_mode)
        self._sync_loads: dict[str, float] = {}  # id -> deadline of its load in the step
        self._epoch = b""  # in every key's salt after a cache reset (reset_cache)
        self.num_sync_loads = 0
        self._live: set[str] = set()  # requests scheduled and not finished (the idle budget)
        self.why_off = unsupported_groups(kv_cache_config)
        try:
            spec = None if self.why_off else spec_of(vllm_config, settings.model_name)
        except UnsupportedConfig as error:
            self.why_off = str(error)
        if self.why_off:
            log.error("raykv connector off: %s", self.why_off)
            return
        self._link = ServiceLink(settings, spec)
        self._gate = DecodeGate(settings.pd_wait_s, spec.name, settings.namespace)
        if role == KVConnectorRole.WORKER:  # off the cores vLLM's CPU build bound it to
            cpu_sets.run_threads_on(cpu_sets.spare_cpus())
        with cpu_sets.widened():  # Ray's threads, started at the connect, go there too
            client = self._link.client()  # connect while the engine starts, not on its first
        if role == KVConnectorRole.SCHEDULER:
            self._lookups = Lookups(self._link)
            if client is not None:
                self._planner_for(client.page_tokens)

    # ---- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.why_off:
            return 0, False
        self._budget.idle = not self._live  # nothing runs: waiting on raykv holds nobody up
        request_id, planner = request.request_id, self._planner
        if planner is not None and request_id in planner.hits:  # asked again: no new lookup
            return self._load_mode(request_id, planner.rematched(
                request_id, num_computed_tokens, len(request.prompt_token_ids or ())))
        prompt = list(request.prompt_token_ids or [])
        num_loadable = loadable_tokens(self._block_size, len(prompt))
        num_asked = asked_tokens(self._block_size, len(prompt))
        params = getattr(request, "kv_transfer_params", None)
        # A prefill for a remote decode (P/D) is looked up, keyed and saved even when vLLM's
        # own cache holds it: its decode loads it from raykv.
        producing = is_producer(params)
        if planner is not None and num_computed_tokens >= num_loadable and not producing:
            # vLLM holds all its own cache can: no lookup (raykv could add at most the last
            # block less one token, not worth an engine step's wait)
            planner.matched(request_id, num_computed_tokens, num_computed_tokens, len(prompt))
            return 0, False
        answer = self._routed_answer(request, params, num_asked)
        if answer is None and is_plain_params(params) and planner is not None \
                and not raykv_can_add(num_asked, planner.page_tokens, num_computed_tokens):
            # No whole page past vLLM's hit to ask for: keyed (its new pages are saved), no
            # lookup, nothing loaded
            answer = Answer(self._salt(request), num_computed_tokens, planner.page_tokens)
        if answer is None and is_plain_params(params):  # Ray's KVAwareRouter's too
            answer = self._unasked(request, num_computed_tokens, num_loadable)
        if answer is None:
            asked_s = _now_s()  # before the poll: a lookup waited for in the step costs that
            answer = self._lookups.poll(request_id, prompt[:num_asked],
                                        lambda: self._salt(request), self._budget)
            self._timed_lookup(request_id, params, num_computed_tokens, answer, asked_s)
        if answer is None:
            return None, False  # in flight: vLLM asks again next step
        limit = fetch_limit(params)
        if self._awaits_handoff(request_id, answer, params, num_asked):
            return None, False  # its prefill's pages are not all in raykv yet: ask again
        if limit is not None and limit < answer.num_tokens:  # raykv's router chose to recompute
            answer = Answer(answer.salt, limit, answer.page_tokens)
        matched = self._answered(request_id, num_computed_tokens, answer, len(prompt))
        if producing and self._planner is not None:
            self._planner.producers.add(request_id)
        return matched

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        sync_timeout_s = self._sync_loads.pop(request.request_id, None)
        if self._planner is not None and num_external_tokens > 0:
            self._planner.allocated(request.request_id, list(request.prompt_token_ids or []),
                                    blocks.get_block_ids()[0], num_external_tokens,
                                    sync_timeout_s)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._live.update(r.req_id for r in scheduler_output.scheduled_new_reqs)
        if self._planner is None:
            return RaykvMetadata()
        self._scheduled(scheduler_output)
        new = [NewRequest(r.req_id, list(r.prompt_token_ids), r.block_ids[0],
                          r.num_computed_tokens, scheduler_output.num_scheduled_tokens[r.req_id])
               for r in scheduler_output.scheduled_new_reqs if r.prompt_token_ids]
        cached = scheduler_output.scheduled_cached_reqs
        running = [RunningRequest(req_id, None if blocks is None else blocks[0],
                                  req_id in cached.resumed_req_ids,
                                  cached.num_computed_tokens[i],
                                  scheduler_output.num_scheduled_tokens[req_id])
                   for i, (req_id, blocks) in enumerate(zip(cached.req_ids,
                                                            cached.new_block_ids, strict=True))]
        loads, saves = self._planner.step(new, running)
        meter = self._meter
        before_s, after_s = self._budget.save_waits(
            {spec.request_id: len(spec.token_ids) - spec.start for spec in saves},  # one each
            self._planner.tracked, self._link.call_timeout_s(),
            meter.recompute_s if meter is not None else lambda _: 0.0,
            ending={spec.request_id for spec in saves if spec.final})
        return RaykvMetadata(loads, saves, before_s, after_s)

    def update_connector_output(self, connector_output: Any) -> None:
        note = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(note, RaykvWorkerOff) and not self.why_off:
            self.why_off = f"a worker turned it off: {note.why_off}"
            log.error("raykv connector off: %s", self.why_off)
        if self._planner is not None:
            self._planner.reported(set(connector_output.finished_recving or ()),
                                   set(connector_output.invalid_block_ids or ()))
        stats = getattr(connector_output, "kv_connector_stats", None)
        if self._meter is not None and isinstance(stats, RaykvLoadStats):
            self._meter.loaded(stats.samples)
            self._meter.loaded_in_step(stats.in_step)

    def get_kv_connector_stats(self) -> RaykvLoadStats | None:
        """Worker: the loads' rate samples since the last step (None: no load). Scheduler
        (asked once a step, after the step's output): the step is timed, and the rates file
        rewritten when due."""
        if self.role == KVConnectorRole.SCHEDULER:
            self._step_done()
            return None
        samples, in_step = self._mover.take_samples() if self._mover is not None else ([], [])
        if not samples and not in_step:
            return None
        return RaykvLoadStats({LOADS: [list(s) for s in samples],
                               IN_STEP: [list(s) for s in in_step]})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> RaykvLoadStats | None:
        return RaykvLoadStats(dict(data) if data else {})

    @property
    def requires_kv_delivery(self) -> bool:
        """False (vLLM's default is True for kv_both): a save copies its blocks out within
        its step (wait_for_save), so a preemption frees nothing a save still reads, and a
        save that never lands is a future miss. True would have vLLM recompute the tokens a
        preempted request had in flight under async scheduling, for nothing."""
        return False

    def reset_cache(self) -> bool:
        """vLLM's reset of external caches (reset_prefix_cache(reset_connector=True), which
        pause_generation(clear_cache=True) asks for around a weight update). raykv's pages
        are other engines' too, so none is deleted: this engine keys its pages anew instead,
        under a fresh random epoch in every key's salt. It never loads a page computed
        before (with other weights, say), nor saves one under the old keys, and the router's
        hits, keyed without the epoch, are looked up again. Requests known to the scheduler
        side are forgotten and asked afresh, but for those whose load is already under way."""
        self._epoch = os.urandom(16)
        forgotten = self._planner.forget_unloading() if self._planner is not None else 0
        if self._lookups is not None:
            self._lookups.forget_all()
        self._first_asked_s.clear()
        log.info("raykv connector: cache reset; this engine's pages are keyed anew (%d "
                 "requests asked afresh)", forgotten)
        return True

    def _salt(self, request: Request) -> bytes | None:
        return request_salt(request, self._epoch)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        handoff = None
        if self._planner is not None:
            if is_producer(getattr(request, "kv_transfer_params", None)):
                # P/D: tell the decode what raykv holds, or is being handed, of the prompt.
                handoff = handoff_params(Handoff(
                    self._planner.saved_tokens(request.request_id), self._link.spec.name,
                    self._link.settings.namespace))
            else:  # what its loads filled, for the client (vllm_plan.LOADED_KEY)
                handoff = self._planner.load_outcome(request.request_id)
            self._planner.finished(request.request_id)
        if self._meter is not None:
            self._meter.finished()
        if self._lookups is not None:
            self._lookups.forget(request.request_id)
        self._first_asked_s.pop(request.request_id, None)
        if self._gate is not None:
            self._gate.forget(request.request_id)
        self._sync_loads.pop(request.request_id, None)
        self._live.discard(request.request_id)
        # Saves copy the blocks out in their step, and vLLM keeps a loading request's blocks
        # until the worker reports the load: free them now. A decode needs no blocks held
        # either: it loads the pages from raykv.
        return False, handoff

    def _routed_answer(self, request: Request, params: Any,
                       num_asked: int) -> Answer | None:
        """The router's hit as this request's answer (None: ask raykv): raykv's router
        looked the prompt up to place it, so asking again would only cost the request an
        engine step. Only for a plain request (the router keys the prompt's text alone) that
        is no P/D handoff (a decode waits for its prefill's pages)."""
        hit = routed_hit(params)
        if hit is None or self._planner is None or handoff_of(params) is not None \
                or not is_plain(request) or self._epoch:
            return None
        self.num_routed_answers += 1
        return Answer(b"", min(hit, num_asked), self._planner.page_tokens)

    def _unasked(self, request: Request, num_computed_tokens: int,
                 num_loadable: int) -> Answer | None:
        """The answer for a request not worth a lookup (lookup_worth.py: what lookups of
        prompts vLLM held part of found past its cache, against their delay): raykv is taken
        to hold what vLLM's own cache does, so nothing is loaded, and the request is keyed,
        so that its new pages are saved. None: ask raykv (always under "sync", which asks
        about every request, as LMCache's connector does)."""
        if self._planner is None or self._meter is None or self._budget.mode == "sync" \
                or request.request_id in self._first_asked_s:  # its lookup is out: wait on
            return None
        rest_s = self._meter.measured_recompute_s(num_loadable - num_computed_tokens)
        if self._meter.lookups.worth_asking(num_computed_tokens, rest_s):
            return None
        return Answer(self._salt(request), num_computed_tokens, self._planner.page_tokens)

    def _timed_lookup(self, request_id: str, params: Any, num_computed_tokens: int,
                      answer: Answer | None, asked_s: float) -> None:
        """A plain request's lookup, from its first ask (`asked_s` the first time) to its
        answer, for lookup_worth."""
        if not is_plain_params(params):
            return
        asked_s = self._first_asked_s.setdefault(request_id, asked_s)
        if answer is not None:
            del self._first_asked_s[request_id]
            if self._meter is not None:
                self._meter.lookups.asked(num_computed_tokens, answer.num_tokens,
                                          _now_s() - asked_s)

    def _awaits_handoff(self, request_id: str, answer: Answer, params: Any,
                        num_asked: int) -> bool:
        """P/D decode: whether raykv does not hold its prefill's pages yet, and the request
        is still within `pd_wait_s`; then its lookup is issued again shortly."""
        if self._gate is None or not self._gate.waits(request_id, answer, params, num_asked,
                                                      time.monotonic()):
            return False
        self._lookups.retry(request_id, HANDOFF_RETRY_S)
        return True

    def _answered(self, request_id: str, num_computed_tokens: int, answer: Answer,
                  prompt_len: int) -> tuple[int, bool]:
        planner = self._planner_for(answer.page_tokens)
        if planner is None:
            return 0, False
        if answer.salt is not None:
            planner.keyed(request_id, answer.salt)
        return self._load_mode(request_id, planner.matched(request_id, num_computed_tokens,
                                                           answer.num_tokens, prompt_len))

    def _load_mode(self, request_id: str, num_tokens: int) -> tuple[int, bool]:
        """get_num_new_matched_tokens' answer for a hit of `num_tokens` to load: in the step
        (False: vLLM's synchronous load) when its estimate fits the step's budget and ends
        before its deadline, else in the background (True)."""
        self._sync_loads.pop(request_id, None)
        if num_tokens <= 0:
            return 0, False
        estimate_s = self._meter.load_s(num_tokens) if self._meter is not None else None
        recompute_s = self._meter.recompute_s(num_tokens) if self._meter is not None else 0.0
        deadline_s = self._budget.sync_deadline_s(self._link.call_timeout_s(), recompute_s)
        if not self._budget.may_load_in_step(estimate_s, deadline_s):
            return num_tokens, True
        self._budget.spend(estimate_s or 0.0)
        self._sync_loads[request_id] = deadline_s
        self.num_sync_loads += 1
        return num_tokens, False

    def _planner_for(self, page_tokens: int | None) -> StepPlanner | None:
        """The planner, made once the service's page size is known and fits vLLM's blocks."""
        if self._planner is None and page_tokens is not None and not self.why_off:
            self.why_off = page_misfit(self._block_size, page_tokens)
            if self.why_off:
                log.error("raykv connector off: %s", self.why_off)
            else:
                self._planner = StepPlanner(self._block_size, page_tokens)
                if self.role == KVConnectorRole.SCHEDULER:
                    self._meter = EngineMeter(page_tokens, self._link.spec.page_bytes(page_tokens))
                    path = self._link.settings.rates_file
                    if path:
                        self._rates = RatesFile(self._meter, path, RATES_WRITE_S,
                                                lambda: _now_s())
        return self._planner

    def _scheduled(self, scheduler_output: SchedulerOutput) -> None:
        """Start the step's clock: its tokens, whether it prefills (a new request, or a
        request given more than one token) and its attention pairs; and the next schedule's
        budget."""
        self._budget.step_started(len(scheduler_output.num_scheduled_tokens))
        if self._meter is None:
            return
        num_tokens = scheduler_output.total_num_scheduled_tokens
        prefills = bool(scheduler_output.scheduled_new_reqs) \
            or num_tokens > len(scheduler_output.num_scheduled_tokens)
        pairs = attention_pairs(scheduled_spans(scheduler_output)) if prefills else 0
        self._meter.clock.scheduled(Step(num_tokens, prefills, _now_s(), pairs))

    def _step_done(self) -> None:
        if self._meter is None:
            return
        seconds = self._meter.step_done(_now_s())
        if seconds is not None:
            self._budget.step_timed(seconds)
        if self._rates is not None:
            self._rates.changed()

    # ---- both sides -----------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._meter is not None:
            log.info("raykv lookups: %s", self._meter.lookups.published())
        if self._rates is not None:
            self._rates.close()
        if self._lookups is not None:
            self._lookups.close()
        if self._mover is not None:
            self._mover.close()
            log.info("raykv connector: %s", self._mover.stats)


def _now_s() -> float:
    """The steps' clock."""
    return time.monotonic()
