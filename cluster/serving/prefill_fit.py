"""What an engine's prefill takes, fitted online to the steps (or requests) it timed.

    seconds = fixed_s + tokens x per_token_s + pairs x per_pair_s

- `tokens`: the tokens computed (a step's scheduled tokens, or a request's uncached ones);
- `pairs`: their causal attention, sum over the requests of (context after)^2 - (context
  before)^2 (`attention_pairs`): each new token attends to every token before it, so
  prefilling positions c..n costs n^2 - c^2 pairs, and the cost router prices a cut the same
  way (policies/cost_routing.py);
- `fixed_s`: a step's overhead (scheduling, sampling, Python), which is not a token's cost: a
  9-token prefill in a 15 ms step is not 600 tokens/s on an engine that prefills 1,285
  tokens in 100 ms.

The fit is least squares over exponentially weighted means (policies.cost_routing.ewma), so it
follows the engine as it speeds up or slows down. The two slopes are fitted together only
where the steps seen tell them apart (prompts of different lengths behind different prefixes:
tokens and pairs not nearly proportional) and both come out non-negative; otherwise the
attention term is 0 and the tokens' slope is fitted alone, which folds the attention of
prompts of the usual length into it (the rate a single tokens/s gave before).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from policies.cost_routing import PREFILL_ATTENTION, ewma

# Tokens and pairs tell their slopes apart only if they are not nearly proportional: their
# correlation's square below this. Past it the 2x2 system is ill-conditioned and noise in
# the step times swings the slopes against each other.
MAX_CORRELATION_SQ = 0.995
_MEANS = ("tokens", "pairs", "s", "tokens_sq", "pairs_sq", "tokens_pairs", "tokens_s",
          "pairs_s")


def attention_pairs(spans: Iterable[tuple[int, int]]) -> int:
    """The attention pairs of computing `spans`, (tokens already computed, tokens computed
    now) per request: sum of (before + now)^2 - before^2."""
    return sum((before + now) ** 2 - before * before for before, now in spans if now > 0)


@dataclass(slots=True)
class PrefillFit:
    """EWMA least squares of seconds against tokens and attention pairs (module doc)."""

    num_samples: int = 0
    tokens: float = 0.0
    pairs: float = 0.0
    s: float = 0.0
    tokens_sq: float = 0.0
    pairs_sq: float = 0.0
    tokens_pairs: float = 0.0
    tokens_s: float = 0.0
    pairs_s: float = 0.0

    def add(self, num_tokens: int, seconds: float, num_pairs: int = 0) -> None:
        """One timed prefill of `num_tokens` (and their `num_pairs`) in `seconds`."""
        if num_tokens <= 0 or seconds <= 0:
            return
        t, p = float(num_tokens), float(max(0, num_pairs))
        samples = (t, p, seconds, t * t, p * p, t * p, t * seconds, p * seconds)
        for name, sample in zip(_MEANS, samples, strict=True):
            setattr(self, name, ewma(getattr(self, name), sample, self.num_samples))
        self.num_samples += 1

    def slopes(self) -> tuple[float, float] | None:
        """(per_token_s, per_pair_s); None before any sample. per_pair_s is 0 where the two
        cannot be told apart (module doc); per_token_s is then the tokens' slope alone, or the
        mean seconds per token where the steps seen are all of one size or that slope is not
        positive."""
        if not self.num_samples:
            return None
        var_t = self.tokens_sq - self.tokens ** 2
        var_p = self.pairs_sq - self.pairs ** 2
        cov_tp = self.tokens_pairs - self.tokens * self.pairs
        cov_ts = self.tokens_s - self.tokens * self.s
        cov_ps = self.pairs_s - self.pairs * self.s
        det = var_t * var_p - cov_tp * cov_tp
        if var_t > (0.01 * self.tokens) ** 2 and var_p > 0 \
                and det > (1 - MAX_CORRELATION_SQ) * var_t * var_p:
            per_token_s = (cov_ts * var_p - cov_ps * cov_tp) / det
            per_pair_s = (cov_ps * var_t - cov_ts * cov_tp) / det
            if per_token_s > 0 and per_pair_s >= 0:
                return per_token_s, per_pair_s
        if var_t > (0.01 * self.tokens) ** 2 and cov_ts > 0:
            return cov_ts / var_t, 0.0
        return self.s / self.tokens, 0.0

    def per_token_s(self) -> float | None:
        """The marginal seconds per token (slopes); None before any sample."""
        slopes = self.slopes()
        return None if slopes is None else slopes[0]

    def per_pair_s(self) -> float:
        """The attention term's seconds per pair (slopes); 0 before any sample."""
        slopes = self.slopes()
        return 0.0 if slopes is None else slopes[1]

    def fixed_s(self) -> float:
        """A step's fixed seconds (its overhead), >= 0."""
        slopes = self.slopes()
        if slopes is None:
            return 0.0
        per_token_s, per_pair_s = slopes
        return max(0.0, self.s - per_token_s * self.tokens - per_pair_s * self.pairs)

    def seconds(self, num_tokens: int, num_pairs: int = 0) -> float | None:
        """What computing `num_tokens` (with `num_pairs`) adds to a step: the two slopes'
        part, not the step's overhead; None before any sample."""
        slopes = self.slopes()
        if slopes is None:
            return None
        return max(0, num_tokens) * slopes[0] + max(0, num_pairs) * slopes[1]


def published_prefill(fit: PrefillFit) -> dict:
    """A fit as a replica publishes it to routers (policies.cost_routing.pooled reads it):
    tokens/s of the per-token slope, the attention term, the samples and the step overhead;
    nothing before any sample."""
    slopes = fit.slopes()
    if slopes is None:
        return {}
    return {"prefill_tokens_per_s": 1.0 / slopes[0], PREFILL_ATTENTION: slopes[1],
            "prefill_samples": fit.num_samples, "step_overhead_s": fit.fixed_s()}


def scheduled_spans(output) -> list[tuple[int, int]]:
    """(tokens computed before, tokens scheduled now) of each request in a vLLM step
    (`output`: its SchedulerOutput: new requests carry their computed tokens, those already
    running carry them in `scheduled_cached_reqs`); a request whose count is not found is left
    out (its pairs then go uncounted, never guessed)."""
    scheduled = output.num_scheduled_tokens
    computed = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
    cached = output.scheduled_cached_reqs
    computed.update(zip(getattr(cached, "req_ids", ()),
                        getattr(cached, "num_computed_tokens", ()), strict=False))
    return [(computed[req_id], num) for req_id, num in scheduled.items() if req_id in computed]
