"""`raykv bench faults`' pure parts: every operation is counted (in flight at a fault, between
windows, a dead thread), a window without operations or a disk fault that no read noticed is
not exercised, and fuzz_cases is a count without a goal. No Ray."""

import pytest

from cluster.tools.bench import faults
from cluster.tools.bench.faults_workload import (
    Record,
    Workload,
    in_window,
    recovery_s,
    tally,
    timed_record,
)
from cluster.tools.bench.harness import Report, failed, goals_met

SOAK = {"ops": 100, "wrong_bytes": 0, "client_errors": 0, "rss_growth": 0.01, "leases": 0,
        "reservations": 0, "files_left": 0}
FAULT = {"ops": 10, "wrong_bytes": 0, "client_errors": 0, "recovery_s": 1.0}


def _result(per_fault: dict, run: dict | None = None, soak: dict | None = None) -> dict:
    report = Report("faults", "counts and seconds", {}, faults.GOALS)
    fault_part = {"per_fault": per_fault, "fuzz": {"cases": 1050, "failures": 0},
                  "run": run or {"ops": 500, "wrong_bytes": 0, "client_errors": 0}}
    faults.fill_ratios(report, fault_part, soak or SOAK)
    report["met"] = goals_met(report.ratios, report["goals"])
    return report.result


def _all_faults(**changes) -> dict:
    per_fault = {name: dict(FAULT) for name in faults.FAULTS}
    per_fault["flipped_disk_bytes"]["checksum_failures"] = 3
    per_fault["torn_write"]["checksum_failures"] = 2
    per_fault["stalled_writer"]["stalled_writes"] = 2
    for name in ("unauthenticated_pages", "cross_tenant_pages"):
        per_fault[name].update(attempts=45, reads=0, control_pages=4)
    for name, figures in changes.items():
        per_fault[name].update(figures)
    return per_fault


def test_an_operation_in_flight_when_a_fault_hits_is_in_its_window():
    records = [Record("put", 0.0, 5.5, False, 1), Record("put", 4.0, 4.5, True),
               Record("put", 6.0, 7.0, True), Record("put", 9.0, 12.0, False, 0, "boom"),
               Record("put", 13.0, 14.0, True)]
    window = in_window(records, 5.0, 10.0)
    assert window == [records[0], records[2], records[3]]  # in flight at both ends too
    assert tally(window) == {"ops": 3, "wrong_bytes": 1, "client_errors": 1, "misses": 1,
                             "errors": ["boom"]}


def test_wrong_bytes_and_client_errors_sum_every_operation_of_the_run_not_the_windows():
    result = _result(_all_faults(), run={"ops": 900, "wrong_bytes": 2, "client_errors": 3},
                     soak={**SOAK, "wrong_bytes": 1, "client_errors": 1})
    assert result["ratios"]["wrong_bytes"] == 3.0 and result["ratios"]["client_errors"] == 4.0
    assert not result["met"]["wrong_bytes"] and not result["met"]["client_errors"]


def test_a_window_without_an_operation_of_its_kinds_is_not_exercised():
    records = [Record("http", 1.0, 2.0, True), Record("put", 0.0, 0.5, False)]
    assert recovery_s(records, 1.0, ("put", "remote")) is None
    assert recovery_s([Record("put", 0.5, 2.0, False), Record("put", 2.5, 3.0, True)], 1.0,
                      ("put",)) == 2.0  # the failure in flight at the injection counts
    result = _result(_all_faults(redis={"recovery_s": None}))
    assert result["ratios"]["recovery_s_redis"] is None and "recovery_s_redis" in failed(result)
    assert result["met"]["recovery_s_node"]


@pytest.mark.parametrize("fault", ["flipped_disk_bytes", "torn_write"])
def test_a_disk_fault_fails_unless_the_checksum_failure_counter_rose(fault):
    result = _result(_all_faults(**{fault: {"checksum_failures": 0}}))
    assert result["ratios"][f"recovery_s_{fault}"] is None
    assert "checksum" in failed(result)[f"recovery_s_{fault}"]
    assert _result(_all_faults())["ratios"][f"recovery_s_{fault}"] == 1.0


def test_fuzz_cases_is_a_count_without_a_goal_and_a_clean_run_fails_nothing():
    result = _result(_all_faults())
    assert result["ratios"]["fuzz_cases"] == 1050.0 and "fuzz_cases" not in result["goals"]
    assert failed(result) == {} and all(result["met"].values())


@pytest.mark.parametrize("stalled_writes, wrong, met", [(2, 0, True), (1, 0, False),
                                                        (2, 1, False)])
def test_the_stalled_writer_fault_fails_on_wrong_bytes_and_when_nothing_stalled(
        stalled_writes, wrong, met):
    result = _result(_all_faults(stalled_writer={"wrong_bytes": wrong,
                                                 "stalled_writes": stalled_writes}))
    assert result["ratios"]["stalled_writer_wrong_bytes"] == wrong
    assert (result["met"]["stalled_writer_wrong_bytes"] and result["met"]["stalled_writes"]) is met
    nothing = _result(_all_faults(stalled_writer={"stalled_writes": 0}))
    assert "stalled_writer_wrong_bytes" in failed(nothing)


def test_a_soak_without_operations_fails_its_ratios():
    result = _result(_all_faults(), soak={**SOAK, "ops": 0})
    assert {"soak_leases", "soak_files_left", "wrong_bytes"} <= set(failed(result))


def test_an_exception_is_an_error_record_and_a_dead_thread_is_counted():
    def boom():
        raise ConnectionError("refused")

    record = timed_record("put", boom)
    assert not record.ok and "refused" in record.error and record.end_s >= record.start_s
    work = Workload(spec=None, num_threads=0, max_ops=10)
    work.start([lambda w: w.op("old", lambda: (True, 0)) and boom()])
    work.stop(timeout_s=10)
    assert [r.kind for r in work.records] == ["old", "thread"]
    assert tally(work.records)["client_errors"] == 1


def test_a_fault_that_records_its_own_ops_recovers_on_them_not_on_later_ones():
    own = [Record("mid_put", 1.0 + i, 1.5 + i, True) for i in range(3)]
    assert faults._recovered(own, 0.5, 5.0, ("mid_put",))
    puts = [Record("put", 4.0 + i, 4.2 + i, True) for i in range(3)]
    assert not faults._recovered(puts, 0.5, 5.0, ("put",))  # started before it was undone
    assert faults._recovered(puts, 0.5, 4.0, ("put",))
