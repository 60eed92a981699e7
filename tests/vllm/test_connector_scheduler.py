"""RaykvConnector's scheduler side with vLLM's classes but no engine and no Ray: a slow lookup
answers None (vLLM asks again) and then the hit, loaded asynchronously; once the engine has
timed its steps, a lookup and a load that fit a step's budget are waited for and made in the
step; configurations raykv cannot key turn it off with one log line and never stop the
engine."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this "
                                   "tier in .venv-vllm")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

from cluster.serving import vllm_service  # noqa: E402
from cluster.serving.vllm_connector import RaykvConnector, RaykvMetadata  # noqa: E402
from cluster.serving.vllm_plan import (  # noqa: E402
    FETCH_LIMIT_KEY,
    HIT_KEY,
    LOADED_KEY,
    UNFILLED_KEY,
    LoadSpec,
)
from tests.waiting import wait_until  # noqa: E402

BLOCK = 16
PAGE = 32


class SlowClient:
    """A connected raykv client whose lookups wait for `gate`."""

    page_tokens, timeout_s = PAGE, 5.0

    def __init__(self):
        self.gate, self.salts = threading.Event(), []

    def salted(self, extra):
        self.salts.append(extra)
        return self

    def prefetch(self, tokens):
        self.gate.wait(10)
        return len(tokens) // PAGE * PAGE


def vllm_config(cache_dtype="auto"):
    model = SimpleNamespace(dtype=torch.float32, served_model_name="m",
                            get_num_layers=lambda parallel: 2,
                            get_num_kv_heads=lambda parallel: 2,
                            get_head_size=lambda: 8, use_mla=False)
    transfer = SimpleNamespace(kv_connector_extra_config={"raykv.ray_address": "local"},
                               kv_load_failure_policy="fail")
    return SimpleNamespace(kv_transfer_config=transfer, model_config=model,
                           cache_config=SimpleNamespace(block_size=BLOCK,
                                                        cache_dtype=cache_dtype),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                           pipeline_parallel_size=1, rank=0))


def groups(*kinds):
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=kind.__new__(kind))
                                            for kind in kinds])


def request(request_id="r", num_tokens=100, cache_salt=None, kv_transfer_params=None):
    return SimpleNamespace(request_id=request_id, prompt_token_ids=list(range(num_tokens)),
                           prompt_embeds=None, lora_request=None, cache_salt=cache_salt,
                           mm_features=[], kv_transfer_params=kv_transfer_params)


@pytest.fixture
def client(monkeypatch):
    client = SlowClient()
    monkeypatch.setattr(vllm_service.ServiceLink, "_connect", lambda self: client)
    return client


def scheduler(config=None, kv_cache_config=None):
    return RaykvConnector(config or vllm_config(), KVConnectorRole.SCHEDULER,
                          kv_cache_config or groups(FullAttentionSpec))


def ask_until_answered(connector, req, timeout_s=5.0, num_computed_tokens=0):
    deadline_s = time.monotonic() + timeout_s
    while (answer := connector.get_num_new_matched_tokens(req, num_computed_tokens))[0] is None:
        assert time.monotonic() < deadline_s
        time.sleep(0.01)
    return answer


def allocated_then_built(connector, req, block_ids: list[int], num_external_tokens: int):
    """vLLM gives `req` its blocks for `num_external_tokens` from raykv, then builds the
    metadata of a step that schedules nothing: the loads the connector hands its workers."""
    connector.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (block_ids,)),
                                       num_external_tokens)
    return connector.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              resumed_req_ids=set(), num_computed_tokens=[])))


def test_a_slow_lookup_answers_none_then_the_hit_loaded_asynchronously(client):
    connector = scheduler()
    req = request(cache_salt="tenant")
    start_s = time.monotonic()
    assert connector.get_num_new_matched_tokens(req, 0) == (None, False)
    assert time.monotonic() - start_s < 1.0  # the scheduler did not wait for raykv
    assert connector.get_num_new_matched_tokens(req, 0) == (None, False)  # still out
    client.gate.set()
    assert ask_until_answered(connector, req) == (96, True)  # 3 pages; token 99 is computed
    assert len(client.salts) == 1 and client.salts[0] != b""  # one lookup, salted
    assert connector.get_num_new_matched_tokens(req, 32) == (64, True)  # asked again: no call
    metadata = allocated_then_built(connector, req, list(range(10, 17)), 64)
    assert isinstance(metadata, RaykvMetadata)
    assert metadata.loads == [LoadSpec("r", list(range(96)), list(range(10, 17)), 32,
                                       client.salts[0])]
    connector.shutdown()


def test_a_finished_request_says_what_its_loads_filled_and_what_they_did_not(client):
    """The completion's kv_transfer_params carry it: vLLM's cached_tokens counts a load cut
    short whole (its prefill's stats are taken when it is first scheduled)."""
    client.gate.set()
    connector = scheduler()
    whole, short, plain = request("whole"), request("short"), request("plain")
    for req, first_block in ((whole, 0), (short, 10)):
        assert ask_until_answered(connector, req) == (96, True)
        allocated_then_built(connector, req, list(range(first_block, first_block + 7)), 96)
    # The worker filled the short one's first block only (16 of 96 tokens)
    connector.update_connector_output(SimpleNamespace(
        finished_recving={"whole", "short"}, invalid_block_ids={11}, kv_connector_stats=None))
    assert connector.request_finished(whole, []) == (
        False, {LOADED_KEY: 96, UNFILLED_KEY: 0})
    assert connector.request_finished(short, []) == (
        False, {LOADED_KEY: 16, UNFILLED_KEY: 80})
    assert connector.request_finished(plain, []) == (False, None)  # no load: nothing said
    connector.shutdown()


def test_a_prompt_raykv_holds_whole_is_handed_over_less_its_last_token(client):
    """A 96-token prompt (3 whole pages) raykv holds whole: vLLM is handed 95 tokens and
    computes the last one (LMCache's rule), not the last 16-token block; the lookup asked
    for all 96, and the load fills the last block whole."""
    client.gate.set()
    connector = scheduler()
    req = request(num_tokens=96, cache_salt="tenant")
    assert ask_until_answered(connector, req) == (95, True)
    metadata = allocated_then_built(connector, req, list(range(20, 26)), 95)
    assert metadata.loads == [LoadSpec("r", list(range(96)), list(range(20, 26)), 0,
                                       client.salts[0])]
    # vLLM's own cache holding all it can (80 of 96: all but the last block) asks nothing
    held = request("held", num_tokens=96)
    assert connector.get_num_new_matched_tokens(held, 80) == (0, False)
    connector.shutdown()


def test_the_routers_cut_loads_no_more_and_leaves_the_rest_to_recompute(client):
    """raykv's router found the tail of the hit slower to fetch than to recompute: it sent
    its cut in kv_transfer_params, and the connector offers vLLM only the head."""
    client.gate.set()
    connector = scheduler()
    cut = request("cut", kv_transfer_params={FETCH_LIMIT_KEY: 32, "other": 1})
    assert ask_until_answered(connector, cut) == (32, True)  # 1 page of the 3 raykv holds
    assert ask_until_answered(connector, request("whole")) == (96, True)
    odd = request("odd", kv_transfer_params={FETCH_LIMIT_KEY: "32"})
    assert ask_until_answered(connector, odd) == (96, True)  # not the router's: ignored
    connector.shutdown()


def test_the_routers_hit_is_the_answer_at_the_first_ask_without_a_lookup(client):
    """raykv's router looked the prompt up to place it and sent its hit: the connector
    answers with it at once (no "ask again", which costs the request an engine step), capped
    at what vLLM may load, with the router's cut applied; a salted request, a P/D decode or
    a malformed hit still asks raykv."""
    connector = scheduler()  # the client's lookups block on its gate: none may be made here
    routed = request("routed", kv_transfer_params={HIT_KEY: 64})
    assert connector.get_num_new_matched_tokens(routed, 0) == (64, True)
    assert connector.get_num_new_matched_tokens(request("local", kv_transfer_params={
        HIT_KEY: 64}), 32) == (32, True)  # vLLM's own cache holds the first block
    assert connector.get_num_new_matched_tokens(request("long", kv_transfer_params={
        HIT_KEY: 4096}), 0) == (96, True)  # never past the last whole block before token 99
    assert connector.get_num_new_matched_tokens(request("none", kv_transfer_params={
        HIT_KEY: 0}), 0) == (0, False)
    assert connector.get_num_new_matched_tokens(request("cut", kv_transfer_params={
        HIT_KEY: 96, FETCH_LIMIT_KEY: 32}), 0) == (32, True)
    assert client.salts == [] and connector.num_routed_answers == 5
    for asks_raykv in (request("salted", cache_salt="t", kv_transfer_params={HIT_KEY: 64}),
                       request("odd", kv_transfer_params={HIT_KEY: "64"})):
        assert connector.get_num_new_matched_tokens(asks_raykv, 0) == (None, False)
    client.gate.set()
    assert ask_until_answered(connector, request("odd", kv_transfer_params={
        HIT_KEY: "64"})) == (96, True)
    assert allocated_then_built(connector, routed, list(range(10, 17)), 64).loads == [
        LoadSpec("routed", list(range(64)), list(range(10, 17)), 0, b"")]
    connector.shutdown()


def test_a_lookup_past_the_clients_timeout_is_a_miss(client):
    client.timeout_s = 0.3
    connector = scheduler()
    assert ask_until_answered(connector, request()) == (0, False)
    client.gate.set()
    connector.shutdown()


def non_causal_group():
    """A prefix LM's one group: full attention, tagged non-causal (vLLM turns its own prefix
    cache off for it)."""
    spec = FullAttentionSpec.__new__(FullAttentionSpec)
    object.__setattr__(spec, "non_causal", True)
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])


