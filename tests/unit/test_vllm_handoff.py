"""The P/D decode gate of RaykvConnector (cluster/serving/vllm_handoff.py): a decode asks
raykv again while its prefill's pages are not all there, for at most the wait, and never
for a handoff keyed under another model or namespace."""

from __future__ import annotations

import logging

from cluster.serving.vllm_handoff import DecodeGate
from cluster.serving.vllm_plan import Handoff, handoff_params
from cluster.serving.vllm_service import Answer

PAGE_TOKENS = 16


def params(num_tokens: int, model: str = "m", namespace: str = "ns") -> dict:
    return handoff_params(Handoff(num_tokens, model, namespace))


def held(num_tokens: int) -> Answer:
    return Answer(b"", num_tokens, PAGE_TOKENS)


def test_a_decode_waits_until_its_prefills_pages_are_held_then_not():
    gate = DecodeGate(wait_s=1.0, model="m", namespace="ns")
    assert gate.waits("r", held(32), params(64), num_asked=64, now_s=0.0)
    assert gate.waits("r", held(48), params(64), num_asked=64, now_s=0.5)
    assert not gate.waits("r", held(64), params(64), num_asked=64, now_s=0.6)
    # the prompt's whole blocks bound what it waits for
    assert not gate.waits("s", held(48), params(64), num_asked=48, now_s=0.0)


def test_a_decode_stops_waiting_after_the_wait_and_says_so(caplog):
    gate = DecodeGate(wait_s=1.0, model="m", namespace="ns")
    assert gate.waits("r", held(0), params(64), num_asked=64, now_s=10.0)
    with caplog.at_level(logging.WARNING, logger="cluster.serving.vllm_handoff"):
        assert not gate.waits("r", held(16), params(64), num_asked=64, now_s=11.0)
    assert "found 16 of the prefill's 64 tokens" in caplog.text
    # its clock starts afresh once it stopped: a later short answer waits again
    assert gate.waits("r", held(16), params(64), num_asked=64, now_s=12.0)
    gate.forget("r")
    assert gate.handoffs.since_s == {}


def test_no_handoff_or_an_unkeyed_answer_never_waits():
    gate = DecodeGate(wait_s=1.0, model="m", namespace="ns")
    assert not gate.waits("r", held(0), None, num_asked=64, now_s=0.0)
    assert not gate.waits("r", held(0), {"raykv_pd": {"tokens": "x"}}, num_asked=64, now_s=0.0)
    assert not gate.waits("r", Answer(None, 0, PAGE_TOKENS), params(64), 64, now_s=0.0)
    assert not gate.waits("r", Answer(b"", 0, None), params(64), 64, now_s=0.0)


def test_a_handoff_keyed_elsewhere_never_waits_and_is_logged_once(caplog):
    gate = DecodeGate(wait_s=1.0, model="m", namespace="ns")
    with caplog.at_level(logging.ERROR, logger="cluster.serving.vllm_handoff"):
        assert not gate.waits("r", held(0), params(64, model="other"), 64, now_s=0.0)
        assert not gate.waits("s", held(0), params(64, namespace="other"), 64, now_s=0.0)
    assert caplog.text.count("decodes do not wait") == 1
