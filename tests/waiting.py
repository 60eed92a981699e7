"""Polling for what the service does in the background (event flushes, adoption, pulls)."""

from __future__ import annotations

import time


def wait_until(predicate, timeout_s: float, what: str, period_s: float = 0.1):
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        value = predicate()
        if value:
            return value
        time.sleep(period_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
