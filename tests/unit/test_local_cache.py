"""A replica's own prefix cache (the baseline of `raykv bench serve`): the calls the engine
makes on a raykv client, and the engine on it reporting local hits as cached tokens. No Ray."""

import asyncio

import pytest
import torch

from cluster.core.spec import ModelSpec
from cluster.serving import tokenizer
from cluster.serving.engine import Engine, EngineConfig, GenerationRequest
from cluster.serving.local_cache import LocalCacheSettings, LocalPrefixCache
from cluster.serving.sampling import SamplingParams
from tests.kv import kv_for

TINY = ModelSpec.preset("tiny-llama")
PAGE_BYTES = TINY.page_bytes(16)


def cache(num_pages: int) -> LocalPrefixCache:
    return LocalPrefixCache(TINY, LocalCacheSettings(16, num_pages * PAGE_BYTES))


def test_put_then_get_returns_the_full_pages_into_out():
    client = cache(8).client("default")
    tokens, kv = list(range(40)), kv_for(TINY, 40)
    assert client.put(tokens, kv) == 32
    out = torch.zeros(TINY.page_shape(48), dtype=TINY.torch_dtype())
    num_tokens, got = client.get(tokens + [7] * 8, out=out)
    assert num_tokens == 32 and got.data_ptr() == out.data_ptr()
    assert torch.equal(got, kv[:, :, :, :32])
    assert torch.equal(client.get(tokens)[1], kv[:, :, :, :32])
    assert client.get([9] + tokens) == (0, None)
    assert client.counters["get_tokens"] == 64 and client.counters["put_tokens"] == 32


def test_namespaces_share_the_budget_but_never_a_page():
    shared = cache(3)
    a, b = shared.client("a"), shared.client("b")
    a.put(list(range(32)), kv_for(TINY, 32))
    assert b.get(list(range(32))) == (0, None)
    b.put(list(range(32)), kv_for(TINY, 32, seed=1))  # 2 pages of 3: a loses its tail
    assert a.get(list(range(32)))[0] == 16
    assert shared.stats()["evicted_pages"] == 1 and shared.stats()["held_bytes"] == 3 * PAGE_BYTES


def test_a_stored_page_is_a_copy_and_bad_kv_is_refused():
    client = cache(4).client("default")
    kv = kv_for(TINY, 16)
    client.put(list(range(16)), kv)
    kv.zero_()
    assert client.get(list(range(16)))[1].abs().sum() > 0
    with pytest.raises(ValueError, match="tokens"):
        client.put(list(range(20)), kv_for(TINY, 16))


def generate(engine: Engine, prompt: str) -> tuple[str, int]:
    async def run():
        request = GenerationRequest(prompt, tokenizer.encode(prompt), SamplingParams(max_tokens=6))
        chunks = [c async for c in engine.generate(request)]
        await engine.drain()
        return "".join(c.text for c in chunks), chunks[0].cached_tokens

    return asyncio.run(run())


def test_the_engine_on_its_own_cache_reports_local_hits_as_cached_tokens():
    own = cache(64)
    engine = Engine(EngineConfig("tiny-llama", max_context_tokens=512),
                    {"default": own.client("default")})
    prompt = "The system prompt that every user of this tenant shares. " * 3
    text, cached = generate(engine, prompt)
    assert cached == 0
    again, cached = generate(engine, prompt)
    assert cached == (len(tokenizer.encode(prompt)) - 1) // 16 * 16 > 0
    assert again == text  # greedy: the cache changes nothing but the time
    assert engine.counters["cached_tokens"] == cached


