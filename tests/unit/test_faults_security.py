"""The security faults' ratios can fail: no attempt, or a control read that found nothing,
is not exercised (null, the run fails), never a pass; otherwise reads per attempt."""

from cluster.tools.bench.faults_security import read_ratio
from tests.unit.test_bench_faults import _all_faults, _result


def test_no_attempt_or_no_control_is_not_exercised_not_a_pass():
    assert read_ratio({}) is None
    assert read_ratio({"attempts": 0, "reads": 0, "control_pages": 4}) is None
    assert read_ratio({"attempts": 30, "reads": 0, "control_pages": 0}) is None
    assert read_ratio({"attempts": 30, "reads": 0, "control_pages": 4}) == 0.0
    assert read_ratio({"attempts": 30, "reads": 3, "control_pages": 4}) == 0.1


def test_the_ratios_and_their_goals_are_in_the_faults_json():
    result = _result(_all_faults(cross_tenant_pages={"reads": 2}))
    assert result["ratios"]["unauthenticated_reads"] == 0.0
    assert result["ratios"]["cross_tenant_reads"] == 2 / 45
    assert result["goals"]["unauthenticated_reads"] == {"max": 0}
    assert result["goals"]["cross_tenant_reads"] == {"max": 0}
    assert not result["met"]["cross_tenant_reads"]
    missing = _result(_all_faults(unauthenticated_pages={"control_pages": 0}))
    assert missing["ratios"]["unauthenticated_reads"] is None
    assert "unauthenticated_reads" in missing["not_exercised"]