def context_parallel(setting: str):
    config = vllm_config()
    setattr(config.parallel_config, setting, 2)
    return config


@pytest.mark.parametrize("config, kv_cache_config, why", [
    (vllm_config(), groups(FullAttentionSpec, SlidingWindowSpec), "2 KV-cache groups"),
    (vllm_config(), groups(SlidingWindowSpec), "SlidingWindowSpec"),
    (vllm_config("fp8_e5m2"), None, "fp8_e5m2"),
    (vllm_config(), non_causal_group(), "non-causally"),
    (context_parallel("decode_context_parallel_size"), None, "decode_context_parallel_size=2"),
    (context_parallel("prefill_context_parallel_size"), None,
     "prefill_context_parallel_size=2"),
])
def test_what_raykv_cannot_key_turns_it_off_with_one_line(client, config,
                                                          kv_cache_config, why):
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        connector = RaykvConnector(config, role, kv_cache_config or groups(FullAttentionSpec))
        assert why in connector.why_off
        assert connector.get_num_new_matched_tokens(request(), 0) == (0, False)
        connector.register_kv_caches({"model.layers.0.self_attn.attn": torch.zeros(4, 2, 16,
                                                                                  16)})
        assert connector._layers == [] and connector._worker_mover() is None  # never writes
        connector.shutdown()
    assert client.salts == []  # raykv was never asked


