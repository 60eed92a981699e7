"""Whether a request is worth a raykv lookup, from what lookups measured (no vLLM import).

A lookup costs its request a wait: the call, and an engine step when it is not waited for
(step_budget.py). Behind a router that sends a conversation back to the replica that served
its last turn (Ray's prefix and KV-aware routers), vLLM's own cache already holds what raykv
would find, and a lone engine's follow-up turn paid +5 to +43 ms for a lookup that found
nothing more (docs/benchmarks.md, vllm-serve). Behind one that spreads turns over replicas,
raykv often holds more. So the rule is learnt, per engine, from the lookups made:

- `beyond`: how often raykv answered past what vLLM's own cache held, over the lookups of
  prompts vLLM held part of (an EWMA of 1s and 0s);
- `delay_s`: a lookup's whole delay to its request, from the first ask to the answer: the
  median of the last DELAY_WINDOW, so that one lookup stuck for seconds moves nothing.

A prompt vLLM holds part of is asked about when the most a hit could save it, recomputing
the rest at the engine's measured prefill rate, weighed by `beyond`, is at least the delay:

    beyond * recompute_s(rest) >= delay_s

It is always asked about when vLLM holds none of it (a new prompt: raykv is the only place
it can come from), before MIN_OUTCOMES such lookups were made, or before the engine timed a
prefill. And one skip in EXPLORE_EVERY asks anyway, so both estimates stay current when the
traffic changes; the rule never shuts lookups off on a stale figure (the failure of a rule
on the lookups' own time alone, reverted in 6d8bdfe: one slow measurement stopped every
lookup that could have brought it down).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from policies.cost_routing import ewma

MIN_OUTCOMES = 8  # lookups of partly held prompts before their outcome decides anything
EXPLORE_EVERY = 8  # one skip in this many is asked anyway, to keep the estimates current
DELAY_WINDOW = 16  # the lookups whose delays' median is the delay


@dataclass(slots=True)
class LookupWorth:
    """The measured worth of a lookup (module doc). `asked` feeds it each lookup's outcome;
    `worth_asking` decides the next prompt's."""

    beyond: float = 0.0  # EWMA: raykv answered past vLLM's cache (partly held prompts)
    delay_s: float = 0.0  # median of the last DELAY_WINDOW lookups' delays to their requests
    num_outcomes: int = 0
    num_delays: int = 0
    _delays_s: deque = field(default_factory=lambda: deque(maxlen=DELAY_WINDOW))
    num_skipped: int = 0  # prompts not asked about
    skips_in_a_row: int = 0

    def asked(self, num_computed_tokens: int, num_answered_tokens: int, delay_s: float) -> None:
        """A lookup's outcome: vLLM's own cache held `num_computed_tokens` of the prompt,
        raykv answered `num_answered_tokens`, `delay_s` after the request first asked."""
        self._delays_s.append(max(0.0, delay_s))
        self.delay_s = statistics.median(self._delays_s)
        self.num_delays += 1
        if num_computed_tokens > 0:
            found_more = 1.0 if num_answered_tokens > num_computed_tokens else 0.0
            self.beyond = ewma(self.beyond, found_more, self.num_outcomes)
            self.num_outcomes += 1

    def worth_asking(self, num_computed_tokens: int, rest_recompute_s: float | None) -> bool:
        """Whether to look up a prompt vLLM's own cache holds `num_computed_tokens` of, whose
        rest recomputes in `rest_recompute_s` (None: no prefill timed yet)."""
        if num_computed_tokens <= 0:
            return True  # a new prompt: raykv is the only place it can come from
        if rest_recompute_s is None or self.num_outcomes < MIN_OUTCOMES \
                or self.beyond * rest_recompute_s >= self.delay_s \
                or self.skips_in_a_row + 1 >= EXPLORE_EVERY:
            self.skips_in_a_row = 0
            return True
        self.skips_in_a_row += 1
        self.num_skipped += 1
        return False

    def published(self) -> dict:
        """The figures, for the engine's stats."""
        return {"lookups_beyond_vllm": round(self.beyond, 4),
                "lookup_delay_ms": round(self.delay_s * 1e3, 3),
                "lookups_timed": self.num_delays, "lookups_skipped": self.num_skipped}
