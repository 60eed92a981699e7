"""Prefill/decode disaggregation over raykv, without vLLM or Ray: the handoff a prefill
returns, the decode's bounded wait for its pages, a prefill's whole prompt saved (and never
dropped), and Ray Serve LLM's request shaping for RaykvConnector."""

import threading
import time

import pytest
import torch
from pydantic import BaseModel

from cluster.serving.vllm_io import MAX_PENDING_SAVES, KVMover
from cluster.serving.vllm_pd import RaykvPDBackend
from cluster.serving.vllm_plan import (
    FETCH_LIMIT_KEY,
    Handoff,
    HandoffWaits,
    NewRequest,
    SaveSpec,
    StepPlanner,
    decode_params,
    handoff_mismatch,
    handoff_of,
    handoff_params,
    is_producer,
    tokens_wanted,
)
from cluster.serving.vllm_service import Answer, Lookups, RaykvSettings
from tests.unit.test_vllm_keys import FakeLink, poll_until_answered
from tests.unit.test_vllm_plan import LAYOUT, SPEC, GatedPuts, filled_caches

PRODUCER = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None}


def test_a_handoff_goes_through_kv_transfer_params_and_odd_ones_are_ignored():
    handoff = Handoff(896, "small-llama", "default")
    params = handoff_params(handoff)
    assert params == {"raykv_pd": {"tokens": 896, "model": "small-llama",
                                   "namespace": "default"}}
    assert handoff_of(params) == handoff
    assert handoff_of({**params, FETCH_LIMIT_KEY: 128}) == handoff  # with the router's cut
    for odd in (None, [], {}, {"raykv_pd": 3}, {"raykv_pd": {"tokens": -1, "model": "m",
                                                             "namespace": "n"}},
                {"raykv_pd": {"tokens": True, "model": "m", "namespace": "n"}},
                {"raykv_pd": {"tokens": 8, "model": None, "namespace": "n"}}):
        assert handoff_of(odd) is None, odd


def test_only_ray_s_producer_params_make_a_prefill_for_a_remote_decode():
    assert is_producer(PRODUCER)
    assert not is_producer({**PRODUCER, "do_remote_decode": False})
    assert not is_producer({"do_remote_decode": "yes"}) and not is_producer(None)
    assert not is_producer(handoff_params(Handoff(8, "m", "n")))  # a decode's params


def test_a_decode_keyed_otherwise_never_waits_for_the_prefill_s_pages():
    handoff = Handoff(896, "small-llama", "default")
    assert handoff_mismatch(handoff, "small-llama", "default") is None
    assert "raykv.model_name" in handoff_mismatch(handoff, "small-llama|tp0of2", "default")
    assert "'tenant-b'" in handoff_mismatch(handoff, "small-llama", "tenant-b")


def test_the_decode_request_carries_the_handoff_and_the_router_s_cut():
    handoff = handoff_params(Handoff(896, "m", "n"))
    assert decode_params(handoff, None) == handoff
    assert decode_params(handoff, {FETCH_LIMIT_KEY: 256}) == {**handoff, FETCH_LIMIT_KEY: 256}
    assert decode_params(None, {FETCH_LIMIT_KEY: 0}) == {FETCH_LIMIT_KEY: 0}
    assert decode_params(None, {"other": 1}) is None  # a prefill without raykv: plain decode


def test_a_decode_wants_the_prefill_s_tokens_within_what_it_may_load():
    handoff = Handoff(896, "m", "n")
    assert tokens_wanted(handoff, num_asked=896, limit=None) == 896
    assert tokens_wanted(handoff, num_asked=768, limit=None) == 768
    assert tokens_wanted(handoff, num_asked=896, limit=256) == 256


def test_a_decode_waits_for_the_pages_at_most_wait_s_after_its_first_short_answer():
    waits = HandoffWaits(wait_s=2.0)
    assert waits.should_wait("r", num_held=0, num_wanted=896, now_s=10.0)
    assert waits.should_wait("r", num_held=512, num_wanted=896, now_s=11.9)
    assert not waits.should_wait("r", num_held=896, num_wanted=896, now_s=11.95)  # all there
    assert waits.since_s == {}
    assert waits.should_wait("s", 0, 896, now_s=20.0)
    assert not waits.should_wait("s", 128, 896, now_s=22.0)  # a lost save: take what is there
    assert waits.since_s == {}
    assert not waits.should_wait("t", 0, 0, now_s=30.0)  # nothing handed: no wait
    waits.should_wait("u", 0, 8, now_s=40.0)
    waits.forget("u")
    assert waits.since_s == {}
    assert not HandoffWaits(wait_s=0.0).should_wait("v", 0, 8, now_s=0.0)


def test_pd_wait_s_is_a_setting_and_must_not_be_negative():
    assert RaykvSettings.from_extra({}).pd_wait_s == 2.0
    assert RaykvSettings.from_extra({"raykv.pd_wait_s": "0.5"}).pd_wait_s == 0.5
    with pytest.raises(ValueError, match="pd_wait_s"):
        RaykvSettings.from_extra({"raykv.pd_wait_s": -1})


