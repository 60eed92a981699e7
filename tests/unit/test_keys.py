"""Page keys: stable across processes, separated by namespace/model/page size, chained, and
strict about what a token is."""

import os
import subprocess
import sys

import blake3
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.core.keys import (
    KEY_BYTES,
    MAX_TOKEN_ID,
    canonical_tokens,
    chain_keys,
    namespace_key,
    page_hash,
    page_keys,
    shard_of,
)
from cluster.core.spec import ModelSpec

SPEC = ModelSpec("tiny", 2, 2, 16, "float32")
PAGE_TOKENS = 4
TOKENS = list(range(100, 118))  # 4 full pages of 4 tokens, plus 2 trailing tokens

SCRIPT = """
from cluster.core.keys import page_keys
from cluster.core.spec import ModelSpec
keys = page_keys(ModelSpec("tiny", 2, 2, 16, "float32"), "tenant-a", 4, list(range(100, 118)))
print(",".join(k.hex() for k in keys))
"""


def keys_of(tokens, spec=SPEC, namespace="default", page_tokens=PAGE_TOKENS):
    return page_keys(spec, namespace, page_tokens, tokens)


def keys_in_subprocess(hash_seed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, check=True, timeout=60)
    return done.stdout.strip()


def test_keys_identical_across_processes_with_different_hash_seeds():
    first, second = keys_in_subprocess("1"), keys_in_subprocess("4242")
    expected = ",".join(k.hex() for k in keys_of(TOKENS, namespace="tenant-a"))
    assert first == second == expected
    assert len(first.split(",")) == 4


def test_key_matches_the_documented_formula():
    secret = bytes(range(32))
    root = blake3.blake3(b"raykv-ns-v2|\x20\x00" + secret +
                         b"tiny|2|2|16|float32|default|4").digest(KEY_BYTES)
    assert namespace_key(SPEC, "default", PAGE_TOKENS, secret) == root
    unkeyed = blake3.blake3(b"raykv-ns-v2|\x00\x00tiny|2|2|16|float32|default|4")
    assert namespace_key(SPEC, "default", PAGE_TOKENS) == unkeyed.digest(KEY_BYTES)
    page0 = np.arange(100, 104, dtype="<u4").tobytes()
    page1 = np.arange(104, 108, dtype="<u4").tobytes()
    key0 = blake3.blake3(root + page0).digest(KEY_BYTES)
    key1 = blake3.blake3(key0 + page1).digest(KEY_BYTES)
    keys = page_keys(SPEC, "default", PAGE_TOKENS, TOKENS, secret)
    assert keys[:2] == [key0, key1]
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    assert page_hash(b"a", b"bc") == page_hash(b"abc")


def test_only_full_pages_are_keyed():
    assert len(keys_of(TOKENS)) == 4
    assert keys_of(TOKENS[:16]) == keys_of(TOKENS)
    assert keys_of(TOKENS[:15]) == keys_of(TOKENS)[:3]
    assert keys_of(TOKENS[:3]) == []
    assert keys_of([]) == []


def test_keys_differ_across_namespaces():
    a, b = keys_of(TOKENS, namespace="a"), keys_of(TOKENS, namespace="b")
    assert len(a) == len(b) == 4
    assert not set(a) & set(b)


@pytest.mark.parametrize("other", [
    ModelSpec("other", 2, 2, 16, "float32"),
    ModelSpec("tiny", 3, 2, 16, "float32"),
    ModelSpec("tiny", 2, 4, 16, "float32"),
    ModelSpec("tiny", 2, 2, 32, "float32"),
    ModelSpec("tiny", 2, 2, 16, "bfloat16"),
])
def test_keys_differ_across_models(other):
    assert not set(keys_of(TOKENS)) & set(keys_of(TOKENS, spec=other))


def test_keys_differ_across_page_tokens():
    tokens = list(range(64))
    by_size = {size: keys_of(tokens, page_tokens=size) for size in (4, 8, 16)}
    assert [len(keys) for keys in by_size.values()] == [16, 8, 4]
    assert not set(by_size[4]) & set(by_size[8])
    assert not set(by_size[8]) & set(by_size[16])


def test_chaining_changes_every_later_key():
    base = keys_of(TOKENS)
    changed_first = list(TOKENS)
    changed_first[1] += 1
    first = keys_of(changed_first)
    assert all(a != b for a, b in zip(base, first, strict=True))
    changed_third = list(TOKENS)
    changed_third[2 * PAGE_TOKENS] += 1
    third = keys_of(changed_third)
    assert third[:2] == base[:2]
    assert third[2] != base[2] and third[3] != base[3]


def test_trailing_tokens_do_not_change_keys():
    assert keys_of(TOKENS[:16] + [7, 8]) == keys_of(TOKENS[:16] + [9])


def test_same_page_content_at_different_positions_gets_different_keys():
    keys = keys_of([5, 5, 5, 5] * 3)
    assert len(set(keys)) == 3


