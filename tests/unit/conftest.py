"""Unit tier: no Ray. Starting Ray here is a bug, so ray.init raises."""

import pytest


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
