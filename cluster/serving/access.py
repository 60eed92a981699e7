"""The ingress's front door, before any body is parsed: a bound on the request's size, and,
when API keys are configured, a bearer token that names the caller's namespace.

    Authorization: Bearer <key>   ->  the request runs in the namespace that key belongs to;
                                      an x-raykv-namespace header naming another is a 403
    a body over max_request_bytes ->  413: a declared Content-Length is checked before any
                                      of the body is read; a chunked body is read (at most
                                      the limit) before the app sees it

A pure ASGI middleware: nothing past the limit is ever buffered.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field

from cluster.serving import protocol

NAMESPACE_KEY = "raykv_namespace"  # in the ASGI scope's state: who the key belongs to


@dataclass(frozen=True, slots=True)
class Access:
    """api_keys: key -> namespace ({} : no key needed); max_request_bytes: a body's limit."""

    api_keys: dict[str, str] = field(default_factory=dict)
    max_request_bytes: int = 1 << 20

    def namespace_of(self, authorization: str | None) -> str | None:
        """The key's namespace, or None for a missing or wrong key (compared in constant time)."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            return None
        for known, namespace in self.api_keys.items():
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                return namespace
        return None


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
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        if self.access.api_keys:
            namespace = self.access.namespace_of(headers.get("authorization"))
            if namespace is None:
                return await _reply(send, 401, "Incorrect API key provided: pass "
                                    "'Authorization: Bearer <key>'.", "invalid_request_error",
                                    "invalid_api_key")
            scope.setdefault("state", {})[NAMESPACE_KEY] = namespace
        limit = self.access.max_request_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit():
            if int(declared) > limit:
                return await _too_large(send, limit)
            return await self.app(scope, receive, send)
        # No (or an odd) length: take the body in first, at most `limit` bytes, then replay it.
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await _too_large(send, limit)
        await self.app(scope, _replay([{"type": "http.request", "body": body,
                                         "more_body": False}], receive), send)


def _replay(messages: list, then=None):
    async def receive():
        if messages:
            return messages.pop(0)
        return await then() if then is not None else {"type": "http.disconnect"}

    return receive


async def _too_large(send, limit: int) -> None:
    await _reply(send, 413, f"The request body is over the limit of {limit} bytes.",
                 "invalid_request_error", "request_too_large")


async def _reply(send, status: int, message: str, kind: str, code: str) -> None:
    body = json.dumps(protocol.error_body(message, kind, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
