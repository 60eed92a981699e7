"""The HTTP front door without Ray: when API keys are required (more than one namespace, a
non-loopback or unknown bind), how keys are kept (digests only), and the namespace a request
may use with and without keys. The same rules over real Serve: tests/actors/test_http_access.py."""

from __future__ import annotations

import pickle

import pytest
from starlette.requests import Request
from typer.testing import CliRunner

from cluster.serving.access import (
    Access,
    KeysRequired,
    api_keys_from_env,
    is_loopback,
    require_keys_for_bind,
    require_keys_for_namespaces,
)

KEYED = Access.of({"key-a": "default", "key-b": "tenant-b"})


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost"])
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "raykv-head",
                                  "", None])
def test_every_other_host_counts_as_reachable(host):
    assert not is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", None])
def test_a_non_loopback_or_unknown_bind_without_keys_is_refused(host):
    with pytest.raises(KeysRequired, match="RAYKV_API_KEYS") as refused:
        require_keys_for_bind(Access(), host)
    assert ("could not be checked" in str(refused.value)) == (host is None)
    require_keys_for_bind(KEYED, host)  # with keys: fine


def test_the_bind_is_unknown_without_ray_and_so_refused():
    from cluster.serving.ingress import serve_bind_host

    assert serve_bind_host() is None  # no Ray here: nothing to read, and nothing started
    with pytest.raises(KeysRequired, match="could not be checked"):
        require_keys_for_bind(Access(), serve_bind_host())


def test_loopback_without_keys_is_allowed():
    require_keys_for_bind(Access(), "127.0.0.1")


def test_more_than_one_namespace_without_keys_is_refused():
    require_keys_for_namespaces(Access(), ["default"])
    with pytest.raises(KeysRequired, match="tenant-b.*RAYKV_API_KEYS"):
        require_keys_for_namespaces(Access(), ["default", "tenant-b"])
    with pytest.raises(KeysRequired):
        require_keys_for_namespaces(Access(), ["acme"])  # one namespace, not the default
    require_keys_for_namespaces(KEYED, ["default", "tenant-b"])


def test_keys_are_kept_as_digests_only():
    access = Access.of({"s3cret-key-for-b": "tenant-b"})
    assert b"s3cret-key-for-b" not in pickle.dumps(access)
    assert access.namespace_of("Bearer s3cret-key-for-b") == "tenant-b"
    assert access.namespace_of("bearer  s3cret-key-for-b ") == "tenant-b"
    for wrong in (None, "", "Bearer", "Bearer ", "Basic s3cret-key-for-b", "s3cret-key-for-b",
                  "Bearer s3cret-key-for-", "Bearer key-a"):
        assert access.namespace_of(wrong) is None, wrong


def test_api_keys_from_the_environment(monkeypatch):
    monkeypatch.delenv("RAYKV_API_KEYS", raising=False)
    assert api_keys_from_env() == {}
    monkeypatch.setenv("RAYKV_API_KEYS", '{"k1": "default", "k2": "acme"}')
    assert api_keys_from_env() == {"k1": "default", "k2": "acme"}
    for bad in ('{"k1": ', '["k1"]', '{"k1": ""}', '{"": "default"}', '{" k1": "default"}',
                '{"k1": 3}'):
        monkeypatch.setenv("RAYKV_API_KEYS", bad)
        with pytest.raises(ValueError, match="RAYKV_API_KEYS"):
            api_keys_from_env()


def test_app_args_check_the_keys(monkeypatch):
    from pydantic import ValidationError

    from cluster.serving.app import AppArgs

    monkeypatch.setenv("RAYKV_API_KEYS", '{"k1": "acme"}')
    assert AppArgs().api_keys == {"k1": "acme"}
    with pytest.raises(ValidationError):
        AppArgs(api_keys=["k1"])
    with pytest.raises(ValidationError):
        AppArgs(api_keys={"k1": ""})


# ---- the namespace a request runs in ---------------------------------------------------------


def _request(headers: dict[str, str], owned: str | None = None) -> Request:
    from cluster.serving import access

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()], "state": {}}
    if owned is not None:
        scope["state"][access.NAMESPACE_KEY] = owned
    return Request(scope)


def test_without_keys_only_the_default_namespace_is_served():
    from cluster.serving.ingress import ApiError, _namespace

    assert _namespace(_request({})) == "default"
    assert _namespace(_request({"x-raykv-namespace": "default"})) == "default"
    for foreign in ("tenant-b", "acme", "Default"):
        with pytest.raises(ApiError) as refused:
            _namespace(_request({"x-raykv-namespace": foreign}))
        assert refused.value.status == 403
        assert refused.value.body["error"]["code"] == "namespace_forbidden"


def test_with_keys_the_keys_namespace_is_served():
    from cluster.serving.ingress import ApiError, _namespace

    assert _namespace(_request({}, owned="tenant-b")) == "tenant-b"
    assert _namespace(_request({"x-raykv-namespace": "tenant-b"}, owned="tenant-b")) == \
        "tenant-b"
    with pytest.raises(ApiError) as refused:
        _namespace(_request({"x-raykv-namespace": "default"}, owned="tenant-b"))
    assert refused.value.status == 403


# ---- raykv serve --host --------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["raykv", "vllm"])
def test_raykv_serve_on_a_non_loopback_host_without_keys_refuses_before_starting(
        engine, monkeypatch):
    """Refused with a message naming the fix, before Ray starts (ray.init raises here)."""
    from cluster.tools.cli import app

    monkeypatch.delenv("RAYKV_API_KEYS", raising=False)
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--engine", engine])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "0.0.0.0" in text
    assert "RAYKV_API_KEYS" in text
