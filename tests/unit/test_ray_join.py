"""Where raykv finds a Ray cluster's auth token, and what it tells a user Ray refused (no Ray
is started here; tests/actors/test_token_auth.py joins a real token-auth head)."""

from __future__ import annotations

import pytest

from cluster.api import auth_hint, ray_token_source


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
