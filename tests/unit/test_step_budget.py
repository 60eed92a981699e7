"""What a vLLM engine's step may wait on raykv (cluster/serving/step_budget.py): nothing before
a step is timed, then the step's measured time over its requests, spent by lookups waited for
and loads made in the step; "async" never waits and "sync" always does."""

import pytest

from cluster.serving.step_budget import StepBudget


def timed(step_s=0.040, num_requests=4, mode="auto"):
    budget = StepBudget(mode)
    budget.step_timed(step_s)
    budget.step_started(num_requests)
    return budget


def test_nothing_is_waited_for_before_a_step_is_timed():
    budget = StepBudget()
    budget.step_started(1)
    assert budget.per_step_s() == 0.0
    assert not budget.may_wait(0.0) and not budget.may_wait(None)


def test_a_step_affords_its_time_over_its_requests():
    budget = timed(0.040, 4)
    assert budget.per_step_s() == pytest.approx(0.010)
    assert budget.may_wait(0.010) and not budget.may_wait(0.011)
    assert not budget.may_wait(None)  # never measured: run it off the step, and measure


def test_waits_spend_the_steps_budget_until_the_next_step():
    budget = timed(0.040, 4)
    budget.spend(0.006)
    assert budget.may_wait(0.004) and not budget.may_wait(0.005)
    budget.spend(0.010)
    assert budget.remaining_s == 0.0 and not budget.may_wait(0.0001)
    budget.step_started(2)  # the next step: 40 ms over 2 requests
    assert budget.may_wait(0.020)


def test_an_idle_engine_affords_a_whole_step_and_the_step_time_is_an_ewma():
    budget = timed(0.040, 0)  # a step of no request counts as one
    assert budget.per_step_s() == pytest.approx(0.040)
    budget.step_timed(0.0)  # untimed: ignored
    budget.step_timed(0.140)
    assert budget.step_s == pytest.approx(0.8 * 0.040 + 0.2 * 0.140)


def test_a_load_in_the_step_is_bounded_by_its_recompute_or_one_step_or_the_call_timeout():
    assert timed(0.040).sync_deadline_s(5.0) == pytest.approx(0.040)  # no prefill timed yet
    assert timed(0.040).sync_deadline_s(5.0, recompute_s=0.9) == pytest.approx(0.9)
    assert timed(0.040).sync_deadline_s(5.0, recompute_s=0.01) == pytest.approx(0.040)
    assert timed(0.040, mode="sync").sync_deadline_s(5.0, recompute_s=0.9) == 5.0
    assert timed(0.040).wait_limit_s(5.0) == pytest.approx(0.010)
    assert timed(0.040, mode="sync").wait_limit_s(5.0) == 5.0


def test_an_engine_that_runs_nothing_waits_for_a_lookup_whatever_its_estimate_one_step_at_most():
    budget = timed(0.040, 4)
    budget.spend(0.010)
    assert not budget.may_wait(0.500) and not budget.may_wait(None)
    budget.idle = True  # nothing runs: a lookup waited for holds up no other request
    assert budget.may_wait_for_lookup(0.500) and budget.may_wait_for_lookup(None)
    assert budget.wait_limit_s(5.0) == pytest.approx(0.040)  # one step, not the budget left
    assert not budget.may_wait(0.500)  # a load still goes by its estimate against the budget
    never_timed = StepBudget()
    never_timed.idle = True
    assert never_timed.may_wait_for_lookup(None)
    assert never_timed.wait_limit_s(5.0) == pytest.approx(1e-3)
    for mode, waits in (("async", False), ("sync", True)):
        fixed = timed(0.040, 4, mode)
        fixed.idle = True
        assert fixed.may_wait_for_lookup(0.5) is waits
    assert timed(0.040, 4, "sync").wait_limit_s(5.0) == 5.0


@pytest.mark.parametrize("mode, waits", [("async", False), ("sync", True)])
def test_the_fixed_modes_ignore_the_budget(mode, waits):
    never_timed = StepBudget(mode)
    assert never_timed.may_wait(None) is waits and never_timed.may_wait(10.0) is waits


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="load_mode"):
        StepBudget("eager")


def test_auto_saves_are_waited_for_in_the_next_step_bounded_by_their_recompute():
    budget = timed(0.040, 1)
    recompute_s = {2048: 0.5, 1024: 0.25}.__getitem__
    running = {"r", "s"}
    assert budget.save_waits({"r": 2048}, running, 5.0, recompute_s) == (None, None)  # its own
    assert budget.save_waits({}, running, 5.0, recompute_s) == (0.5, None)  # the next: recompute
    assert budget.save_waits({}, running, 5.0, recompute_s) == (None, None)  # none saved since
    budget.save_waits({"r": 128}, running, 5.0, lambda n: 0.001)
    assert budget.save_waits({}, running, 5.0, lambda n: 0.001) == (pytest.approx(0.040), None)
    # Only the saves of requests still running: "f" finished in the step that saved it (its
    # output is out), so its tokens are not waited for, and alone they wait for nothing.
    budget.save_waits({"f": 1024, "s": 1024}, running, 5.0, recompute_s)
    assert budget.save_waits({}, running, 5.0, recompute_s) == (0.25, None)
    budget.save_waits({"f": 1024}, running, 5.0, recompute_s)
    assert budget.save_waits({}, running, 5.0, recompute_s) == (None, None)


def test_auto_waits_for_no_chunk_of_a_prefill_that_goes_on_only_for_its_last_save():
    budget = timed(0.040, 1)
    recompute_s = {768: 0.2, 1024: 0.25}.__getitem__
    running = {"r"}
    budget.save_waits({"r": 768}, running, 5.0, recompute_s, ending=set())  # a chunk
    # the next chunk's step: no wait (no output of "r" comes before it); its save is the last
    assert budget.save_waits({"r": 256}, running, 5.0, recompute_s, ending={"r"}) == (None, None)
    assert budget.save_waits({}, running, 5.0, {256: 0.1}.__getitem__) == (pytest.approx(0.1),
                                                                             None)
    # "sync" still waits in the step of every save, a chunk's too
    sync = StepBudget(save_mode="sync")
    assert sync.save_waits({"r": 768}, running, 5.0, recompute_s, ending=set()) == (None, 5.0)


def test_sync_saves_wait_in_their_own_step_and_async_ones_never():
    sync = StepBudget(save_mode="sync")
    assert sync.save_waits({"r": 128}, {"r"}, 5.0, lambda n: 1.0) == (None, 5.0)
    assert sync.save_waits({}, {"r"}, 5.0, lambda n: 1.0) == (None, None)
    never = StepBudget(save_mode="async")
    never.save_waits({"r": 128}, {"r"}, 5.0, lambda n: 1.0)
    assert never.save_waits({}, {"r"}, 5.0, lambda n: 1.0) == (None, None)
    with pytest.raises(ValueError, match="raykv.save_mode"):
        StepBudget(save_mode="eager")


def test_a_load_estimated_past_its_deadline_is_not_made_in_the_step():
    budget = StepBudget()
    budget.step_timed(0.3)  # a long step: the budget alone would afford a 0.2 s load
    budget.step_started(1)
    assert budget.may_load_in_step(0.1, deadline_s=0.2)
    assert not budget.may_load_in_step(0.2, deadline_s=0.2)  # it would be cut there
    assert not budget.may_load_in_step(0.25, deadline_s=0.2)
    assert StepBudget(mode="sync").may_load_in_step(5.0, deadline_s=0.2)  # sync always waits
    assert not StepBudget(mode="async").may_load_in_step(0.0, deadline_s=0.2)
