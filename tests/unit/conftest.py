"""Unit tier: no Ray. Starting Ray here is a bug, so ray.init raises."""

import os
import sys

import pytest

_EXIT_STATUS = pytest.StashKey[int]()


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    try:
        import ray
    except ImportError:  # pragma: no cover
        return

    def refuse(*args, **kwargs):
        raise RuntimeError("unit tests must not start Ray; put this test under tests/actors/")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture
def harness():
    """Pools over a temp disk dir (tests/unit/_pool_harness.py), closed and checked after."""
    from tests.unit._pool_harness import Harness

    h = Harness()
    yield h
    h.close()
    assert h.leftover_shm() == []


@pytest.fixture
def stores():
    """NodeStores over a temp disk dir (tests/unit/_pool_harness.py); closed after, and no
    shm file of their prefixes may be left."""
    from tests.unit._pool_harness import Stores

    s = Stores()
    yield s
    s.close()
    assert s.leftover_shm() == []


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """NIXL 1.5.1 crashes its process at exit (SIGSEGV in its native teardown) once a UCX
    agent was made in it, working or not: seen here with a bare nixl_agent, no torch, no
    raykv. So a run that loaded the NIXL transport ends here, after pytest reported, with
    pytest's own status instead of 139."""
    if "cluster.core.dataplane.nixl_agent" in sys.modules and _EXIT_STATUS in config.stash:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[_EXIT_STATUS])
