"""Threads for work ahead of need run at a lower CPU priority (cluster/core/background.py)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from cluster.core.background import BACKGROUND_NICE, background_executor, lower_priority

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's")


def _nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux_only
def test_the_background_thread_is_nicer_and_the_caller_is_left_alone():
    before = _nice_of_this_thread()
    executor = background_executor("test-background")
    try:
        nice = executor.submit(_nice_of_this_thread).result()
    finally:
        executor.shutdown()
    assert nice == max(before, BACKGROUND_NICE)
    assert _nice_of_this_thread() == before  # per thread: the caller keeps its priority


@linux_only
def test_a_thread_already_nicer_is_not_made_less_nice():
    seen = []

    def run() -> None:
        lower_priority(BACKGROUND_NICE + 5)
        lower_priority(BACKGROUND_NICE)  # would raise the priority back: refused
        seen.append(_nice_of_this_thread())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [max(BACKGROUND_NICE + 5, _nice_of_this_thread())]