@pytest.mark.parametrize("tokens", [
    [1, 2, 3.0, 4],
    [1, True, 3, 4],
    ["1", "2", "3", "4"],
    "1234",
    b"\x01\x02\x03\x04",
    np.array([1.0, 2.0, 3.0, 4.0]),
    np.array([True, False, True, False]),
    torch.tensor([1.0, 2.0, 3.0, 4.0]),
    torch.tensor([True, False, True, False]),
    {1, 2, 3, 4},
    None,
    np.int64(3),
    torch.tensor([1, 2, 3, 4], device="meta"),  # no values: torch raised NotImplementedError
])
def test_non_integer_tokens_raise_type_error(tokens):
    with pytest.raises(TypeError, match="tokens"):
        keys_of(tokens)


@pytest.mark.parametrize("tokens", [
    [1, 2, -1, 4],
    [1, 2, MAX_TOKEN_ID + 1, 4],
    [1, 2, 2**70, 4],
    np.array([1, -2, 3, 4], dtype=np.int8),
    np.array([1, 2, 3, 2**40], dtype=np.int64),
    np.array([1, 2, 3, 2**63], dtype=np.uint64),
    torch.tensor([1, 2, -3, 4]),
])
def test_out_of_range_tokens_raise_value_error(tokens):
    with pytest.raises(ValueError, match="token ids"):
        keys_of(tokens)


@pytest.mark.parametrize("tokens", [
    np.arange(8).reshape(2, 4),
    torch.arange(8).reshape(2, 4),
    [[1, 2, 3, 4], [5, 6, 7, 8]],
    [1, 2, [3], 4],
])
def test_tokens_not_1d_raise_value_error(tokens):
    with pytest.raises(ValueError, match="1-D"):
        keys_of(tokens)


def test_max_token_id_is_accepted():
    assert len(keys_of([0, MAX_TOKEN_ID, 1, 2])) == 1


@pytest.mark.parametrize("page_tokens", [0, -4])
def test_non_positive_page_tokens_raise_value_error(page_tokens):
    with pytest.raises(ValueError, match="page_tokens"):
        keys_of(TOKENS, page_tokens=page_tokens)


@pytest.mark.parametrize("convert", [
    tuple,
    lambda t: range(t[0], t[-1] + 1),
    lambda t: np.array(t, dtype=np.int64),
    lambda t: np.array(t, dtype=np.int32),
    lambda t: np.array(t, dtype=np.uint32),
    lambda t: np.array(t, dtype=">i8"),  # big-endian input, canonicalized
    lambda t: np.repeat(np.array(t, dtype=np.int64), 2)[::2],  # non-contiguous view
    lambda t: [np.int64(x) for x in t],
    lambda t: torch.tensor(t, dtype=torch.int64),
    lambda t: torch.tensor(t, dtype=torch.int32),
    lambda t: torch.tensor(t, dtype=torch.int64, requires_grad=False)[None, :][0],
])
def test_numpy_and_torch_inputs_give_the_same_keys_as_lists(convert):
    assert keys_of(convert(TOKENS)) == keys_of(TOKENS)


def test_canonical_tokens_is_little_endian_uint32():
    array = canonical_tokens(np.array([1, 258], dtype=">i8"))
    assert array.dtype == np.dtype("<u4")
    assert array.flags.c_contiguous
    assert array.tobytes() == b"\x01\x00\x00\x00\x02\x01\x00\x00"


def test_shard_of_is_stable_and_in_range():
    keys = keys_of(list(range(4 * 64)))
    for num_shards in (1, 3, 8):
        shards = [shard_of(k, num_shards) for k in keys]
        assert all(0 <= s < num_shards for s in shards)
        assert shards == [int.from_bytes(k[:8], "little") % num_shards for k in keys]
    assert len({shard_of(k, 8) for k in keys}) == 8


def test_a_list_of_tokens_converts_fast_but_still_refuses_what_is_not_a_token_id():
    mixed = [5, np.int64(7), 1, 0]
    assert canonical_tokens(mixed).tolist() == [5, 7, 1, 0]
    assert canonical_tokens(range(3)).tolist() == [0, 1, 2]
    with pytest.raises(TypeError, match="bool"):
        canonical_tokens([5, 9, True])  # a bool is an int to array.array: refused all the same
    with pytest.raises(TypeError, match="float"):
        canonical_tokens([5, 1.0])
    with pytest.raises(ValueError, match="1-D"):
        canonical_tokens([5, [1]])
    with pytest.raises(ValueError, match="lie in"):
        canonical_tokens([5, 2**70])
    with pytest.raises(ValueError, match="lie in"):
        canonical_tokens([5, -1])


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), max_size=200),
       page_tokens=st.sampled_from([1, 3, 4, 16]))
def test_the_chain_is_page_hash_of_the_key_before_and_the_page(tokens, page_tokens):
    """chain_keys reuses one hasher across pages; each key must stay page_hash(previous key,
    the page's canonical bytes), the formula every node, client and disk header relies on."""
    root = namespace_key(SPEC, "default", page_tokens)
    canonical = np.asarray(tokens, dtype="<u4")
    expected, previous = [], root
    for start in range(0, len(tokens) // page_tokens * page_tokens, page_tokens):
        previous = page_hash(previous, canonical[start : start + page_tokens].tobytes())
        expected.append(previous)
    assert chain_keys(canonical, root, page_tokens) == expected
    assert page_keys(SPEC, "default", page_tokens, tokens) == expected
