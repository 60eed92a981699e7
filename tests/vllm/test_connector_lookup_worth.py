"""RaykvConnector's scheduler side, with vLLM's classes, learning whether lookups are worth
their wait (cluster/serving/lookup_worth.py): once lookups of follow-up turns found nothing
past vLLM's own cache, the next follow-up is not looked up, loads nothing and is saved under
its salt; a new prompt still is, so is one where raykv held more, and the figures are in the
engine's published rates."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this "
                                   "tier in .venv-vllm")

from cluster.serving import vllm_connector  # noqa: E402
from cluster.serving.lookup_worth import EXPLORE_EVERY, MIN_OUTCOMES  # noqa: E402
from cluster.serving.vllm_keys import request_salt  # noqa: E402
from cluster.serving.vllm_plan import FORCE_KEY  # noqa: E402
from tests.vllm import test_connector_scheduler as scheduler_tests  # noqa: E402
from tests.vllm.test_connector_scheduler import request, timed_scheduler  # noqa: E402

PROMPT_TOKENS, HELD_TOKENS = 100, 64  # a follow-up turn: vLLM's own cache holds 64
LOOKUP_S = 0.005
client = scheduler_tests.client  # the fixture: a connected raykv client, its lookups faked


def learning(client, monkeypatch, raykv_tokens: int, make_request=request):
    """A timed scheduler side (4 tokens prefilled in 50 ms) whose raykv answers
    `raykv_tokens` of any prompt in 5 ms, after MIN_OUTCOMES lookups of follow-up turns
    (`make_request(name, num_tokens)` each)."""
    connector = timed_scheduler(client, monkeypatch, step_s=0.05)

    def prefetch(tokens):
        time.sleep(LOOKUP_S)
        return min(raykv_tokens, len(tokens))

    client.prefetch = prefetch
    monkeypatch.setattr(vllm_connector, "_now_s", time.monotonic)  # the steps are timed
    for i in range(MIN_OUTCOMES):
        looked_up(connector, make_request(f"turn-{i}", PROMPT_TOKENS), HELD_TOKENS)
    return connector


def looked_up(connector, req, num_computed_tokens: int):
    """The connector's answer about `req` once it has one; then the request is done."""
    answer = scheduler_tests.ask_until_answered(connector, req,
                                                num_computed_tokens=num_computed_tokens)
    connector.request_finished(req, [])
    return answer


def prefill_of(req, num_computed_tokens: int, block_ids: list[int]):
    """A SchedulerOutput that schedules `req`'s prefill from `num_computed_tokens` to its end."""
    prompt = list(req.prompt_token_ids)
    num_scheduled = len(prompt) - num_computed_tokens
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, prompt_token_ids=prompt,
                                            block_ids=(block_ids,),
                                            num_computed_tokens=num_computed_tokens)],
        num_scheduled_tokens={req.request_id: num_scheduled},
        total_num_scheduled_tokens=num_scheduled,
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              resumed_req_ids=set(), num_computed_tokens=[]))


def test_a_follow_up_turn_is_not_looked_up_once_lookups_found_nothing_past_vllms_cache(
        client, monkeypatch):
    connector = learning(client, monkeypatch, raykv_tokens=HELD_TOKENS)
    num_lookups = len(client.salts)
    req = request("next-turn", PROMPT_TOKENS, cache_salt="tenant")
    assert connector.get_num_new_matched_tokens(req, HELD_TOKENS) == (0, False)
    assert len(client.salts) == num_lookups  # no lookup
    (save,) = connector.build_connector_meta(prefill_of(req, HELD_TOKENS, list(range(7)))).saves
    assert (save.start, len(save.token_ids), save.block_ids) == (64, 96, [4, 5])
    assert save.salt == request_salt(req) != b""
    # a new prompt is looked up all the same: only raykv can have it
    looked_up(connector, request("new-prompt", PROMPT_TOKENS), 0)
    assert len(client.salts) == num_lookups + 1
    published = connector._meter.published()
    assert published["lookups_skipped"] == 1 and published["lookups_beyond_vllm"] == 0.0
    # from the first ask: a lookup the step waited for counts its wait
    assert published["lookup_delay_ms"] >= LOOKUP_S * 1e3
    connector.shutdown()


def test_follow_up_turns_are_looked_up_where_raykv_held_more_and_one_skip_in_eight_anyway(
        client, monkeypatch):
    held_more = learning(client, monkeypatch, raykv_tokens=96)
    num_lookups = len(client.salts)
    assert looked_up(held_more, request("more", PROMPT_TOKENS), HELD_TOKENS)[0] == 32
    assert len(client.salts) == num_lookups + 1 and held_more._meter.lookups.num_skipped == 0
    held_more.shutdown()
    nothing_more = learning(client, monkeypatch, raykv_tokens=HELD_TOKENS)
    num_lookups = len(client.salts)
    for i in range(2 * EXPLORE_EVERY):
        looked_up(nothing_more, request(f"later-{i}", PROMPT_TOKENS), HELD_TOKENS)
    assert len(client.salts) == num_lookups + 2  # the explorations
    assert nothing_more._meter.lookups.num_skipped == 2 * EXPLORE_EVERY - 2
    nothing_more.shutdown()


def routed(name: str, num_tokens: int):
    """A request as Ray's KVAwareRouter sends it: its token ids in kv_transfer_params."""
    req = request(name, num_tokens)
    req.kv_transfer_params = {"prompt_token_ids": list(req.prompt_token_ids)}
    return req


def test_behind_rays_kv_aware_router_a_follow_up_is_decided_on_as_a_plain_one(
        client, monkeypatch):
    """Ray's KVAwareRouter puts the prompt's token ids in every request's kv_transfer_params
    (for its own scoring): such a request is timed and decided on as a plain one. It had
    been taken for one the connector must ask about, and a quick run behind that router
    timed 6 lookups in 9 engine-rounds."""
    connector = learning(client, monkeypatch, HELD_TOKENS, make_request=routed)
    assert connector._meter.lookups.num_outcomes == MIN_OUTCOMES  # timed, as plain ones
    num_lookups = len(client.salts)
    assert connector.get_num_new_matched_tokens(routed("next", PROMPT_TOKENS),
                                                HELD_TOKENS) == (0, False)
    assert len(client.salts) == num_lookups and connector._meter.lookups.num_skipped == 1
    # raykv's own keys still make a request the connector must ask about
    req = routed("forced", PROMPT_TOKENS)
    req.kv_transfer_params[FORCE_KEY] = 96
    looked_up(connector, req, HELD_TOKENS)
    assert len(client.salts) == num_lookups + 1
    connector.shutdown()