def test_a_worker_that_turns_itself_off_tells_the_scheduler_side_which_stops_asking(
        client, monkeypatch):
    """A worker whose caches raykv's pages do not fit (a drafter's extra layers, kernel
    blocks smaller than vLLM's) turns itself off; its scheduler side went on looking every
    request up, delaying each for hits no worker could load. Now it hears of it, once, on
    vLLM's worker-to-scheduler path, and stops."""
    import vllm.distributed.kv_transfer.kv_connector.utils as connector_utils
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    monkeypatch.setattr(connector_utils, "get_current_attn_backends",
                        lambda config, names=None: [CPUAttentionBackend])
    worker = RaykvConnector(vllm_config(), KVConnectorRole.WORKER, groups(FullAttentionSpec))
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, 4, 2, BLOCK, 8)
              for i in range(3)}  # three layers: the model has two
    worker.register_kv_caches(caches)
    assert worker._layers == []
    note = worker.build_connector_worker_meta()
    assert note is not None and worker.build_connector_worker_meta() is None  # told once
    connector = scheduler()
    assert connector.why_off is None
    connector.update_connector_output(SimpleNamespace(
        finished_recving=None, invalid_block_ids=set(), kv_connector_stats=None,
        kv_connector_worker_meta=note))
    assert "a worker turned it off" in connector.why_off
    assert connector.get_num_new_matched_tokens(request(), 0) == (0, False)
    assert client.salts == []  # raykv was never asked
    connector.shutdown()
    worker.shutdown()


def test_pages_that_are_not_whole_blocks_turn_it_off(client):
    client.page_tokens = 24  # vLLM's blocks are 16 tokens
    connector = scheduler()
    assert "not a multiple" in connector.why_off
    assert connector.get_num_new_matched_tokens(request(), 0) == (0, False)
    connector.shutdown()


