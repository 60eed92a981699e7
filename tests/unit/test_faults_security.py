"""The security faults' ratios can fail: no attempt, or a control read that found nothing,
is a failure (1.0), never a pass; otherwise reads per attempt."""

from cluster.tools.bench.faults import goals_for, ratios_of
from cluster.tools.bench.faults_security import read_ratio


def test_no_attempt_or_no_control_is_a_failure_not_a_pass():
    assert read_ratio({}) == 1.0
    assert read_ratio({"attempts": 0, "reads": 0, "control_pages": 4}) == 1.0
    assert read_ratio({"attempts": 30, "reads": 0, "control_pages": 0}) == 1.0
    assert read_ratio({"attempts": 30, "reads": 0, "control_pages": 4}) == 0.0
    assert read_ratio({"attempts": 30, "reads": 3, "control_pages": 4}) == 0.1


def test_the_ratios_and_their_goals_are_in_the_faults_json():
    fault = {"wrong_bytes": 0, "client_errors": 0, "recovery_s": 1.0}
    per_fault = {"unauthenticated_pages": {**fault, "attempts": 45, "reads": 0,
                                           "control_pages": 4},
                 "cross_tenant_pages": {**fault, "attempts": 45, "reads": 2,
                                        "control_pages": 4}}
    soak = {"wrong_bytes": 0, "client_errors": 0, "rss_growth": 0.0, "leases": 0,
            "reservations": 0, "files_left": 0}
    ratios = ratios_of({"per_fault": per_fault, "fuzz": {"failures": 0, "cases": 1}}, soak)
    assert ratios["unauthenticated_reads"] == 0.0 and ratios["cross_tenant_reads"] == 2 / 45
    goals = goals_for(ratios)
    assert goals["unauthenticated_reads"] == {"max": 0} == goals["cross_tenant_reads"]
