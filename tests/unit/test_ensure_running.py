"""`cluster.api.ensure_running`, what the Serve app builders call: a running service is adopted
as it is; a warning names what differs only when settings were asked for; the service is
started only when none runs (Ray and the service stand-ins: no Ray here)."""

from __future__ import annotations

import logging

import pytest

from cluster import api
from cluster.core.config import CacheConfig

RUNNING = CacheConfig(page_tokens=64)


@pytest.fixture
def cluster_with(monkeypatch):
    """Point ensure_running at a stand-in service: `running` (None: none runs); returns the
    configs start() was called with."""
    started: list[CacheConfig] = []

    def with_service(running: CacheConfig | None) -> list[CacheConfig]:
        def running_config(_namespace: str) -> CacheConfig:
            if running is None:
                raise RuntimeError("raykv is not running on this Ray cluster")
            return running

        monkeypatch.setattr(api, "_ensure_ray", lambda config: None)
        monkeypatch.setattr(api, "running_config", running_config)
        monkeypatch.setattr(api, "start", started.append)
        return started

    return with_service


def test_no_settings_adopt_the_running_service_with_no_warning(cluster_with, caplog):
    started = cluster_with(RUNNING)
    with caplog.at_level(logging.WARNING, logger="raykv"):
        assert api.ensure_running(None) == RUNNING
        assert api.ensure_running() == RUNNING
    assert started == [] and "adopted" not in caplog.text


def test_settings_that_differ_are_named_in_a_warning_and_not_used(cluster_with, caplog):
    started = cluster_with(RUNNING)
    with caplog.at_level(logging.WARNING, logger="raykv"):
        assert api.ensure_running(CacheConfig()) == RUNNING
    assert started == []
    assert "adopted" in caplog.text and "'page_tokens': 64" in caplog.text


def test_the_same_settings_adopt_quietly(cluster_with, caplog):
    cluster_with(RUNNING)
    with caplog.at_level(logging.WARNING, logger="raykv"):
        assert api.ensure_running(CacheConfig(page_tokens=64)) == RUNNING
    assert "adopted" not in caplog.text


@pytest.mark.parametrize("asked", [None, CacheConfig(page_tokens=32)])
def test_with_no_service_it_starts_one_with_the_settings_or_the_defaults(cluster_with, asked):
    started = cluster_with(None)
    wanted = CacheConfig() if asked is None else asked
    assert api.ensure_running(asked) == wanted
    assert started == [wanted]
