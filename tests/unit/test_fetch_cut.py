"""The router's fetch-or-recompute cut on its way to a vLLM engine: RaykvRouter puts it in
the request's kv_transfer_params (vLLM's own field, which reaches the scheduler's Request);
RaykvConnector loads no more than it (tests/vllm/test_connector_scheduler.py). No Ray."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.serving.router import _cut, _tell_hit
from cluster.serving.vllm_keys import is_plain
from cluster.serving.vllm_plan import (
    FETCH_LIMIT_KEY,
    HIT_KEY,
    fetch_limit,
    routed_hit,
    with_fetch_limit,
    with_routed_hit,
)


@given(limit=st.integers(0, 1 << 40) | st.none(),
       other=st.dictionaries(st.text(max_size=8).filter(lambda k: k != FETCH_LIMIT_KEY),
                             st.integers(), max_size=3))
def test_a_cut_round_trips_and_keeps_the_requests_other_params(limit, other):
    params = with_fetch_limit(other or None, limit)
    assert fetch_limit(params) == limit
    assert {k: v for k, v in (params or {}).items() if k != FETCH_LIMIT_KEY} == other


@pytest.mark.parametrize("params", [None, [], "x", {}, {FETCH_LIMIT_KEY: -1},
                                    {FETCH_LIMIT_KEY: True}, {FETCH_LIMIT_KEY: 1.5},
                                    {FETCH_LIMIT_KEY: "64"}])
def test_odd_params_from_a_client_are_no_cut(params):
    assert fetch_limit(params) is None


def pending(request):
    return SimpleNamespace(args=[request])


def test_the_router_cuts_a_vllm_request_through_kv_transfer_params():
    request = SimpleNamespace(kv_transfer_params={"do_remote_decode": False})
    _cut(pending(request), 256)
    assert request.kv_transfer_params == {"do_remote_decode": False, FETCH_LIMIT_KEY: 256}
    _cut(pending(request), None)  # routed again, no cut this time: the old one is gone
    assert request.kv_transfer_params == {"do_remote_decode": False}
    bare = SimpleNamespace(kv_transfer_params=None)
    _cut(pending(bare), None)
    assert bare.kv_transfer_params is None  # nothing to say: the request is left as it was


def test_raykvs_own_engine_gets_the_cut_as_max_fetch_tokens():
    request = SimpleNamespace(max_fetch_tokens=None, kv_transfer_params=None)
    _cut(pending(request), 128)
    assert request.max_fetch_tokens == 128 and request.kv_transfer_params is None
    _cut(None, 128)  # no request to cut: nothing happens


@given(hit=st.integers(0, 1 << 40) | st.none(),
       limit=st.integers(0, 1 << 40) | st.none())
def test_the_routers_hit_rides_beside_its_cut(hit, limit):
    params = with_routed_hit(with_fetch_limit({"other": 1}, limit), hit)
    assert routed_hit(params) == hit and fetch_limit(params) == limit
    assert params["other"] == 1


@pytest.mark.parametrize("params", [None, {}, {HIT_KEY: -1}, {HIT_KEY: True},
                                    {HIT_KEY: "64"}])
def test_odd_params_from_a_client_are_no_hit(params):
    assert routed_hit(params) is None


def test_the_router_tells_a_vllm_request_its_hit_and_leaves_raykvs_own_alone():
    vllm_request = SimpleNamespace(kv_transfer_params=None)
    _tell_hit(pending(vllm_request), 96)
    assert vllm_request.kv_transfer_params == {HIT_KEY: 96}
    own = SimpleNamespace(max_fetch_tokens=None, kv_transfer_params=None)
    _tell_hit(pending(own), 96)
    assert own.kv_transfer_params is None
    _tell_hit(None, 96)  # no request: nothing to tell


def test_only_a_request_nothing_sets_apart_is_plain():
    plain = dict(prompt_embeds=None, lora_request=None, cache_salt=None, mm_features=[])
    assert is_plain(SimpleNamespace(**plain))
    for field, value in (("prompt_embeds", object()), ("lora_request", object()),
                         ("cache_salt", "tenant"), ("mm_features", [object()])):
        assert not is_plain(SimpleNamespace(**{**plain, field: value}))
