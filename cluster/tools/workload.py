"""Chat workloads for the demo and `raykv bench serve`, and their replay over HTTP.

A trace is a list of sessions. Each session belongs to a tenant, whose system prompt all its
sessions share; tenants are drawn with a skewed (Zipf) popularity; each session has several
turns, and every turn's prompt carries the whole conversation so far (system prompt, earlier
user messages, and the replies the server actually gave).

The replay runs sessions on a few client threads (a session's turns in order), streaming each
answer over SSE from the OpenAI-compatible endpoint, and records per request: time to first
token, total time, prompt and cached tokens, and which replica answered.
"""

from __future__ import annotations

import json
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import requests


@dataclass(frozen=True, slots=True)
class TraceShape:
    num_tenants: int = 6
    num_sessions: int = 30
    turns_per_session: int = 3
    system_chars: int = 1200
    user_chars: int = 120
    max_tokens: int = 12
    zipf_s: float = 1.2
    stream_fraction: float = 1.0
    seed: int = 0


@dataclass(slots=True)
class Session:
    tenant: int
    system: str
    users: list[str]
    stream: bool
    max_tokens: int
    namespace: str = "default"


@dataclass(slots=True)
class Record:
    tenant: int
    session: int
    turn: int
    status: int
    ttft_s: float = 0.0
    total_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    replica: str = ""
    text: str = ""
    error: str = ""


def _words(rng: random.Random, num_chars: int, vocabulary: list[str]) -> str:
    out, size = [], 0
    while size < num_chars:
        word = rng.choice(vocabulary)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:num_chars]


def make_trace(shape: TraceShape, namespaces: tuple[str, ...] = ("default",)) -> list[Session]:
    """Sessions in arrival order; tenant t uses namespaces[t % len(namespaces)]."""
    rng = random.Random(shape.seed)
    vocabulary = [f"{rng.choice('bcdfgklmnprstvz')}{rng.choice('aeiou')}"
                  f"{rng.choice('lmnrst')}{rng.choice('aeiouy')}" for _ in range(400)]
    systems = [f"Tenant {t} assistant. " + _words(rng, shape.system_chars, vocabulary)
               for t in range(shape.num_tenants)]
    weights = [1 / (rank + 1) ** shape.zipf_s for rank in range(shape.num_tenants)]
    sessions = []
    for _ in range(shape.num_sessions):
        tenant = rng.choices(range(shape.num_tenants), weights)[0]
        users = [_words(rng, shape.user_chars, vocabulary) + "?"
                 for _ in range(shape.turns_per_session)]
        sessions.append(Session(tenant, systems[tenant], users,
                                rng.random() < shape.stream_fraction, shape.max_tokens,
                                namespaces[tenant % len(namespaces)]))
    return sessions


@dataclass(slots=True)
class Replay:
    """Replays a trace against `url` with `concurrency` client threads."""

    url: str
    model: str
    concurrency: int = 4
    prefix: Callable[[int, int], str] | None = None  # (session, turn) -> text put first
    timeout_s: float = 120.0
    records: list[Record] = field(default_factory=list)
    bearer_keys: dict[str, str] = field(default_factory=dict)  # namespace -> its API key

    def run(self, sessions: list[Session], on_record=None) -> list[Record]:
        work: queue.Queue = queue.Queue()
        for index, session in enumerate(sessions):
            work.put((index, session))
        lock = threading.Lock()

        def worker() -> None:
            http = requests.Session()
            while True:
                try:
                    index, session = work.get_nowait()
                except queue.Empty:
                    return
                for record in self._session(http, index, session):
                    with lock:
                        self.records.append(record)
                    if on_record is not None:
                        on_record(record)

        threads = [threading.Thread(target=worker) for _ in range(self.concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return self.records

    def _session(self, http: requests.Session, index: int, session: Session):
        messages = [{"role": "system", "content": session.system}]
        for turn, user in enumerate(session.users):
            messages.append({"role": "user", "content": user})
            sent = messages
            if self.prefix is not None:  # e.g. a unique first line: nothing is cached
                head = {"role": "system", "content": self.prefix(index, turn) + session.system}
                sent = [head, *messages[1:]]
            record = self.chat(http, sent, session)
            record.session, record.turn = index, turn
            yield record
            messages.append({"role": "assistant", "content": record.text})

    def chat(self, http: requests.Session, messages: list[dict], session: Session) -> Record:
        body = {"model": self.model, "messages": messages, "max_tokens": session.max_tokens,
                "stream": session.stream, "stream_options": {"include_usage": True}}
        headers = {"x-raykv-namespace": session.namespace}
        if session.namespace in self.bearer_keys:
            headers["authorization"] = f"Bearer {self.bearer_keys[session.namespace]}"
        record = Record(session.tenant, 0, 0, 0)
        start_s = time.perf_counter()
        try:
            with http.post(f"{self.url}/v1/chat/completions", json=body, headers=headers,
                           stream=session.stream, timeout=self.timeout_s) as reply:
                record.status = reply.status_code
                record.replica = reply.headers.get("x-raykv-replica", "")
                if reply.status_code != 200:
                    record.error = reply.text[:200]
                elif session.stream:
                    self._read_stream(reply, record, start_s)
                else:
                    self._read_whole(reply.json(), record, start_s)
        except requests.RequestException as error:
            record.error = str(error)[:200]
        record.total_s = time.perf_counter() - start_s
        return record

    @staticmethod
    def _read_stream(reply, record: Record, start_s: float) -> None:
        parts = []
        for line in reply.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                content = choice.get("delta", {}).get("content")
                if content:
                    if not parts:
                        record.ttft_s = time.perf_counter() - start_s
                    parts.append(content)
            if event.get("usage"):
                _usage_into(event["usage"], record)
        record.text = "".join(parts)
        if not record.ttft_s:
            record.ttft_s = time.perf_counter() - start_s

    @staticmethod
    def _read_whole(body: dict, record: Record, start_s: float) -> None:
        record.ttft_s = time.perf_counter() - start_s  # no stream: the first token is the last
        record.text = body["choices"][0]["message"]["content"]
        _usage_into(body["usage"], record)


def _usage_into(use: dict, record: Record) -> None:
    record.prompt_tokens = use["prompt_tokens"]
    record.completion_tokens = use["completion_tokens"]
    record.cached_tokens = (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def summarize(records: list[Record]) -> dict:
    """TTFT percentiles (ms), cached-token ratio, errors and each replica's share."""
    import numpy as np

    ok = [r for r in records if r.status == 200]
    ttft_ms = np.array([r.ttft_s * 1e3 for r in ok]) if ok else np.zeros(1)
    shares: dict[str, int] = {}
    for record in ok:
        shares[record.replica] = shares.get(record.replica, 0) + 1
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {"requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
            "ttft_p50_ms": float(np.percentile(ttft_ms, 50)),
            "ttft_p90_ms": float(np.percentile(ttft_ms, 90)),
            "ttft_p99_ms": float(np.percentile(ttft_ms, 99)),
            "cached_tokens": sum(r.cached_tokens for r in ok), "prompt_tokens": prompt_tokens,
            "cached_ratio": sum(r.cached_tokens for r in ok) / max(1, prompt_tokens),
            "replica_shares": {k: v / max(1, len(ok)) for k, v in sorted(shares.items())}}
