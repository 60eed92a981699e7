"""The workload of `raykv bench vllm-serve`: Mooncake's conversation trace, thinned by
conversation and scaled down (pure; no Ray, no HTTP).

Within a short window, the conversation trace shares little (its first 300 requests reuse 9%
of their blocks): a conversation's turns lie minutes apart. So a round keeps whole
conversations, every `every`-th one from `offset`, across the trace's hour, and runs the clock
`speedup` times faster. A conversation is the requests whose first block that is not common to
most of the trace (every request starts with the same system block) is the same.

Each round takes another offset: other conversations, the same shape. Every request is then
cut to `max_blocks` blocks (the engines' context) and scaled (cluster/core/trace_scale.py:
one block = one engine block of text).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cluster.core.trace_format import BLOCK_TOKENS, BlockRequest
from cluster.core.trace_scale import Scale, ScaledRequest, scale_trace

COMMON_SHARE = 0.5  # a block in more than this share of the requests is not a conversation's


@dataclass(frozen=True, slots=True)
class Thinning:
    """Which conversations a round keeps and how its requests shrink."""

    every: int  # keep every every-th conversation (by first request's time)
    max_blocks: int  # blocks per request at most (the engines' max_model_len / block)
    speedup: float


def common_blocks(requests: Sequence[BlockRequest], share: float = COMMON_SHARE) -> set[int]:
    """The block ids that more than `share` of the requests hold (the shared system prompt)."""
    counts = Counter(b for r in requests for b in set(r.block_ids))
    return {block for block, count in counts.items() if count > share * len(requests)}


def conversations(requests: Sequence[BlockRequest]) -> list[list[BlockRequest]]:
    """The trace's conversations, in order of their first request; requests without a block of
    their own are left out."""
    common = common_blocks(requests)
    groups: dict[int, list[BlockRequest]] = defaultdict(list)
    for request in requests:
        own = next((b for b in request.block_ids if b not in common), None)
        if own is not None:
            groups[own].append(request)
    return sorted(groups.values(), key=lambda group: group[0].timestamp_ms)


def truncated(request: BlockRequest, max_blocks: int) -> BlockRequest:
    """The request with at most max_blocks blocks (and tokens to match)."""
    if len(request.block_ids) <= max_blocks and request.input_tokens <= max_blocks * BLOCK_TOKENS:
        return request
    return replace(request, block_ids=request.block_ids[:max_blocks],
                   input_tokens=min(request.input_tokens, max_blocks * BLOCK_TOKENS - 1))


def round_requests(groups: Sequence[Sequence[BlockRequest]], thinning: Thinning,
                   offset: int) -> list[BlockRequest]:
    """Round `offset`'s requests: every `every`-th conversation from `offset`, cut to
    max_blocks, in time order."""
    kept = [r for group in groups[offset::thinning.every] for r in group]
    kept.sort(key=lambda r: r.timestamp_ms)
    return [truncated(r, thinning.max_blocks) for r in kept]


def round_trace(groups: Sequence[Sequence[BlockRequest]], thinning: Thinning, offset: int,
                scale: Scale) -> list[ScaledRequest]:
    """Round `offset`'s requests scaled for the live replay."""
    scaled = Scale(scale.page_tokens, thinning.speedup, scale.lead_tokens)
    return scale_trace(round_requests(groups, thinning, offset), scaled)


def reusable_blocks_per_request(requests: Sequence[ScaledRequest]) -> list[int]:
    """Per request, in order: its leading full blocks whose whole prefix an earlier request
    sent (what one cache that never evicts would serve it)."""
    seen: set[tuple[int, ...]] = set()
    reusable = []
    for request in requests:
        blocks = request.block_ids[: request.num_full_blocks]
        hits = 0
        for depth in range(1, len(blocks) + 1):
            key = tuple(blocks[:depth])
            hits += key in seen
            seen.add(key)
        reusable.append(hits)
    return reusable


def reusable_blocks(requests: Sequence[ScaledRequest]) -> tuple[int, int]:
    """(full blocks whose whole prefix an earlier request sent, full blocks sent): what one
    cache that never evicts would serve, the most any set-up's caches can."""
    return (sum(reusable_blocks_per_request(requests)),
            sum(request.num_full_blocks for request in requests))


def prefix_reuse(requests: Sequence[ScaledRequest]) -> float:
    """The share of full blocks whose whole prefix an earlier request sent: the hit ratio of
    one cache that never evicts (an upper bound for every set-up)."""
    hits, total = reusable_blocks(requests)
    return hits / total if total else 0.0


def distinct_blocks(requests: Sequence[ScaledRequest]) -> int:
    """Distinct full-block prefixes sent: the working set, in engine blocks."""
    return len({tuple(r.block_ids[:depth]) for r in requests
                for depth in range(1, r.num_full_blocks + 1)})