class CountingClient:
    page_tokens, timeout_s = 16, 5.0

    def __init__(self):
        self.held, self.num_lookups = 0, 0

    def salted(self, extra):
        return self

    def prefetch(self, tokens):
        self.num_lookups += 1
        return self.held


def test_a_retried_lookup_is_issued_afresh_after_its_delay():
    client = CountingClient()
    lookups = Lookups(FakeLink(client))
    assert poll_until_answered(lookups, "r", list(range(40))) == Answer(b"", 0, 16)
    client.held = 32  # the prefill's pages reach the directory
    lookups.retry("r", after_s=0.2)
    start_s = time.monotonic()
    assert lookups.poll("r", list(range(40)), lambda: b"") is None  # not due yet
    assert poll_until_answered(lookups, "r", list(range(40))) == Answer(b"", 32, 16)
    assert time.monotonic() - start_s >= 0.2 and client.num_lookups == 2
    lookups.retry("s", after_s=60)
    lookups.forget("s")  # the request is gone: nothing is due
    assert poll_until_answered(lookups, "s", list(range(40))) == Answer(b"", 32, 16)
    lookups.close()


def test_a_prefill_saves_the_whole_prompt_even_what_vllm_s_cache_held():
    plan = StepPlanner(block_size=4, page_tokens=8)
    prompt = list(range(21))
    plan.keyed("p", b"")
    plan.producers.add("p")
    # vLLM's own cache held 16 tokens (no lookup needed for itself); raykv held none
    assert plan.matched("p", num_local_tokens=16, num_cached_tokens=0, prompt_len=21) == 0
    _, saves = plan.step([NewRequest("p", prompt, [1, 2, 3, 4, 5, 6], 16, 5)], [])
    assert saves == [SaveSpec("p", prompt[:16], [1, 2, 3, 4], 0, b"", keep=True)]
    assert plan.saved_tokens("p") == 16
    plan.finished("p")
    assert plan.saved_tokens("p") == 0 and plan.producers == set()
    # Not a producer: the same prompt's save may be dropped when the saver is busy.
    plan.keyed("q", b"")
    plan.matched("q", 0, 0, 21)
    _, saves = plan.step([NewRequest("q", prompt, [1, 2, 3, 4, 5, 6], 0, 21)], [])
    assert [save.keep for save in saves] == [False]


def test_a_prefill_s_saves_are_never_dropped_when_the_saver_is_busy():
    gate = threading.Event()
    client = GatedPuts(gate)
    mover = KVMover(client, filled_caches(40), LAYOUT, SPEC)
    for index in range(MAX_PENDING_SAVES + 2):
        tokens = [index] * 8
        mover.save(SaveSpec(f"r{index}", tokens, [2 * index, 2 * index + 1]))
    assert mover.stats.dropped_saves == 2
    mover.save(SaveSpec("p", list(range(100, 108)), [38, 39], keep=True))
    assert mover.stats.dropped_saves == 2  # kept, though MAX_PENDING_SAVES are queued
    gate.set()
    mover.close()
    out = torch.zeros(SPEC.page_shape(8))
    assert client.get(list(range(100, 108)), out=out)[0] == 8


class Request(BaseModel):
    """The fields of Ray Serve LLM's Completion/ChatCompletionRequest that P/D shapes."""

    prompt: str
    max_tokens: int | None = 16
    stream: bool = True
    stream_options: dict | None = {"include_usage": True}
    kv_transfer_params: dict | None = None


class PrefillResponse(BaseModel):
    kv_transfer_params: dict | None = None


def test_ray_s_pd_shaping_for_raykv_keeps_the_router_s_cut_for_the_decode():
    backend = RaykvPDBackend(llm_config=None)
    assert not backend.requires_peer_binding and not backend.concurrent_handoff
    request = Request(prompt="hello", kv_transfer_params={FETCH_LIMIT_KEY: 256})
    prefill = backend.prepare_prefill_request(request=request, peer=None)
    # Ray's own shaping would assert here: the router's cut is in kv_transfer_params.
    assert prefill.kv_transfer_params == PRODUCER
    assert (prefill.max_tokens, prefill.stream, prefill.stream_options) == (1, False, None)
    handoff = handoff_params(Handoff(896, "m", "n"))
    decode = backend.prepare_decode_request(
        request=request, peer=None, prefill_response=PrefillResponse(kv_transfer_params=handoff))
    assert decode.kv_transfer_params == {**handoff, FETCH_LIMIT_KEY: 256}
    assert (decode.max_tokens, decode.stream) == (16, True)
    assert request.kv_transfer_params == {FETCH_LIMIT_KEY: 256}  # the client's, untouched
    plain = backend.prepare_decode_request(request=Request(prompt="x"), peer=None,
                                           prefill_response=PrefillResponse())
    assert plain.kv_transfer_params is None  # a prefill without raykv: a plain decode
