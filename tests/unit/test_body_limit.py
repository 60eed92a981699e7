"""The front door's body limit (cluster/serving/access.py, pass_capped): a declared length
over the limit is refused unread; a length is trusted only when no Transfer-Encoding decides
the body instead (RFC 9112, 6.3), so `Content-Length: 10` beside a chunked body of 2 MiB is a
413, not 2 MiB handed to the app. Raw ASGI here: the HTTP server's own parser is not the
limit (uvicorn on h11 let that request through, httptools refused it)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.serving.access import pass_capped

LIMIT = 4096


def call(headers: dict[str, str], chunks: list[bytes]) -> tuple[int | None, bytes | None, int]:
    """(status sent, body the app got, receive() calls) for a request of `chunks`."""
    messages = [{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
                for i, chunk in enumerate(chunks)]
    received, sent, got = [0], [], []

    async def receive():
        received[0] += 1
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        got.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})

    asyncio.run(pass_capped(app, {"type": "http"}, receive, send, LIMIT, headers))
    return sent[0]["status"] if sent else None, (got or [None])[0], received[0]


def test_a_declared_length_over_the_limit_is_refused_unread():
    assert call({"content-length": str(LIMIT + 1)}, [b"x" * (LIMIT + 1)]) == (413, None, 0)


def test_a_declared_length_within_the_limit_passes_untouched():
    status, body, _ = call({"content-length": "5"}, [b"hello"])
    assert (status, body) == (200, b"hello")


@pytest.mark.parametrize("declared", [None, "10"])
def test_a_chunked_body_is_counted_whatever_length_it_declares(declared):
    headers = {"transfer-encoding": "chunked"}
    if declared:
        headers["content-length"] = declared
    status, body, received = call(headers, [b"x" * 1024] * 8)
    assert status == 413 and body is None and received == 5  # stopped once over the limit


def test_a_chunked_body_within_the_limit_reaches_the_app_whole():
    status, body, _ = call({"transfer-encoding": "chunked", "content-length": "10"},
                           [b"ab", b"cd", b""])
    assert (status, body) == (200, b"abcd")