def test_the_engine_honours_the_routers_cut_and_measures_its_rates():
    own = cache(64)
    engine = Engine(EngineConfig("tiny-llama", max_context_tokens=512),
                    {"default": own.client("default")})
    prompt = "The system prompt that every user of this tenant shares. " * 3
    generate(engine, prompt)

    async def cut(max_fetch_tokens: int) -> int:
        request = GenerationRequest(prompt, tokenizer.encode(prompt), SamplingParams(max_tokens=2),
                                    max_fetch_tokens=max_fetch_tokens)
        return [c async for c in engine.generate(request)][0].cached_tokens

    assert asyncio.run(cut(0)) == 0  # told to recompute: nothing fetched
    assert asyncio.run(cut(40)) == 32  # whole pages, no more than the cut
    shown = engine.meter.published()
    assert shown["prefill_samples"] == 3 and shown["prefill_tokens_per_s"] > 0
    assert shown["page_tokens"] == 16 and shown["page_bytes"] == 16 * engine.spec.bytes_per_token
    assert shown["busy_s_per_request"] > 0
    assert shown["paths"] == {}  # the local cache's client times no reads


def test_the_app_takes_local_caches_only_with_a_router_that_needs_no_raykv():
    from pydantic import ValidationError

    from cluster.serving.app import AppArgs

    args = AppArgs(router="prefix", local_cache={"page_tokens": 64, "capacity_bytes": 1 << 20})
    assert args.local_cache.settings() == LocalCacheSettings(64, 1 << 20)
    with pytest.raises(ValidationError, match="with local_cache choose"):
        AppArgs(router="raykv", local_cache={})


def test_the_engine_stores_exact_kv_copied_on_its_compute_thread(monkeypatch):
    """The KV the engine stores is what a fresh prefill of those tokens computes, and its copy
    out of the cache runs on the compute thread (engine.py: another thread's torch work slows
    the next prefill), not on the event loop, even as decode steps grow the cache."""
    import threading

    from cluster.serving import engine as engine_module
    from cluster.serving.model import kv_from_cache, prefill_from

    threads, stacked = [], engine_module.stack_views

    def recording(views):
        threads.append(threading.current_thread().name)
        return stacked(views)

    monkeypatch.setattr(engine_module, "stack_views", recording)
    own = cache(64)
    engine = Engine(EngineConfig("tiny-llama", max_context_tokens=512),
                    {"default": own.client("default")})
    prompt = "Pages stored while the answer is decoded. " * 2  # 87 tokens: 5 full pages
    text, _ = generate(engine, prompt)
    assert threads and all(name.startswith("raykv-compute") for name in threads)
    tokens = tokenizer.encode(prompt) + tokenizer.encode(text)[1:]  # the output, no BOS
    full = len(tokens) // 16 * 16
    expected = kv_from_cache(prefill_from(engine.model, None, tokens[:full])[1])
    num_tokens, got = own.client("default").get(tokens[:full])
    assert num_tokens == full and torch.allclose(got, expected, atol=1e-5)


def test_a_response_ends_with_its_prompt_stored_and_the_copy_runs_before_decoding(monkeypatch):
    """Read-your-writes for a client's next request: once the last chunk is out, the prompt's
    pages are in the cache, without waiting for the engine's background work (the cluster's
    test_serving asks again at once). And the KV's copy is queued on the compute thread as the
    prefill ends, before this request's decode steps, not behind them."""
    from cluster.serving import engine as engine_module

    calls, stacked, step = [], engine_module.stack_views, engine_module.decode_step

    def recording_stack(views):
        calls.append("stack")
        return stacked(views)

    def recording_step(*args):
        calls.append("step")
        return step(*args)

    monkeypatch.setattr(engine_module, "stack_views", recording_stack)
    monkeypatch.setattr(engine_module, "decode_step", recording_step)
    own = cache(64)
    engine = Engine(EngineConfig("tiny-llama", max_context_tokens=512),
                    {"default": own.client("default")})
    prompt = "A prompt that the next turn of this chat starts with. " * 3
    tokens = tokenizer.encode(prompt)

    async def run() -> int:
        request = GenerationRequest(prompt, tokens, SamplingParams(max_tokens=4))
        async for _ in engine.generate(request):
            pass
        return own.client("default").get(tokens)[0]  # no drain: what the next request sees

    assert asyncio.run(run()) == len(tokens) // 16 * 16 > 0
    assert calls[:2] == ["stack", "step"]
