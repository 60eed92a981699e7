"""A block trace scaled down for a live replay on CPU engines (`raykv bench trace`).

Each 512-token block of the trace becomes one page of the live service: `page_tokens` tokens
of text. The tokenizer is byte-level, so a block is `page_tokens` one-byte characters:

    text(b) = page_tokens characters of ALPHABET (64 of them), character i = ALPHABET[byte i
              of blake3("raykv-trace-text-v1|" | b as 8 bytes LE) XOF mod 64]
    prompt  = text(b0) + text(b1) + ... + text(b_{f-1}) + tail
              f = the request's full blocks (input_length // 512); tail = the partial last
              block's first round(rest / 512 x page_tokens) characters (at most what keeps it
              short of a page)

The tokenizer puts `lead_tokens` tokens (BOS) before the text, so page i of the prompt holds
the tokens [i P, (i + 1) P): the end of block i-1's text (lead_tokens characters) and the
start of block i's. Its chained key therefore depends on blocks 0..i-1 whole and the first
P - lead_tokens characters of block i: two prompts share their first k pages exactly when
they share their first k blocks (distinct ids differ in those characters: 64^15 to one
against at 16-token pages, and `check_distinct` verifies it for the blocks replayed). With
the lead token and a tail shorter than a page, the prompt has exactly f full pages, and the
engine (which leaves at least one token to prefill) can hit all f of them.

Time: the trace's clock runs `speedup` times faster, from its first request: a request is
sent (timestamp - first timestamp) / 1000 / speedup seconds after the replay starts.

The hit ratio, live and simulated alike, is cached prompt tokens over prompt tokens of the
scaled prompts: whole pages of page_tokens, so it is the trace's own token hit ratio (512 x
hit blocks over input tokens) up to the tail's rounding.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import blake3

from cluster.core.trace_format import BLOCK_TOKENS, BlockRequest

ALPHABET = string.ascii_letters + string.digits + "-_"  # 64 one-byte characters
TEXT_TAG = b"raykv-trace-text-v1|"


@dataclass(frozen=True, slots=True)
class Scale:
    """How the trace shrinks: one block = one page of `page_tokens`; time `speedup` x."""

    page_tokens: int
    speedup: float = 1.0
    lead_tokens: int = 1  # what the tokenizer puts before the text (BOS)

    def __post_init__(self) -> None:
        if self.page_tokens < 2 or BLOCK_TOKENS % self.page_tokens:
            raise ValueError(f"page_tokens must divide {BLOCK_TOKENS} and be at least 2, "
                             f"got {self.page_tokens}")
        if not 0 <= self.lead_tokens < self.page_tokens:
            raise ValueError(f"lead_tokens must lie in [0, page_tokens), got {self.lead_tokens}")
        if self.speedup <= 0:
            raise ValueError(f"speedup must be positive, got {self.speedup}")

    @property
    def tokens_per_live_token(self) -> int:
        """Trace tokens that one live token stands for (512 / page_tokens)."""
        return BLOCK_TOKENS // self.page_tokens


@dataclass(frozen=True, slots=True)
class ScaledRequest:
    """One trace request as the live replay sends it."""

    index: int
    send_at_s: float
    text: str
    num_full_blocks: int
    prompt_tokens: int  # lead_tokens + characters: what the service counts
    block_ids: tuple[int, ...]


def block_text(block_id: int, num_chars: int) -> str:
    """The first `num_chars` characters of block `block_id`'s text (see module doc)."""
    digest = blake3.blake3(TEXT_TAG + int(block_id).to_bytes(8, "little")).digest(num_chars)
    return "".join(ALPHABET[byte % len(ALPHABET)] for byte in digest)


def num_full_blocks(request: BlockRequest) -> int:
    """The request's whole 512-token blocks (only these are cached, live and simulated)."""
    return min(len(request.block_ids), request.input_tokens // BLOCK_TOKENS)


def tail_chars(request: BlockRequest, scale: Scale) -> int:
    """Characters standing for the partial last block: its share of a page, rounded, at
    least what leaves the engine a token to prefill and at most what keeps it off a page."""
    rest_tokens = request.input_tokens - num_full_blocks(request) * BLOCK_TOKENS
    wanted = round(rest_tokens * scale.page_tokens / BLOCK_TOKENS)
    return min(max(wanted, 1 - scale.lead_tokens), scale.page_tokens - 1 - scale.lead_tokens)


def scale_request(index: int, request: BlockRequest, first_ms: float,
                  scale: Scale) -> ScaledRequest:
    full = num_full_blocks(request)
    parts = [block_text(b, scale.page_tokens) for b in request.block_ids[:full]]
    tail = tail_chars(request, scale)
    if tail:  # the partial block's own characters, or (none in the trace) a fixed filler
        partial = request.block_ids[full] if len(request.block_ids) > full else None
        parts.append(block_text(partial, tail) if partial is not None else "." * tail)
    text = "".join(parts)
    return ScaledRequest(index, compress_s(request.timestamp_ms, first_ms, scale.speedup), text,
                         full, scale.lead_tokens + len(text), request.block_ids)


def scale_trace(requests: Sequence[BlockRequest], scale: Scale) -> list[ScaledRequest]:
    """Every request scaled, sent in trace order from time 0."""
    first_ms = min((r.timestamp_ms for r in requests), default=0.0)
    return [scale_request(i, r, first_ms, scale) for i, r in enumerate(requests)]


def compress_s(timestamp_ms: float, first_ms: float, speedup: float) -> float:
    """Seconds after the replay's start at which a request of the trace is sent."""
    return (timestamp_ms - first_ms) / 1000.0 / speedup


def check_distinct(requests: Iterable[ScaledRequest], scale: Scale) -> int:
    """How many distinct full blocks the requests have; ValueError if two distinct ids share
    the characters that a page sees of them (they would share a page key)."""
    seen: dict[str, int] = {}
    head_chars = scale.page_tokens - scale.lead_tokens
    for request in requests:
        for block_id in request.block_ids[: request.num_full_blocks]:
            head = block_text(block_id, head_chars)
            if seen.setdefault(head, block_id) != block_id:
                raise ValueError(f"blocks {seen[head]} and {block_id} share their first "
                                 f"{head_chars} characters")
    return len(seen)


def hit_ratio(cached_tokens: int, prompt_tokens: int) -> float:
    """Cached over prompt tokens (0 for no prompt)."""
    return cached_tokens / prompt_tokens if prompt_tokens else 0.0


def hit_errors(live: Sequence[float], simulated: Sequence[float]) -> list[float]:
    """Per round: |live hit ratio - simulated hit ratio|."""
    return [abs(a - b) for a, b in zip(live, simulated, strict=True)]
