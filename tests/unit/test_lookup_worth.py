"""lookup_worth: a prompt vLLM's own cache holds part of is looked up only when what lookups
of such prompts found past vLLM's cache, weighed by what recomputing the rest costs, is worth
their measured delay; new prompts always are, nothing decides before MIN_OUTCOMES, and one
skip in EXPLORE_EVERY asks anyway, so a stale figure never shuts lookups off for good."""

from cluster.serving.lookup_worth import EXPLORE_EVERY, MIN_OUTCOMES, LookupWorth


def learnt(found_more: bool, delay_s: float = 0.005) -> LookupWorth:
    """MIN_OUTCOMES lookups of follow-up turns (vLLM held 64 tokens) that found 96 or 64."""
    worth = LookupWorth()
    for _ in range(MIN_OUTCOMES):
        worth.asked(64, 96 if found_more else 64, delay_s)
    return worth


def test_a_new_prompt_is_always_asked_about():
    worth = learnt(found_more=False)
    assert all(worth.worth_asking(0, rest_recompute_s=0.001) for _ in range(3 * EXPLORE_EVERY))
    assert worth.num_skipped == 0


def test_nothing_is_skipped_before_enough_outcomes_or_a_timed_prefill():
    worth = LookupWorth()
    for _ in range(MIN_OUTCOMES - 1):
        worth.asked(64, 64, 0.005)
        assert worth.worth_asking(64, rest_recompute_s=0.001)
    worth.asked(64, 64, 0.005)
    assert worth.worth_asking(64, rest_recompute_s=None)  # the engine timed no prefill yet
    assert not worth.worth_asking(64, rest_recompute_s=0.001)


def test_a_short_rest_is_skipped_when_lookups_found_nothing_more_and_a_long_one_is_not():
    worth = learnt(found_more=False)
    assert not worth.worth_asking(64, rest_recompute_s=0.011)  # one block of a follow-up
    assert worth.num_skipped == 1
    worth.beyond = 0.05  # one lookup in twenty found more
    assert not worth.worth_asking(64, rest_recompute_s=0.09)  # 4.5 ms expected, 5 ms asked
    assert worth.worth_asking(64, rest_recompute_s=0.2)  # 10 ms expected: worth the wait
    assert learnt(found_more=True).worth_asking(64, rest_recompute_s=0.011)


def test_one_skip_in_explore_every_is_asked_anyway_and_refreshes_the_estimates():
    worth = learnt(found_more=False, delay_s=10.0)  # one slow spell
    answers = [worth.worth_asking(64, rest_recompute_s=0.011) for _ in range(2 * EXPLORE_EVERY)]
    assert answers.count(True) == 2 and answers[EXPLORE_EVERY - 1]
    # what those lookups find puts the rule right: raykv now holds more, fast
    for _ in range(MIN_OUTCOMES + 1):
        worth.asked(64, 96, 0.002)
    assert worth.delay_s == 0.002 and worth.beyond > 0.8
    assert all(worth.worth_asking(64, rest_recompute_s=0.011) for _ in range(EXPLORE_EVERY))


def test_one_lookup_stuck_for_seconds_moves_the_delay_nothing():
    worth = learnt(found_more=False)
    worth.asked(64, 64, 10.0)
    assert worth.delay_s == 0.005
    assert not worth.worth_asking(64, rest_recompute_s=0.011)


def test_only_prompts_vllm_held_part_of_tell_how_often_raykv_held_more():
    worth = LookupWorth()
    for _ in range(MIN_OUTCOMES):
        worth.asked(0, 96, 0.004)  # new prompts: raykv found them, which says nothing here
    assert worth.num_outcomes == 0 and worth.num_delays == MIN_OUTCOMES
    assert worth.delay_s == 0.004
    assert worth.published() == {"lookups_beyond_vllm": 0.0, "lookup_delay_ms": 4.0,
                                 "lookups_timed": MIN_OUTCOMES, "lookups_skipped": 0}