def step_output(num_tokens_by_request: dict[str, int], new: bool):
    """A SchedulerOutput's fields the connector reads: `new` requests prefill from token 0."""
    new_reqs = [SimpleNamespace(req_id=r, prompt_token_ids=list(range(n)),
                                block_ids=([0],), num_computed_tokens=0)
                for r, n in num_tokens_by_request.items()] if new else []
    return SimpleNamespace(scheduled_new_reqs=new_reqs,
                           num_scheduled_tokens=dict(num_tokens_by_request),
                           total_num_scheduled_tokens=sum(num_tokens_by_request.values()),
                           scheduled_cached_reqs=SimpleNamespace(
                               req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                               num_computed_tokens=[]))


def test_the_scheduler_side_times_steps_takes_the_workers_loads_and_writes_its_rates(
        client, tmp_path, monkeypatch):
    """As vLLM drives it: build_connector_meta (the step handed out), the step's output with
    the worker's RaykvLoadStats (update_connector_output), get_kv_connector_stats (the step
    done); the rates file then holds the measured prefill rate and load path."""
    from cluster.serving import vllm_connector
    from cluster.serving.engine_rates import read_published
    from cluster.serving.vllm_stats import RaykvLoadStats

    path = str(tmp_path / "rates.json")
    config = vllm_config()
    config.kv_transfer_config.kv_connector_extra_config["raykv.rates_file"] = path
    now = [0.0]
    monkeypatch.setattr(vllm_connector, "_now_s", lambda: now[0])
    connector = scheduler(config)
    loads = RaykvLoadStats({"loads": [["disk", 4 << 20, 0.2]]})
    steps = [({"a": 100}, True, 0.015), ({"a": 1, "b": 1}, False, 0.0105),
             ({"c": 200}, True, 0.025), ({"a": 1, "b": 1}, False, 0.0105)]
    for index, (tokens, new, took_s) in enumerate(steps):
        now[0] = float(index)
        connector.build_connector_meta(step_output(tokens, new))
        now[0] += took_s
        connector.update_connector_output(SimpleNamespace(
            finished_recving=None, invalid_block_ids=None,
            kv_connector_stats=loads if index == 0 else None))
        assert connector.get_kv_connector_stats() is None  # the scheduler side sends none
        connector.request_finished(request(f"r{index}"), [])
    # Steps of 100 and 200 prefill tokens took 15 and 25 ms: 5 ms + 0.1 ms a token; the
    # decode steps (one token per request) do not count toward the prefill rate. The last
    # change is written too (at once, or once a second has passed since the last write).
    rates = wait_until(lambda: (r := read_published(path)).get("prefill_samples") == 2 and r,
                       5.0, "the last steps' rates in the file")
    assert rates["prefill_tokens_per_s"] == pytest.approx(10_000, rel=1e-6)
    assert rates["step_overhead_s"] == pytest.approx(0.005, rel=1e-6)
    assert rates["paths"]["disk"] == [pytest.approx((4 << 20) / 0.2), 0.0, 1]
    assert rates["page_tokens"] == PAGE and rates["busy_s_per_request"] > 0
    connector.shutdown()


def timed_scheduler(client, monkeypatch, step_s, mode="auto"):
    """A scheduler side that answered one lookup (timed), measured one load of 3 pages made
    in the step at 1 ms, and timed one step of `step_s`; its next schedule's budget is one
    request's."""
    from cluster.serving import vllm_connector
    from cluster.serving.vllm_stats import RaykvLoadStats

    now = [0.0]
    monkeypatch.setattr(vllm_connector, "_now_s", lambda: now[0])
    config = vllm_config()
    config.kv_transfer_config.kv_connector_extra_config["raykv.load_mode"] = mode
    connector = scheduler(config)
    client.gate.set()
    ask_until_answered(connector, request("first"))
    connector.build_connector_meta(step_output({"first": 4}, True))
    now[0] = step_s
    connector.update_connector_output(SimpleNamespace(
        finished_recving=None, invalid_block_ids=None,
        kv_connector_stats=RaykvLoadStats({"in_step": [
            [3 * connector._link.spec.page_bytes(PAGE), 0.001, 0]]})))
    connector.get_kv_connector_stats()  # the step is done: timed
    connector.build_connector_meta(step_output({"first": 1}, False))  # the next one, 1 request
    return connector


