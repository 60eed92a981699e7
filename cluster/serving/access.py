"""The ingress's front door, before any body is parsed: a bound on the request's size, and
API keys, each naming the namespace its caller may use.

    Authorization: Bearer <key>   ->  the request runs in the namespace that key belongs to;
                                      an x-raykv-namespace header naming another is a 403
    a body over max_request_bytes ->  413: a declared Content-Length is checked before any
                                      of the body is read; a chunked body (or one that names
                                      a Transfer-Encoding beside its length) is read, at most
                                      the limit, before the app sees it

The operator's admin endpoints (ADMIN_PREFIX: pin, unpin, warm) answer only to the admin key
(RAYKV_ADMIN_KEY or the app's admin_key), never to a tenant's: 401 without a key, 403 with
any other key, and 404 when no admin key is configured (they are never open).

Without keys, nothing tells callers apart: the app then serves the "default" namespace only
(a header naming another is a 403, never trusted), and refuses to start where that would
expose anything (`require_keys_for_namespaces`, `require_keys_for_bind`): when namespaces other
than "default" are in use, or when HTTP binds anything but a loopback address.

Keys are kept as blake3 digests: the app's arguments, which Serve checkpoints in the GCS (and
so in its Redis), never hold a usable key.

A pure ASGI middleware: nothing past the limit is ever buffered.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import blake3

from cluster.serving import protocol

NAMESPACE_KEY = "raykv_namespace"  # in the ASGI scope's state: who the key belongs to
ADMIN_PASSED_KEY = "raykv_admin"  # in the ASGI scope's state: the admin gate let it through
DEFAULT_NAMESPACE = "default"  # the one namespace served without keys
ENV_VAR = "RAYKV_API_KEYS"
ADMIN_ENV_VAR = "RAYKV_ADMIN_KEY"
ADMIN_PREFIX = "/v1/raykv/admin/"
KEYS_HOWTO = (f"Set API keys: {ENV_VAR}='{{\"<key>\": \"<namespace>\", ...}}' in the Ray nodes' "
              f"environment (on Kubernetes: env {ENV_VAR} from a Secret, as manifests/kuberay "
              f"does; see manifests/README.md), or the app's api_keys argument. Without keys "
              f"raykv serves only the '{DEFAULT_NAMESPACE}' namespace, on a loopback address "
              f"(127.0.0.1).")


class KeysRequired(ValueError):
    """Serving without API keys would let callers reach what is not theirs."""


def key_digest(key: str) -> bytes:
    """What is kept of an API key (32 bytes of blake3 in its own context)."""
    return blake3.blake3(key.encode(), derive_key_context="raykv api key v1").digest()


def admin_key_from_env() -> str | None:
    """RAYKV_ADMIN_KEY, or None when unset or blank (the admin endpoints are then off)."""
    return os.environ.get(ADMIN_ENV_VAR, "").strip() or None


def _bearer(authorization: str | None) -> str | None:
    scheme, _, key = (authorization or "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def api_keys_from_env() -> dict[str, str]:
    """RAYKV_API_KEYS (a JSON object: key -> namespace), {} when unset; ValueError when it is
    not such an object."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return {}
    try:
        keys = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(f"{ENV_VAR} is not JSON ({error.msg}); it must be an object of API "
                         f"key to namespace, e.g. '{{\"<key>\": \"default\"}}'") from None
    return check_api_keys(keys, ENV_VAR)


def check_api_keys(keys, where: str = "api_keys") -> dict[str, str]:
    """keys as a dict of non-empty key -> non-empty namespace; ValueError naming `where`."""
    if not isinstance(keys, dict):
        raise ValueError(f"{where} must be an object of API key to namespace, "
                         f"got {type(keys).__name__}")
    for key, namespace in keys.items():
        if not isinstance(key, str) or not key.strip() or key != key.strip():
            raise ValueError(f"{where}: an API key must be a non-empty string without "
                             f"surrounding spaces")
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"{where}: the namespace of each key must be a non-empty string")
    return dict(keys)


