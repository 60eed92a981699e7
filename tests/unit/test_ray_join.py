"""Where raykv finds a Ray cluster's auth token, and what it tells a user Ray refused (no Ray
is started here; tests/actors/test_token_auth.py joins a real token-auth head)."""

from __future__ import annotations

import logging
import socket
import time

import pytest
import ray

from cluster.api import auth_hint, join_ray, ray_token_source


@pytest.fixture
def home(tmp_path, monkeypatch):
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_the_token_is_found_where_ray_looks_in_its_order(home, monkeypatch):
    assert ray_token_source() is None
    default = home / ".ray" / "auth_token"
    default.parent.mkdir()
    default.write_text("")
    assert ray_token_source() is None  # an empty file is no token
    default.write_text("abc\n")
    assert ray_token_source() == str(default)
    named = home / "cluster-token"
    named.write_text("def")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(named))
    assert ray_token_source() == str(named)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "ghi")
    assert ray_token_source() == "RAY_AUTH_TOKEN"


def test_a_token_path_naming_nothing_is_refused_clearly(home, monkeypatch):
    # Ray would abort the whole process on it: raykv names the variable first.
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(home / "missing"))
    with pytest.raises(ValueError, match="RAY_AUTH_TOKEN_PATH"):
        ray_token_source()


def test_the_hint_says_what_to_export():
    hint = auth_hint("10.0.0.1:6379", "off (no token)", ConnectionError("Failed to connect"))
    assert "10.0.0.1:6379" in hint and "Failed to connect" in hint
    assert "RAY_AUTH_MODE=token" in hint and "RAY_AUTH_TOKEN_PATH=" in hint
    assert "RAY_AUTH_TOKEN=" in hint and "~/.ray/auth_token" in hint


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("where", ["argument", "RAY_ADDRESS"])
def test_a_dead_address_is_refused_within_seconds_with_the_hint(home, monkeypatch, where):
    # found by an audit: a stale RAY_ADDRESS kept every service command in Ray's retries for
    # minutes; unit tests' ray.init raises RuntimeError, so reaching it fails this test too
    target = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", target if where == "RAY_ADDRESS" else "")
    started_s = time.monotonic()
    with pytest.raises(ConnectionError, match=f"could not join the Ray cluster at '{target}'"):
        join_ray(target if where == "argument" else None)
    assert time.monotonic() - started_s < 10


def test_auto_and_ray_client_addresses_go_to_ray_unprobed(home, monkeypatch):
    calls = []
    monkeypatch.setattr(ray, "init", lambda address, **kwargs: calls.append(address))
    for address in ("auto", "ray://127.0.0.1:1"):
        join_ray(address)
    assert calls == ["auto", "ray://127.0.0.1:1"]


def test_the_cli_prints_the_hint_once_and_logs_it_only_at_debug(home, monkeypatch, caplog):
    # found by an audit: join_ray logged the hint as an ERROR, then the CLI printed it again
    from typer.testing import CliRunner

    from cluster.tools.cli import app

    def refused(**kwargs):
        raise ConnectionError("Failed to connect to GCS")

    monkeypatch.setattr(ray, "init", refused)
    with socket.socket() as listener:  # something listens: the port probe passes, Ray refuses
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        target = f"127.0.0.1:{listener.getsockname()[1]}"
        with caplog.at_level(logging.DEBUG, logger="raykv"):
            result = CliRunner().invoke(app, ["status"], env={"COLUMNS": "300",
                                                              "RAY_ADDRESS": target})
    assert result.exit_code == 1, result.output
    assert " ".join(result.output.split()).count("could not join the Ray cluster") == 1
    assert [r.levelno for r in caplog.records if "could not join" in r.getMessage()] == [
        logging.DEBUG]