def test_a_timed_step_waits_for_a_fast_lookup_and_has_the_hit_loaded_in_the_step(
        client, monkeypatch):
    connector = timed_scheduler(client, monkeypatch, step_s=0.5)
    req = request("b")
    assert connector.get_num_new_matched_tokens(req, 0) == (96, False)  # no "ask again"
    assert connector._lookups.num_waited_answers == 1 and connector.num_sync_loads == 1
    connector.update_state_after_alloc(req, SimpleNamespace(
        get_block_ids=lambda: (list(range(10, 17)),)), 96)
    (load,) = connector.build_connector_meta(step_output({"b": 4}, True)).loads
    # Bounded by recomputing its 96 tokens at the timed prefill rate (4 tokens in 0.5 s).
    assert load.request_id == "b" and load.sync_timeout_s == pytest.approx(96 * 0.5 / 4)
    connector.shutdown()


def test_a_lookup_that_overruns_the_budget_answers_none_within_it(client, monkeypatch):
    connector = timed_scheduler(client, monkeypatch, step_s=0.05)
    client.gate.clear()  # raykv is slow now
    start_s = time.monotonic()
    assert connector.get_num_new_matched_tokens(request("slow"), 0) == (None, False)
    assert 0.03 < time.monotonic() - start_s < 0.5  # waited the budget, not the lookup
    # The budget is spent: the next request's lookup is not waited for in this step.
    start_s = time.monotonic()
    assert connector.get_num_new_matched_tokens(request("next"), 0) == (None, False)
    assert time.monotonic() - start_s < 0.02
    client.gate.set()
    connector.shutdown()


def test_a_load_estimated_past_the_budget_runs_in_the_background(client, monkeypatch):
    connector = timed_scheduler(client, monkeypatch, step_s=0.5)
    connector._budget.remaining_s = 0.0005  # less than the 1 ms the last such load took
    connector._lookups.lookup_s = 0.0
    req = request("b")
    matched = connector.get_num_new_matched_tokens(req, 0)
    if matched == (None, False):  # the lookup outran the 0.5 ms wait (a busy machine): vLLM
        connector._lookups._pending["b"][0].result(timeout=5)  # asks again in this step
        matched = connector.get_num_new_matched_tokens(req, 0)
    assert matched == (96, True)
    assert connector.num_sync_loads == 0
    connector.shutdown()


def test_a_load_cut_at_its_deadline_sends_the_next_of_its_size_to_the_background(
        client, monkeypatch):
    """A load of 3 pages cut at 13 s (its deadline: 96 tokens' recompute at 4 tokens a 0.5 s
    step is 12 s) would be cut again: the next one, though the long step's budget affords
    it, runs in the background."""
    from cluster.serving.vllm_stats import RaykvLoadStats

    connector = timed_scheduler(client, monkeypatch, step_s=0.5)
    connector._budget.remaining_s = 100.0  # the budget alone would wait for anything
    connector._lookups.lookup_s = 0.0
    connector.update_connector_output(SimpleNamespace(
        finished_recving=None, invalid_block_ids=None,
        kv_connector_stats=RaykvLoadStats({"in_step": [
            [3 * connector._link.spec.page_bytes(PAGE), 13.0, 1]]})))
    req = request("b")
    matched = connector.get_num_new_matched_tokens(req, 0)
    if matched == (None, False):  # the lookup outran its wait (a busy machine): vLLM asks
        connector._lookups._pending["b"][0].result(timeout=5)  # again in this step
        matched = connector.get_num_new_matched_tokens(req, 0)
    assert matched == (96, True)
    assert connector.num_sync_loads == 0
    connector.shutdown()


@pytest.mark.parametrize("mode, answer", [("async", (None, False)), ("sync", (96, False))])
def test_the_load_mode_setting_overrides_the_budget(client, monkeypatch, mode, answer):
    connector = timed_scheduler(client, monkeypatch, step_s=0.5, mode=mode)
    client.gate.clear()
    if mode == "sync":
        threading.Timer(0.1, client.gate.set).start()  # sync waits past any budget
    assert connector.get_num_new_matched_tokens(request("b"), 0) == answer
    client.gate.set()
    connector.shutdown()


def test_an_unknown_load_mode_is_refused(client):
    config = vllm_config()
    config.kv_transfer_config.kv_connector_extra_config["raykv.load_mode"] = "eager"
    with pytest.raises(ValueError, match="load_mode"):
        scheduler(config)
