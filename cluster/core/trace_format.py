"""Block traces in Mooncake's format (FAST'25 release): reading them, and their blocks as tokens
and raykv page keys.

One JSON object per line (other fields are ignored, so Mooncake's conversation, tool-and-agent
and synthetic traces all read alike):

    {"timestamp": ms from the start, "input_length": tokens, "output_length": tokens,
     "hash_ids": [b0, b1, ...]}

`hash_ids` are the prompt's blocks of BLOCK_TOKENS (512) tokens, in order: equal ids are equal
blocks of tokens, so a request's ids form a chain from a root and the ids of all requests a
tree. The last block is usually partial (ceil(input_length / 512) ids).

How a block id becomes tokens (deterministic, the same in every process):

    tokens(b) = uint32 words of blake3("raykv-trace-block-v1|" | b as 8 bytes LE), XOF of
                4 * 512 bytes, each word mod VOCAB

A block depends on its id alone; its page key is raykv's chained key (cluster/core/keys.py),
so it depends on the whole chain of ids before it:

    key(b_i) = H(key(b_i-1) | tokens(b_i)),   key(b_-1) = the KeyChain's root

which is exactly KeyChain.keys(tokens(b0) + tokens(b1) + ...). Requests that share their first
k ids share their first k keys; an id met under two different parents (a trace that is not a
tree) gets two keys, as its tokens would in raykv.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import blake3
import numpy as np

from cluster.core.keys import KeyChain, PageKey, page_hash

BLOCK_TOKENS = 512
VOCAB = 32000
BLOCK_TAG = b"raykv-trace-block-v1|"


@dataclass(frozen=True, slots=True)
class BlockRequest:
    """One request of a block trace."""

    timestamp_ms: float
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]


class TraceError(ValueError):
    """A trace that cannot be read, or a line of it that is no request: the message names the
    file and the line."""


def parse_request(line: str) -> BlockRequest:
    """One line of a trace; ValueError naming what is wrong."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error.msg} at column {error.colno}): "
                         f"{line[:120]!r}") from None
    try:
        ids = tuple(int(b) for b in row["hash_ids"])
        request = BlockRequest(float(row["timestamp"]), int(row["input_length"]),
                               int(row.get("output_length", 0)), ids)
    except KeyError as missing:
        raise ValueError(f"not a block-trace request, no {missing} field: "
                         f"{line[:120]!r}") from None
    except (AttributeError, TypeError, ValueError) as error:
        raise ValueError(f"not a block-trace request ({error}): {line[:120]!r}") from None
    if request.input_tokens < 0 or any(b < 0 for b in ids):
        raise ValueError(f"negative length or block id in {line[:120]!r}")
    return request


def iter_trace(lines: Iterable[str]) -> Iterator[BlockRequest]:
    """The requests of a trace's lines, skipping blank ones; TraceError naming the line
    (counted from 1) of one that is no request."""
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            request = parse_request(line)
        except ValueError as error:
            raise TraceError(f"line {line_number}: {error}") from None
        yield request


def read_trace(path: str, limit: int | None = None) -> list[BlockRequest]:
    """The first `limit` requests (all when None; at least 1) of a JSONL block trace, in file
    order. TraceError, naming the file (and the line), for a file that cannot be read, a line
    that is no request, or a file with no request at all."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1 request, got {limit}")
    try:
        with open(path, encoding="utf-8") as file:
            out = list(itertools.islice(iter_trace(file), limit))
    except TraceError as error:
        raise TraceError(f"{path}, {error}") from None
    except UnicodeDecodeError as error:
        raise TraceError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})"
                         ) from None
    except OSError as error:
        raise TraceError(f"{path}: cannot read the trace ({error.strerror or error})") from None
    if not out:
        raise TraceError(f"{path}: no requests in the trace")
    return out


def block_tokens(block_id: int) -> np.ndarray:
    """The BLOCK_TOKENS token ids of block `block_id` (uint32, each < VOCAB)."""
    stream = blake3.blake3(BLOCK_TAG + int(block_id).to_bytes(8, "little"))
    words = np.frombuffer(stream.digest(4 * BLOCK_TOKENS), dtype="<u4")
    return (words % VOCAB).astype("<u4")


def request_tokens(request: BlockRequest) -> np.ndarray:
    """Every block's tokens, in order (whole blocks: the last may run past input_tokens)."""
    if not request.block_ids:
        return np.zeros(0, "<u4")
    return np.concatenate([block_tokens(b) for b in request.block_ids])


class BlockKeys:
    """Page keys of trace blocks, memoised per (parent key, block id)."""

    def __init__(self, chain: KeyChain) -> None:
        if chain.page_tokens != BLOCK_TOKENS:
            raise ValueError(f"a trace block is {BLOCK_TOKENS} tokens; the chain's pages are "
                             f"{chain.page_tokens}")
        self.root = chain.root
        self._keys: dict[tuple[PageKey, int], PageKey] = {}

    def keys(self, request: BlockRequest) -> list[PageKey]:
        """The page keys of the request's blocks, in order."""
        out: list[PageKey] = []
        parent = self.root
        for block_id in request.block_ids:
            key = self._keys.get((parent, block_id))
            if key is None:
                key = self._keys[(parent, block_id)] = page_hash(
                    parent, block_tokens(block_id).tobytes())
            out.append(key)
            parent = key
        return out

    def __len__(self) -> int:
        return len(self._keys)


def hit_tokens(num_hit_blocks: int) -> int:
    """Tokens of `num_hit_blocks` whole blocks. A prompt's last block is usually partial, so
    a hit on it counts up to 511 tokens more than the prompt has: the README's count ("whole
    512-token blocks"), and the measure that Belady's bound (cluster/core/belady.py) is
    exactly optimal for, as every block weighs the same."""
    return num_hit_blocks * BLOCK_TOKENS


def unlimited_hit_ratio(requests: Iterable[BlockRequest]) -> float:
    """Hit tokens over input tokens with a cache that never evicts: each request hits the
    longest prefix of its blocks that an earlier request had (ids form a tree, so seeing a
    block means having seen its ancestors)."""
    nodes: dict[tuple[int, int], int] = {}  # (parent node, block id) -> node of the tree
    hits = total = 0
    for request in requests:
        parent, num_hit, missed = -1, 0, False
        for block_id in request.block_ids:
            node = nodes.get((parent, block_id))
            if node is None:
                node = nodes[(parent, block_id)] = len(nodes)
                missed = True
            num_hit += not missed
            parent = node
        hits += hit_tokens(num_hit)
        total += request.input_tokens
    return hits / total if total else 0.0
