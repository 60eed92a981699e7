"""Block traces (Mooncake's format): reading, how a block id becomes tokens and page keys, and
the unlimited-cache hit ratio of the conversation trace (37.4 % in its README). No Ray."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from cluster.core.keys import KeyChain
from cluster.core.spec import ModelSpec
from cluster.core.trace_format import (
    BLOCK_TOKENS,
    VOCAB,
    BlockKeys,
    BlockRequest,
    TraceError,
    block_tokens,
    hit_tokens,
    iter_trace,
    parse_request,
    read_trace,
    request_tokens,
    unlimited_hit_ratio,
)

REPO = Path(__file__).resolve().parents[2]
TRACE_CANDIDATES = [os.environ.get("RAYKV_MOONCAKE_TRACE", ""),
                    str(REPO.parent / "shared/traces/mooncake_conversation.jsonl"),
                    "/work/shared/traces/mooncake_conversation.jsonl"]
TRACE = next((p for p in TRACE_CANDIDATES if p and os.path.exists(p)), None)
CHAIN = KeyChain.of(ModelSpec.preset("tiny-llama"), "default", BLOCK_TOKENS)


def request(*ids: int, input_tokens: int | None = None) -> BlockRequest:
    return BlockRequest(0.0, input_tokens or BLOCK_TOKENS * len(ids), 1, ids)


def test_parse_ignores_other_fields_and_rejects_bad_rows():
    line = json.dumps({"timestamp": 27482, "input_length": 6955, "output_length": 52,
                       "hash_ids": [46, 47, 48], "session": "ignored"})
    assert parse_request(line) == BlockRequest(27482.0, 6955, 52, (46, 47, 48))
    lines = [line, "", json.dumps({"timestamp": 1, "input_length": 3, "hash_ids": [0]})]
    assert [r.output_tokens for r in iter_trace(lines)] == [52, 0]
    with pytest.raises(ValueError, match="not a block-trace request"):
        parse_request(json.dumps({"timestamp": 1, "hash_ids": [1]}))
    with pytest.raises(ValueError, match="negative"):
        parse_request(json.dumps({"timestamp": 1, "input_length": 5, "hash_ids": [-1]}))


def test_read_trace_names_the_file_and_line_of_a_bad_request(tmp_path):
    good = json.dumps({"timestamp": 0, "input_length": 5, "hash_ids": [1]})
    trace = tmp_path / "t.jsonl"
    for text, why in [(f"{good}\n\n{{oops\n", "line 3: not JSON"),
                      (f"{good}\n{json.dumps({'timestamp': 1, 'input_length': 2})}\n",
                       "line 2: not a block-trace request, no 'hash_ids'"),
                      ('{"timestamp": 0, "input_length": 5, "hash_ids": "ab"}\n',
                       "line 1: not a block-trace request"),
                      ("\n \n", "no requests"), (b"\xff\xfe".decode("latin-1"), "not UTF-8")]:
        trace.write_text(text, encoding="latin-1")
        with pytest.raises(TraceError, match=f"^{trace}.*{why}"):
            read_trace(str(trace))
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(str(tmp_path / "missing.jsonl"))
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(str(tmp_path))
    trace.write_text(f"{good}\n{good}\n")
    assert len(read_trace(str(trace), limit=1)) == 1
    with pytest.raises(ValueError, match="limit"):
        read_trace(str(trace), limit=0)


def test_a_block_id_becomes_512_tokens_from_blake3_of_the_id():
    tokens = block_tokens(7)
    assert tokens.shape == (BLOCK_TOKENS,) and tokens.dtype == np.dtype("<u4")
    assert int(tokens.max()) < VOCAB
    assert np.array_equal(tokens, block_tokens(7))  # deterministic
    assert not np.array_equal(tokens, block_tokens(8))
    import blake3  # the documented recipe, spelled out
    words = np.frombuffer(blake3.blake3(b"raykv-trace-block-v1|" + (7).to_bytes(8, "little"))
                          .digest(4 * BLOCK_TOKENS), "<u4")
    assert np.array_equal(tokens, words % VOCAB)


def test_block_keys_are_raykv_chained_keys_of_the_blocks_tokens():
    keys = BlockKeys(CHAIN)
    first, second = request(0, 1, 2, 3), request(0, 1, 9)
    assert keys.keys(first) == CHAIN.keys(request_tokens(first))
    # A request's blocks form a prefix chain: shared leading ids, shared leading keys only.
    a, b = keys.keys(first), keys.keys(second)
    assert a[:2] == b[:2] and a[2] != b[2]
    # The same id under another parent is another page (its key hashes the whole prefix).
    assert keys.keys(request(5, 1))[1] != a[1]
    assert len(keys) == 4 + 1 + 2


def test_block_keys_need_512_token_pages():
    with pytest.raises(ValueError, match="512"):
        BlockKeys(KeyChain.of(ModelSpec.preset("tiny-llama"), "default", 256))


def test_unlimited_hit_ratio_counts_whole_blocks_of_the_longest_seen_prefix():
    trace = [request(0, 1, 2, input_tokens=1200), request(0, 1, 3, input_tokens=1500),
             request(0, 1, 3, input_tokens=1500), request(4, 1, input_tokens=1024)]
    # hits: 0, 2 blocks, 3 blocks (its last block counts whole), 0 (id 1 under another root)
    expected = hit_tokens(2 + 3) / (1200 + 1500 + 1500 + 1024)
    assert unlimited_hit_ratio(trace) == pytest.approx(expected)
    assert unlimited_hit_ratio([]) == 0.0


@pytest.mark.skipif(TRACE is None, reason="the Mooncake trace is not on this machine")
def test_mooncake_conversation_trace_matches_its_readme():
    trace = read_trace(TRACE)
    assert len(trace) == 12031
    assert sum(r.input_tokens for r in trace) / len(trace) == pytest.approx(12035, abs=1)
    assert all(len(r.block_ids) == -(-r.input_tokens // BLOCK_TOKENS) for r in trace)
    assert round(100 * unlimited_hit_ratio(trace), 1) == 37.4
    assert len(read_trace(TRACE, limit=10)) == 10
