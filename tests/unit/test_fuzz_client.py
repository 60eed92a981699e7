"""Hypothesis over the client API's inputs, on fakes of the actors (5,500 cases, bounded in
time): every bad token list, KV tensor or output buffer is refused with TypeError/ValueError
before any call goes out, and every good one goes through."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.client import KVClient
from cluster.core.config import CacheConfig
from cluster.core.spec import ModelSpec
from cluster.tools.fuzz import bad_token_lists
from tests.unit._fakes import FakeDirectory, FakeNode, drive

SPEC = ModelSpec("fuzz", 2, 2, 8, "float16")
PAGE_TOKENS = 4
FUZZ = settings(max_examples=2500, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.fixture(scope="module")
def client():
    node = FakeNode("local", is_local=False)
    config = CacheConfig(page_tokens=PAGE_TOKENS, disk_dir="/tmp")
    return KVClient(SPEC, "default", config, FakeDirectory(), node), node


def tokens_strategy():
    good = st.lists(st.integers(0, 2**32 - 1), max_size=40)
    bad = bad_token_lists()
    arrays = st.one_of(
        st.lists(st.integers(0, 1000), max_size=20).map(np.array),
        st.sampled_from([np.zeros((2, 2), np.int64), np.array([1.5, 2.5]),
                         np.array([True, False]), np.array(["a"]), np.zeros(3, np.uint8)]),
        st.lists(st.integers(0, 1000), max_size=20).map(torch.tensor))
    others = st.sampled_from(["text", 42, None, {1: 2}, b"bytes", 3.5])
    return st.one_of(good, bad, arrays, others)


def kv_strategy():
    dtypes = st.sampled_from([torch.float16, torch.float32, torch.bfloat16, torch.int8,
                              torch.float64])
    shapes = st.lists(st.integers(0, 9), min_size=0, max_size=6)
    return st.one_of(st.tuples(shapes, dtypes).map(lambda sd: torch.zeros(sd[0], dtype=sd[1])),
                     st.sampled_from([None, [[0.0]], np.zeros((2, 2, 2, 4, 8)), "kv"]))


def _outcome(call):
    try:
        return "ok", call()
    except (TypeError, ValueError) as error:
        return "refused", error


@FUZZ
@given(tokens=tokens_strategy(), kv=kv_strategy())
def test_put_refuses_bad_input_before_any_call(client, tokens, kv):
    kv_client, node = client
    node.calls.clear()
    kind, result = _outcome(lambda: drive(kv_client._put(tokens, kv)))
    if kind == "refused":
        assert node.calls == [], f"{result} came after a call"
    else:
        assert isinstance(result, int) and result % PAGE_TOKENS == 0 and result >= 0


@FUZZ
@given(tokens=tokens_strategy(), out=st.one_of(st.none(), kv_strategy()))
def test_get_and_lookup_refuse_bad_input_and_never_raise_otherwise(client, tokens, out):
    kv_client, node = client
    node.calls.clear()
    kind, result = _outcome(lambda: drive(kv_client._get(tokens, out)))
    if kind == "refused":
        assert node.calls == []
    else:
        assert result == (0, None)  # nothing cached on the fakes: a miss, not an error
    kind, result = _outcome(lambda: drive(kv_client._lookup(tokens)))
    assert kind == "refused" or result == 0


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=PAGE_TOKENS, max_size=32))
def test_a_good_put_is_a_valid_kv(tokens):
    kv = torch.zeros(2, 2, 2, len(tokens), 8, dtype=torch.float16)
    node = FakeNode("local", is_local=False)
    kv_client = KVClient(SPEC, "default", CacheConfig(page_tokens=PAGE_TOKENS, disk_dir="/tmp"),
                         FakeDirectory(), node)
    assert drive(kv_client._put(tokens, kv)) == len(tokens) // PAGE_TOKENS * PAGE_TOKENS
    assert node.calls == ["put_pages"]