def is_loopback(host: str | None) -> bool:
    """Whether binding `host` accepts connections from this machine only. Anything else, an
    unknown host (None) included, counts as reachable from elsewhere."""
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another host name: it may resolve anywhere
        return False


@dataclass(frozen=True, slots=True)
class Access:
    """key_digests: key_digest(key) -> namespace ({}: no key needed, and only the default
    namespace served); max_request_bytes: a body's limit; admin_digest: the admin key's
    digest (None: the admin endpoints are off)."""

    key_digests: dict[bytes, str] = field(default_factory=dict)
    max_request_bytes: int = 1 << 20
    admin_digest: bytes | None = None

    @classmethod
    def of(cls, api_keys: dict[str, str], max_request_bytes: int = 1 << 20,
           admin_key: str | None = None) -> Access:
        """From plain keys (key -> namespace, and the admin key); only digests are kept.
        ValueError for an admin key that is also a tenant's key."""
        digests = {key_digest(key): namespace for key, namespace in api_keys.items()}
        admin = key_digest(admin_key) if admin_key else None
        if admin is not None and admin in digests:
            raise ValueError("the admin key must differ from every tenant's API key")
        return cls(digests, max_request_bytes, admin)

    def is_admin(self, authorization: str | None) -> bool:
        """Whether the header carries the admin key (compared in constant time)."""
        key = _bearer(authorization)
        if self.admin_digest is None or key is None:
            return False
        return hmac.compare_digest(self.admin_digest, key_digest(key))

    @property
    def keyed(self) -> bool:
        return bool(self.key_digests)

    def namespace_of(self, authorization: str | None) -> str | None:
        """The key's namespace, or None for a missing or wrong key (compared in constant time)."""
        key = _bearer(authorization)
        if key is None:
            return None
        presented = key_digest(key)
        for known, namespace in self.key_digests.items():
            if hmac.compare_digest(known, presented):
                return namespace
        return None


def require_keys_for_namespaces(access: Access, namespaces: Iterable[str]) -> None:
    """KeysRequired when there are no keys and namespaces other than the default are in use:
    keyless, any caller could name any of them (read their prefixes' cached_tokens, spend
    their rate limits)."""
    others = sorted(set(namespaces) - {DEFAULT_NAMESPACE})
    if others and not access.keyed:
        raise KeysRequired(f"raykv's Serve app refuses to start without API keys: namespaces "
                           f"other than '{DEFAULT_NAMESPACE}' are in use ({', '.join(others)}), "
                           f"and without keys any caller could use any of them. {KEYS_HOWTO}")


def require_keys_for_bind(access: Access, bind_host: str | None) -> None:
    """KeysRequired when there are no keys and HTTP binds a non-loopback (or unknown) host."""
    if access.keyed or is_loopback(bind_host):
        return
    where = f"{bind_host!r}" if bind_host else "an address that could not be checked"
    raise KeysRequired(f"raykv's Serve app refuses to start without API keys: its HTTP binds "
                       f"{where}, not a loopback address, so any host that reaches it could "
                       f"call it. {KEYS_HOWTO}")


# The refusal of a request without a known key: (status, message, kind, code).
NO_KEY = (401, "Incorrect API key provided: pass 'Authorization: Bearer <key>'.",
          "invalid_request_error", "invalid_api_key")
# The vLLM app's default body limit (VllmAppArgs.max_request_bytes): long prompts, images.
VLLM_MAX_REQUEST_BYTES = 32 << 20


# One ingress per replica process: its settings, set when it starts (the middleware is built
# by Starlette on the first request, not by the ingress).
CURRENT: list[Access] = [Access()]


class AccessMiddleware:
    """ASGI middleware enforcing the process's `Access` (CURRENT)."""

    def __init__(self, app):
        self.app = app

    @property
    def access(self) -> Access:
        return CURRENT[0]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope_headers(scope)
        if route_path(scope).startswith(ADMIN_PREFIX):
            refusal = admin_refusal(self.access, headers.get("authorization"))
            if refusal is not None:
                return await reply_error(send, *refusal)
            scope.setdefault("state", {})[ADMIN_PASSED_KEY] = True
        elif self.access.keyed:
            namespace = self.access.namespace_of(headers.get("authorization"))
            if namespace is None:
                return await reply_error(send, *NO_KEY)
            scope.setdefault("state", {})[NAMESPACE_KEY] = namespace
        await pass_capped(self.app, scope, receive, send, self.access.max_request_bytes,
                          headers)


