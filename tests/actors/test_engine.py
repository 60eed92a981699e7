"""The engine on a local Ray with raykv: the cached prefix is fetched and only the rest is
prefilled; greedy output with the cache (host or disk, raw pages) equals greedy output without
it; sampling parameters, stop strings and max_tokens are honoured."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster import ModelSpec, connect
from cluster.serving import tokenizer
from cluster.serving.engine import Engine, EngineConfig, GenerationRequest
from cluster.serving.sampling import SamplingParams
from cluster.slabs import HINT_TTL_S
from tests.kv import kv_for

TINY = ModelSpec.preset("tiny-llama")
PROMPT = "The system prompt that every user of this tenant shares. " * 4


def generate(engine: Engine, prompt: str, **params) -> tuple[str, list]:
    async def run():
        chunks = [c async for c in engine.generate(
            GenerationRequest(prompt, tokenizer.encode(prompt), SamplingParams(**params)))]
        await engine.drain()
        return "".join(c.text for c in chunks), chunks

    return asyncio.run(run())


@pytest.fixture(scope="module")
def engine(service):
    service(device_bytes=0, host_bytes=32 * 8192, disk_codec="none")
    return Engine(EngineConfig("tiny-llama", max_context_tokens=1024), {"default": connect(TINY)})


def test_the_second_request_prefills_only_past_the_cached_prefix(engine):
    text, chunks = generate(engine, PROMPT, max_tokens=8)
    head, last = chunks[0], chunks[-1]
    prompt_tokens = len(tokenizer.encode(PROMPT))
    assert head.text == "" and head.cached_tokens == 0 and head.prompt_tokens == prompt_tokens
    assert last.finish_reason in ("length", "stop") and last.completion_tokens <= 8
    again, chunks = generate(engine, PROMPT, max_tokens=8)
    cached = (prompt_tokens - 1) // 16 * 16
    assert chunks[0].cached_tokens == cached > 0
    assert again == text  # greedy: the cache changes nothing but the time


def test_greedy_output_from_disk_pages_equals_a_full_recompute(engine):
    prompt = "A different prompt, long enough for several pages of KV. " * 3
    reference, _ = generate(engine, prompt, max_tokens=12)
    client = engine.clients["default"]
    for i in range(40):  # push the prompt's pages down to disk (host holds 32 pages)
        client.put(list(range(10_000 + i * 16, 10_016 + i * 16)), kv_for(TINY, 16, i))
    stats = client.stats()["node"]
    assert stats["pages"]["disk"] > 0
    cached_text, chunks = generate(engine, prompt, max_tokens=12)
    assert chunks[0].cached_tokens > 0
    assert cached_text == reference


def test_max_tokens_stop_and_seed(engine):
    text, chunks = generate(engine, "count: ", max_tokens=5)
    assert chunks[-1].completion_tokens <= 5 and len(text) <= 5
    seeded = [generate(engine, "x", max_tokens=6, temperature=1.0, seed=3)[0] for _ in range(2)]
    assert seeded[0] == seeded[1]
    free = {generate(engine, "x", max_tokens=6, temperature=1.5)[0] for _ in range(4)}
    assert len(free) > 1
    full, _ = generate(engine, "stop test", max_tokens=12)
    if len(full) >= 4:
        cut, chunks = generate(engine, "stop test", max_tokens=12, stop=[full[2:4]])
        assert cut == full[:2] and chunks[-1].finish_reason == "stop"


def test_a_dead_cache_is_a_full_prefill_not_an_error(engine, service):
    client = engine.clients["default"]
    reference, _ = generate(engine, PROMPT, max_tokens=6)
    client.local.kill()
    time.sleep(HINT_TTL_S)  # pages this client noted stay readable from its mapping until then
    text, chunks = generate(engine, PROMPT, max_tokens=6)
    assert chunks[0].cached_tokens == 0 and text == reference
    service()  # back to a working service for later modules
