"""Manifest tests: files and schemas only, no Ray cluster (ray.init raises, as in tests/unit)."""

import pytest


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise RuntimeError("manifest tests must not start Ray")

    monkeypatch.setattr(ray, "init", refuse)