async def pass_capped(app, scope, receive, send, limit: int, headers: dict[str, str]) -> None:
    """Call `app` with the request's body, or answer 413 once it is over `limit` bytes.

    A declared Content-Length over the limit is refused before any of the body is read; one
    within it is trusted (the HTTP server reads no more than it declares), unless the request
    also names a Transfer-Encoding, which then decides the body's length (RFC 9112, 6.3):
    such a body, or one with no length, is taken in first, at most `limit` bytes, and
    replayed to the app."""
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return await reply_too_large(send, limit)
    if declared.isdigit() and "transfer-encoding" not in headers:
        return await app(scope, receive, send)
    body, more = b"", True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return await app(scope, replay([message]), send)
        body += message.get("body", b"")
        more = message.get("more_body", False)
        if len(body) > limit:
            return await reply_too_large(send, limit)
    await app(scope, replay([{"type": "http.request", "body": body, "more_body": False}],
                             receive), send)


def namespace_refusal(access: Access, namespace: str, authorization: str | None
                      ) -> tuple[int, str, str, str] | None:
    """Why a request to an app that serves one `namespace` is refused, as (status, message,
    kind, code): 401 without a known key, 403 with another namespace's; None: it may go on
    (or the app is keyless)."""
    if not access.keyed:
        return None
    owner = access.namespace_of(authorization)
    if owner is None:
        return NO_KEY
    if owner != namespace:
        return (403, f"this key is for namespace {owner!r}; this app serves {namespace!r}",
                "permission_error", "namespace_forbidden")
    return None


def scope_headers(scope) -> dict[str, str]:
    """An ASGI request's headers, names lower-cased. latin-1, as HTTP/1.1 allows any octet
    in a field value: a stray byte is no 500."""
    return {k.decode("latin-1").lower(): v.decode("latin-1")
            for k, v in scope.get("headers", [])}


def route_path(scope) -> str:
    """The path the app routes on. Serve mounts an app under its route_prefix by moving the
    prefix into root_path and keeping it in path (as ASGI says); Starlette routes on path less
    root_path. A gate on the raw path would miss `/prefix/v1/raykv/admin/pin`."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):]
    return path


def admin_passed(scope) -> bool:
    """Whether the admin gate let this request through: the admin handlers ask it too, so an
    admin route that the gate's path test missed still refuses."""
    return scope.get("state", {}).get(ADMIN_PASSED_KEY) is True


def admin_refusal(access: Access, authorization: str | None) -> tuple | None:
    """Why an admin request is refused, as (status, message, kind, code); None: it is the
    admin's. No admin key configured: 404, as if the endpoints did not exist."""
    if access.admin_digest is None:
        return (404, f"Not found: the admin endpoints are off (set {ADMIN_ENV_VAR}).",
                "not_found_error", "not_found")
    if _bearer(authorization) is None:
        return (401, "The admin endpoints need 'Authorization: Bearer <admin key>'.",
                "invalid_request_error", "invalid_api_key")
    if not access.is_admin(authorization):
        return (403, "This key may not use the admin endpoints.", "permission_error",
                "admin_only")
    return None


def replay(messages: list, then=None):
    """An ASGI receive that gives `messages`, then asks `then` (None: a disconnect)."""

    async def receive():
        if messages:
            return messages.pop(0)
        return await then() if then is not None else {"type": "http.disconnect"}

    return receive


async def reply_too_large(send, limit: int) -> None:
    """The 413 for a body over `limit` bytes (also a direct-streaming replica's)."""
    await reply_error(send, 413, f"The request body is over the limit of {limit} bytes.",
                 "invalid_request_error", "request_too_large")


async def reply_error(send, status: int, message: str, kind: str, code: str) -> None:
    body = json.dumps(protocol.error_body(message, kind, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
