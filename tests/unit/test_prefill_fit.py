"""The prefill fit (cluster/serving/prefill_fit.py): a step's overhead, a cost per token and
one per attention pair, fitted online; and what a vLLM step's requests add in pairs."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from cluster.serving.engine_rates import EngineMeter, Step
from cluster.serving.prefill_fit import (
    PrefillFit,
    attention_pairs,
    published_prefill,
    scheduled_spans,
)
from cluster.serving.rates import RateMeter
from policies.cost_routing import pooled, prior_rates

FIXED_S, PER_TOKEN_S, PER_PAIR_S = 0.012, 1e-4, 2e-8


def step_s(num_tokens: int, num_pairs: int) -> float:
    return FIXED_S + PER_TOKEN_S * num_tokens + PER_PAIR_S * num_pairs


def test_pairs_are_each_new_token_s_attention_over_the_context_before_it():
    assert attention_pairs([(0, 4)]) == 16
    assert attention_pairs([(100, 28)]) == 128**2 - 100**2
    assert attention_pairs([(0, 4), (10, 1), (5, 0)]) == 16 + 21  # a decode: 2c + 1


def test_the_fit_recovers_overhead_tokens_and_attention_from_mixed_steps():
    """Prompts of different lengths behind different cached prefixes: the tokens and the
    pairs vary apart, and each slope comes back."""
    rng = random.Random(7)
    fit = PrefillFit()
    for _ in range(60):
        spans = [(rng.randrange(0, 3000), rng.randrange(1, 2000))
                 for _ in range(rng.randrange(1, 3))]
        num_tokens = sum(now for _, now in spans)
        fit.add(num_tokens, step_s(num_tokens, attention_pairs(spans)), attention_pairs(spans))
    assert fit.per_token_s() == pytest.approx(PER_TOKEN_S, rel=1e-6)
    assert fit.per_pair_s() == pytest.approx(PER_PAIR_S, rel=1e-6)
    assert fit.fixed_s() == pytest.approx(FIXED_S, rel=1e-6)
    assert fit.seconds(100, 10_000) == pytest.approx(PER_TOKEN_S * 100 + PER_PAIR_S * 10_000)


def test_without_pairs_that_vary_apart_the_attention_term_is_zero():
    """Every step a fresh prompt of the same shape: pairs are tokens squared, nearly
    proportional over a narrow range; the tokens' slope alone is fitted."""
    fit = PrefillFit()
    for num_tokens in (1000, 1010, 990, 1005) * 4:
        fit.add(num_tokens, step_s(num_tokens, num_tokens**2), num_tokens**2)
    per_token_s, per_pair_s = fit.slopes()
    assert per_pair_s == 0.0 and per_token_s > 0


def test_a_negative_attention_slope_is_not_believed():
    """Noise can give the pairs a negative slope; a prefill never gets cheaper with context."""
    fit = PrefillFit()
    for num_tokens, num_pairs in [(100, 10**6), (100, 0), (500, 0), (500, 10**6)] * 3:
        fit.add(num_tokens, 0.01 + 1e-4 * num_tokens - 1e-9 * num_pairs, num_pairs)
    per_token_s, per_pair_s = fit.slopes()
    assert per_pair_s == 0.0 and per_token_s == pytest.approx(1e-4, rel=0.05)


def test_an_engine_meter_fits_its_steps_pairs_and_publishes_them():
    meter = EngineMeter(16, 2048)
    assert "prefill_attention_s_per_pair" not in meter.published()
    rng = random.Random(3)
    for index in range(40):
        before, now = rng.randrange(0, 2000), rng.randrange(16, 1500)
        pairs = attention_pairs([(before, now)])
        meter.clock.scheduled(Step(now, True, float(index), pairs))
        meter.step_done(index + step_s(now, pairs))
    shown = meter.published()
    assert shown["prefill_attention_s_per_pair"] == pytest.approx(PER_PAIR_S, rel=1e-4)
    assert shown["prefill_tokens_per_s"] == pytest.approx(1 / PER_TOKEN_S, rel=1e-4)
    assert shown["step_overhead_s"] == pytest.approx(FIXED_S, rel=1e-3)
    router = pooled(prior_rates(), {"r0": shown})
    assert router.attention_s_per_pair == pytest.approx(PER_PAIR_S, rel=1e-4)


def test_raykv_s_own_engines_fit_attention_from_each_prefill_s_cached_prefix():
    meter = RateMeter("r0", 16, 2048)
    rng = random.Random(5)
    for _ in range(40):
        cached, new = rng.randrange(0, 2000), rng.randrange(16, 1500)
        meter.prefilled(new, step_s(new, attention_pairs([(cached, new)])), cached)
    shown = meter.published()
    assert shown["prefill_attention_s_per_pair"] == pytest.approx(PER_PAIR_S, rel=1e-4)
    assert shown["prefill_tokens_per_s"] == pytest.approx(1 / PER_TOKEN_S, rel=1e-4)
    assert published_prefill(PrefillFit()) == {}


def test_a_vllm_step_s_spans_come_from_its_new_and_running_requests():
    output = SimpleNamespace(
        num_scheduled_tokens={"new": 512, "running": 1, "chunked": 256, "lost": 3},
        scheduled_new_reqs=[SimpleNamespace(req_id="new", num_computed_tokens=64)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["running", "chunked"],
                                              num_computed_tokens=[700, 512]))
    assert sorted(scheduled_spans(output)) == [(64, 512), (512, 256), (700, 1)]
