"""raykv's threads leave the cores a host pinned its thread to (cluster/core/cpu_sets.py), on
this machine's real CPUs."""

from __future__ import annotations

import os
import threading

import pytest

from cluster.core import cpu_sets

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs")


@pytest.fixture
def pinned():
    """The test's thread pinned to its first CPU, as vLLM's CPU worker pins its main thread;
    everything put back after."""
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {CPUS[0]})
    yield CPUS[0]
    cpu_sets.run_threads_on(set())
    os.sched_setaffinity(0, own)


def test_spare_cpus_are_the_parent_s_less_the_thread_s():
    assert cpu_sets.spare_cpus({0, 1, 2, 3}, {0}) == {1, 2, 3}
    assert cpu_sets.spare_cpus({0, 1}, {0, 1}) == set()  # not pinned to fewer: none spare
    assert cpu_sets.spare_cpus({0}, {0, 1}) == set()


@needs_two
def test_a_pinned_thread_sees_the_other_cpus_as_spare(pinned):
    assert cpu_sets.spare_cpus(set(CPUS)) == set(CPUS) - {pinned}


def _affinity_in(start) -> set[int]:
    seen: list[set[int]] = []
    start(lambda: seen.append(os.sched_getaffinity(0)))
    return seen[0]


def _in_thread(body) -> None:
    def run():
        cpu_sets.follow()  # as raykv's threads start
        body()
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()


def _in_pool(body) -> None:
    with cpu_sets.thread_pool(1, "raykv-test") as pool:  # as raykv's pools are made
        pool.submit(body).result()


@needs_two
def test_raykv_threads_started_by_a_pinned_thread_run_on_the_named_cpus(pinned):
    spare = cpu_sets.spare_cpus(set(CPUS))
    # Before any are named, a thread inherits its creator's mask (what went wrong in vLLM).
    assert _affinity_in(_in_thread) == {pinned}
    cpu_sets.run_threads_on(spare)
    assert _affinity_in(_in_thread) == spare
    assert _affinity_in(_in_pool) == spare
    assert os.sched_getaffinity(0) == {pinned}  # the pinned thread itself stays


@needs_two
def test_threads_started_inside_widened_inherit_the_named_cpus(pinned):
    cpu_sets.run_threads_on(cpu_sets.spare_cpus(set(CPUS)))
    seen: list[set[int]] = []
    with cpu_sets.widened():
        thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        thread.start()  # a library's thread that never calls follow (Ray's, at ray.init)
        thread.join()
    assert seen == [set(CPUS) - {pinned}]
    assert os.sched_getaffinity(0) == {pinned}


def test_with_nothing_named_nothing_moves():
    own = os.sched_getaffinity(0)
    cpu_sets.run_threads_on(set())
    assert cpu_sets.named_cpus() is None
    with cpu_sets.widened():
        assert os.sched_getaffinity(0) == own
    assert _affinity_in(_in_pool) == own
