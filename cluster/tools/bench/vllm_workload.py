"""The workload of `raykv bench vllm`, and what a perfect shared cache would hit (pure).

    system prefix   SYSTEM_TOKENS shared by every session
    session s       its own document (DOC_TOKENS), then turns: each turn adds a user message
                    and a scripted answer (TURN_TOKENS), and asks for the next token

Round r sends turn r of every session; turn r of session s goes to engine (s + r) % 2, so each
turn lands on the other engine than the turn before: the two engines stand in for two replicas
behind a router that knows nothing of the cache. Prompts are byte-level token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

SYSTEM_TOKENS = 1536
DOC_TOKENS = 512
TURN_TOKENS = 128
NUM_ENGINES = 2


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


def _common_prefix(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    for i in range(limit):
        if a[i] != b[i]:
            return i
    return limit


@dataclass
class HitAccount:
    """Per request: the prefix (whole blocks, at most len - 1) that the other engine computed
    and this engine never did: what a shared cache can hand over. Pages are whole blocks of a
    prompt: a prompt's trailing partial block is never stored."""

    block_tokens: int

    def __post_init__(self) -> None:
        self.seen: list[list[list[int]]] = [[] for _ in range(NUM_ENGINES)]

    def _best(self, prompt: list[int], prompts: list[list[int]]) -> int:
        best = 0
        for earlier in prompts:
            stored = len(earlier) // self.block_tokens * self.block_tokens
            best = max(best, min(_common_prefix(prompt, earlier), stored))
        loadable = (len(prompt) - 1) // self.block_tokens * self.block_tokens
        return min(best // self.block_tokens * self.block_tokens, loadable)

    def expect(self, request: Request) -> tuple[int, int]:
        """(tokens this engine's own cache can hit, tokens only the other engine computed);
        then records the prompt as computed by its engine."""
        local = self._best(request.prompt, self.seen[request.engine])
        anywhere = self._best(request.prompt, [p for seen in self.seen for p in seen])
        self.seen[request.engine].append(request.prompt)
        return local, max(anywhere - local, 0)
