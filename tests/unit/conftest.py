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
