"""The admin endpoints' front door, without Ray: only the admin key passes (401 without a
key, 403 with a tenant's), they are off (404) without an admin key, the admin key is no
tenant key, and only digests are kept. The admin bodies name a prompt one way."""

from __future__ import annotations

import pickle

import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from cluster.core.pins import PinRefused
from cluster.serving import access, admin, tokenizer
from cluster.serving.access import Access, AccessMiddleware, admin_key_from_env

ADMIN = "admin-s3cret"
TENANT = "tenant-key"


async def _ok(request):
    return JSONResponse({"namespace": request.scope.get("state", {}).get(access.NAMESPACE_KEY)})


@pytest.fixture
def client():
    """An app behind the middleware; `use(Access)` sets the process's access rules."""
    app = Starlette(routes=[Route("/v1/raykv/admin/pin", _ok, methods=["POST"]),
                            Route("/v1/completions", _ok, methods=["POST"])])
    app.add_middleware(AccessMiddleware)
    before = access.CURRENT[0]
    test_client = TestClient(app)
    test_client.use = lambda rules: access.CURRENT.__setitem__(0, rules)
    yield test_client
    access.CURRENT[0] = before


def post(client, path: str, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.post(path, headers=headers, json={})


def test_only_the_admin_key_reaches_the_admin_endpoints(client):
    client.use(Access.of({TENANT: "default"}, admin_key=ADMIN))
    assert post(client, "/v1/raykv/admin/pin").status_code == 401
    refused = post(client, "/v1/raykv/admin/pin", TENANT)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_only"
    assert post(client, "/v1/raykv/admin/pin", "guess").status_code == 403
    assert post(client, "/v1/raykv/admin/pin", ADMIN).status_code == 200
    # and the admin key is no tenant's key
    assert post(client, "/v1/completions", ADMIN).status_code == 401
    assert post(client, "/v1/completions", TENANT).json() == {"namespace": "default"}


def test_without_an_admin_key_the_admin_endpoints_are_off(client):
    for rules in (Access(), Access.of({TENANT: "default"})):
        client.use(rules)
        for key in (None, TENANT, ADMIN):
            answer = post(client, "/v1/raykv/admin/pin", key)
            assert answer.status_code == 404, (rules, key)


@pytest.mark.parametrize("rules, key, status", [
    (Access.of({TENANT: "default"}, admin_key=ADMIN), TENANT, 403),
    (Access.of({TENANT: "default"}, admin_key=ADMIN), None, 401),
    (Access.of({TENANT: "default"}, admin_key=ADMIN), ADMIN, 200),
    (Access.of({TENANT: "default"}), TENANT, 404),
    (Access(), None, 404),
])
def test_the_admin_gate_holds_under_a_route_prefix(rules, key, status):
    """Serve mounts an app under its route_prefix: path keeps the prefix, root_path names it,
    and the app routes on the rest. The gate must see `/v1/raykv/admin/...` there too."""
    app = Starlette(routes=[Route("/v1/raykv/admin/pin", _admitted, methods=["POST"])])
    app.add_middleware(AccessMiddleware)
    before, access.CURRENT[0] = access.CURRENT[0], rules
    try:
        reply = post(TestClient(app, root_path="/secure"), "/secure/v1/raykv/admin/pin", key)
        assert reply.status_code == status, reply.text
        if status == 200:
            assert reply.json() == {"admin": True}
    finally:
        access.CURRENT[0] = before


async def _admitted(request):
    return JSONResponse({"admin": access.admin_passed(request.scope)})


def test_route_path_drops_only_a_whole_root_path():
    assert access.route_path({"path": "/secure/v1/x", "root_path": "/secure"}) == "/v1/x"
    assert access.route_path({"path": "/v1/x", "root_path": ""}) == "/v1/x"
    assert access.route_path({"path": "/secured/v1/x", "root_path": "/secure"}) == \
        "/secured/v1/x"
    assert access.route_path({"path": "/v1/x"}) == "/v1/x"
    # A tenant's request never carries the gate's mark.
    assert not access.admin_passed({"state": {}}) and not access.admin_passed({})


def test_a_header_byte_outside_ascii_is_no_server_error(client):
    client.use(Access.of({TENANT: "default"}, admin_key=ADMIN))
    reply = client.post("/v1/completions", json={},
                        headers={"Authorization": f"Bearer {TENANT}",
                                 "x-note": "caf\xe9".encode("latin-1")})
    assert reply.status_code == 200
    reply = client.post("/v1/completions", json={}, headers={"Authorization": b"Bearer \xff"})
    assert reply.status_code == 401


def test_keyless_tenants_with_an_admin_key_still_need_it(client):
    client.use(Access.of({}, admin_key=ADMIN))
    assert post(client, "/v1/raykv/admin/pin").status_code == 401
    assert post(client, "/v1/raykv/admin/pin", ADMIN).status_code == 200
    assert post(client, "/v1/completions").status_code == 200


def test_the_admin_key_is_kept_as_a_digest_and_differs_from_tenants_keys(monkeypatch):
    rules = Access.of({TENANT: "default"}, admin_key=ADMIN)
    assert ADMIN.encode() not in pickle.dumps(rules)
    assert rules.is_admin(f"Bearer {ADMIN}") and not rules.is_admin(f"Bearer {TENANT}")
    assert not rules.is_admin(None) and not Access().is_admin(f"Bearer {ADMIN}")
    with pytest.raises(ValueError, match="admin key must differ"):
        Access.of({ADMIN: "default"}, admin_key=ADMIN)
    monkeypatch.setenv("RAYKV_ADMIN_KEY", "  ")
    assert admin_key_from_env() is None
    monkeypatch.setenv("RAYKV_ADMIN_KEY", ADMIN)
    assert admin_key_from_env() == ADMIN


def test_admin_bodies_name_the_prompt_one_way():
    assert admin.PromptBody(prompt="hi").token_ids() == tokenizer.encode("hi")
    chat = admin.PromptBody(messages=[{"role": "system", "content": "be brief"}])
    system = tokenizer.apply_chat_template([tokenizer.Message("system", "be brief")])
    assert chat.token_ids() == tokenizer.encode(system)
    assert admin.PinBody(tokens=[1, 2], ttl_s=5).token_ids() == [1, 2]
    for bad in ({}, {"prompt": "a", "tokens": [1]}, {"tokens": [-1]}):
        with pytest.raises(ValidationError):
            admin.PromptBody(**bad)
    with pytest.raises(ValidationError):
        admin.PinBody(prompt="a", ttl_s=0)
    assert admin.error_status(PinRefused("past its cap")) == (409, "pin_cap_exceeded")
    assert admin.error_status(ValueError("unknown node")) == (400, "invalid_request")
    assert admin.error_status(RuntimeError("no answer")) == (503, "unavailable")
