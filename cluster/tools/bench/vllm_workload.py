"""The workload of `raykv bench vllm`, and what a perfect shared cache would hit (pure).

    system prefix   SYSTEM_TOKENS shared by every session
    session s       its own document (DOC_TOKENS), then turns: each turn adds a user message
                    and a scripted answer (TURN_TOKENS), and asks for the next tokens

Every part is a whole number of pages (PAGE_TOKENS: raykv's page, LMCache's chunk and vLLM's
CPU block alike), so that no cache loses half a page or chunk at a turn's boundary.

Round r sends turn r of every session; turn r of session s goes to engine (s + r) % 2, so each
turn lands on the other engine than the turn before: the two engines stand in for two replicas
behind a router that knows nothing of the cache. Prompts are byte-level token ids.

Besides the workload: a warm-up prompt per engine and back-to-back prompts (one engine
computes, the other asks right after), each as long as the longest timed prompt and sharing
no page with the workload or with each other.
"""

from __future__ import annotations

from dataclasses import dataclass

PAGE_TOKENS = 128
SYSTEM_TOKENS = 12 * PAGE_TOKENS
DOC_TOKENS = 4 * PAGE_TOKENS
TURN_TOKENS = PAGE_TOKENS
NUM_ENGINES = 2
WARMUP_SEED, BACK_TO_BACK_SEED = 7, 20


@dataclass(frozen=True, slots=True)
class Request:
    engine: int
    session: int
    turn: int
    prompt: list[int]


def _tokens(seed: int, num_tokens: int) -> list[int]:
    """Deterministic byte ids (a seed's stream never repeats another's at the same offset)."""
    return [(seed * 7919 + i * 31 + (i * i) % 97) % 251 for i in range(num_tokens)]


def workload(num_sessions: int, num_turns: int) -> list[Request]:
    system = _tokens(1, SYSTEM_TOKENS)
    requests = []
    for turn in range(num_turns):
        for session in range(num_sessions):
            history = system + _tokens(100 + session, DOC_TOKENS)
            for past in range(turn + 1):
                history += _tokens(1000 + session * 64 + past, TURN_TOKENS)
            engine = (session + turn) % NUM_ENGINES
            requests.append(Request(engine, session, turn, history))
    return requests


def longest_prompt_tokens(num_turns: int) -> int:
    return SYSTEM_TOKENS + DOC_TOKENS + num_turns * TURN_TOKENS


def warmup_prompt(engine: int, num_tokens: int) -> list[int]:
    """A prompt as long as the timed ones that shares no page with them."""
    return _tokens(WARMUP_SEED + engine, num_tokens)


def back_to_back_prompts(num_prompts: int, num_tokens: int) -> list[list[int]]:
    """Prompts for the back-to-back phase: fresh to every cache."""
    return [_tokens(BACK_TO_BACK_SEED + i, num_tokens) for i in range(num_prompts)]


def loadable_tokens(num_prompt_tokens: int, page_tokens: int = PAGE_TOKENS) -> int:
    """What a cache of whole pages can hand an engine for a prompt: its whole pages, at most
    len - 1 tokens, since the engine computes the last token (a prompt of whole pages, held
    whole, is handed over less that one token, as LMCache and raykv both do)."""
    return min(num_prompt_tokens // page_tokens * page_tokens, max(num_prompt_tokens - 1, 0))


def _common_prefix(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    for i in range(limit):
        if a[i] != b[i]:
            return i
    return limit


@dataclass
class HitAccount:
    """Per request: the prefix (whole pages, at most len - 1 tokens) that the other engine
    computed and this engine never did: what a shared cache can hand over. A prompt's
    trailing partial page is never stored."""

    block_tokens: int = PAGE_TOKENS

    def __post_init__(self) -> None:
        self.seen: list[list[list[int]]] = [[] for _ in range(NUM_ENGINES)]

    def _best(self, prompt: list[int], prompts: list[list[int]]) -> int:
        best = 0
        for earlier in prompts:
            stored = len(earlier) // self.block_tokens * self.block_tokens
            best = max(best, min(_common_prefix(prompt, earlier), stored))
        loadable = loadable_tokens(len(prompt), self.block_tokens)
        return min(best // self.block_tokens * self.block_tokens, loadable)

    def expect(self, request: Request) -> tuple[int, int]:
        """(tokens this engine's own cache can hit, tokens only the other engine computed);
        then records the prompt as computed by its engine."""
        local = self._best(request.prompt, self.seen[request.engine])
        anywhere = self._best(request.prompt, [p for seen in self.seen for p in seen])
        self.seen[request.engine].append(request.prompt)
        return local, max(anywhere - local, 0)


def loaded_tokens(cached: int, local: int, cross: int) -> int:
    """Of what vLLM reported cached, the tokens that came from the other engine's work."""
    return min(max(cached - local, 0), cross)
