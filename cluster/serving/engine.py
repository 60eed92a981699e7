"""The engine: a real transformers model on the cache, one request at a time per call.

Per request:
    1. get the cached prefix of the prompt into a preallocated KV buffer (aget, out=)
    2. prefill only the rest of the prompt, continuing from that KV
    3. store the prompt's new full pages, off the response path
    4. decode (greedy by default), streaming text as it comes
    5. store the new full pages of prompt + output, off the response path

Model compute runs on the engine's one compute thread, so the replica's event loop keeps
serving: one model stream per replica, as an engine's step loop is, whose thread (and its torch
and OpenMP state) stays warm between requests, and whose prefills and decode steps of
concurrent requests take turns instead of fighting over the replica's cores. A cache failure
is a miss (a full prefill), never a failed request.

Every large torch operation runs on that thread, the copies of the KV to store included. Each
thread that runs a parallel torch operation gets its own OpenMP team, and one team's threads
still spin for a while after their work; on a 2-core machine a prefill that follows another
thread's torch work took 42 ms against 31 ms after its own (the tiny model, 512 tokens after
7,680 cached). So the event loop only takes views of the cache (model.prefix_views), and the
compute thread copies them out, after the first token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from cluster.serving import tokenizer
from cluster.serving.model import build_llama, decode_step, prefill_from, prefix_views, stack_views
from cluster.serving.rates import RateMeter
from cluster.serving.sampling import Sampler, SamplingParams, StopText

log = logging.getLogger("raykv.engine")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "small-llama"
    seed: int = 0
    max_context_tokens: int = 8192
    max_buffers: int = 4  # preallocated KV buffers: one per request in flight


@dataclass(slots=True)
class GenerationRequest:
    """What the ingress sends to an engine replica (and what its routers read).

    `prompt` is the text (Ray Serve LLM's prefix router matches on it); `page_keys` are the
    prompt's page keys, concatenated, computed once by the ingress (raykv's router looks
    them up in the directory).
    """

    prompt: str
    token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    namespace: str = "default"
    page_keys: bytes = b""
    request_id: str = ""
    # raykv's router's cut (policies/cost_routing.py): fetch at most this many tokens of the
    # cached prefix and recompute the rest, where fetching costs more; None: all of it.
    max_fetch_tokens: int | None = None


@dataclass(slots=True)
class Chunk:
    """One streamed piece of a generation; the last one has a finish_reason."""

    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    replica: str = ""
    fetch_s: float = 0.0
    prefill_s: float = 0.0


class BufferPool:
    """Preallocated [L, 2, H, max_context, D] KV buffers, touched once, reused."""

    def __init__(self, shape: tuple, dtype: torch.dtype, max_buffers: int):
        self.shape, self.dtype, self.max_buffers = shape, dtype, max_buffers
        self._free: list[torch.Tensor] = []

    def take(self) -> torch.Tensor:
        if self._free:
            return self._free.pop()
        buffer = torch.empty(self.shape, dtype=self.dtype)
        buffer.view(torch.uint8).numpy().fill(0)  # touched by numpy: no torch team here
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        if len(self._free) < self.max_buffers:
            self._free.append(buffer)


class Engine:
    """A random-weight Llama (a raykv preset's geometry) serving from raykv's cache."""

    def __init__(self, config: EngineConfig, clients: dict, replica: str = ""):
        self.config = config
        self.model, self.spec = build_llama(config.model, config.seed)
        self.clients = clients  # namespace -> KVClient (see cluster.serving.deployments)
        self.replica = replica
        self.mask = tokenizer.text_token_mask(self.model.config.vocab_size)
        shape = self.spec.page_shape(config.max_context_tokens)
        self.buffers = BufferPool(shape, self.spec.torch_dtype(), config.max_buffers)
        self._background: set[asyncio.Task] = set()
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raykv-compute")
        self.counters = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
                         "completion_tokens": 0, "failed_stores": 0}
        self.meter: RateMeter | None = None  # made with the first request's page size

    def warm_up(self) -> None:
        """One short prefill and decode step on the compute thread, so the first request
        does not pay for them."""
        def steps() -> None:
            logits, cache = prefill_from(self.model, None, tokenizer.encode("warm up"))
            decode_step(self.model, cache, int(logits.argmax()),
                        len(tokenizer.encode("warm up")))

        self.on_compute_thread(steps)

    def on_compute_thread(self, function, *args):
        """`function(*args)` on the compute thread, waited for: how tools that share the
        engine's model (a benchmark's reference prefill) keep its torch work on one thread."""
        return self._compute.submit(function, *args).result()

    def _computed(self, function, *args) -> asyncio.Future:
        """`function(*args)` queued on the compute thread now; await the future for its
        result (queued at the call, not at the await: see _store)."""
        return asyncio.get_running_loop().run_in_executor(self._compute, function, *args)

    async def _computed_timed(self, function, *args) -> tuple[float, object]:
        """(seconds it ran, its result): timed on the compute thread, not counting the wait
        for it (what the replica's prefill rate is made of)."""
        return await self._computed(_timed_call, function, *args)

    def _meter(self, client) -> RateMeter:
        if self.meter is None:
            page_tokens = client.page_tokens
            self.meter = RateMeter(self.replica, page_tokens, page_tokens
                                   * self.spec.bytes_per_token)
        return self.meter

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        tokens = request.token_ids
        client = self.clients[request.namespace]
        buffer = self.buffers.take()
        meter = self._meter(client)
        try:
            fetch_s, kv_prefix = await _timed(self._fetch(client, tokens, buffer,
                                                          request.max_fetch_tokens))
            cached = 0 if kv_prefix is None else kv_prefix.shape[3]
            meter.reads(client)
            prefill_s, (compute_s, (logits, cache)) = await _timed(self._computed_timed(
                prefill_from, self.model, kv_prefix, tokens))
            meter.prefilled(len(tokens) - cached, compute_s, cached)
        finally:
            self.buffers.give(buffer)
        stored = None
        if (len(tokens) // client.page_tokens) * client.page_tokens > cached:
            stored = self._store(client, tokens, cache)
        self._count(len(tokens), cached)
        head = Chunk("", len(tokens), cached, 0, None, self.replica, fetch_s, prefill_s)
        yield head  # the request's figures, before the first token
        async for chunk in self._decode(client, request, (logits, cache, compute_s), head,
                                        stored):
            yield chunk

    async def _fetch(self, client, tokens: list[int], buffer: torch.Tensor,
                     max_fetch_tokens: int | None = None):
        """The cached prefix's KV (a view of `buffer`), or None; at least one token is left
        to prefill, since its logits start the generation; no more than the router's cut."""
        usable = min(len(tokens) - 1, buffer.shape[3])
        if max_fetch_tokens is not None:
            usable = min(usable, max_fetch_tokens)
        usable = usable // client.page_tokens * client.page_tokens
        if usable <= 0:
            return None
        num_tokens, kv = await client.aget(tokens[:usable], out=buffer[:, :, :, :usable])
        return kv if num_tokens else None

    async def _decode(self, client, request: GenerationRequest, prefilled: tuple,
                      head: Chunk, stored: asyncio.Task | None) -> AsyncIterator[Chunk]:
        """`prefilled`: the prefill's (logits, cache, compute seconds); `stored`: the store of
        the prompt's pages, which the last chunk waits for (see `_settled`)."""
        logits, cache, compute_s = prefilled
        sampler = Sampler(request.params, self.mask)
        stop = StopText(request.params.stop)
        text = tokenizer.StreamDecoder()
        generated: list[int] = []
        position = len(request.token_ids)
        finish = "length"
        while len(generated) < request.params.max_tokens:
            token = sampler.next(logits)
            generated.append(token)
            if token == tokenizer.EOS_ID:
                finish = "stop"
                break
            delta = stop.push(text.push(token))
            if stop.stopped:
                finish = "stop"
                yield self._chunk(head, delta, len(generated))
                break
            if delta:
                yield self._chunk(head, delta, len(generated))
            if len(generated) < request.params.max_tokens:
                step_s, logits = await self._computed_timed(decode_step, self.model, cache,
                                                            token, position)
                compute_s += step_s
                position += 1
        tail = "" if stop.stopped else stop.push(text.flush()) + stop.finish()
        self.counters["completion_tokens"] += len(generated)
        self._meter(client).finished(compute_s)
        fed = request.token_ids + generated[: position - len(request.token_ids)]
        if len(fed) // client.page_tokens > len(request.token_ids) // client.page_tokens:
            self._store(client, fed, cache)
        await _settled(stored)
        yield self._chunk(head, tail, len(generated), finish)

    @staticmethod
    def _chunk(head: Chunk, text: str, completion_tokens: int,
               finish: str | None = None) -> Chunk:
        return Chunk(text, head.prompt_tokens, head.cached_tokens, completion_tokens, finish,
                     head.replica, head.fetch_s, head.prefill_s)

    def _store(self, client, tokens: list[int], cache) -> asyncio.Task:
        """Put the new full pages of `tokens` (whose KV `cache` holds) in the background.

        The copy of their KV runs on the compute thread, and is queued there now, so that it
        runs before this request's next decode step: queued from the task instead, it waited
        behind the decode steps, and the put began only as the response ended."""
        views = prefix_views(cache, len(tokens))  # the cache may grow meanwhile: see there
        stacked = self._computed(stack_views, views)
        task = asyncio.get_running_loop().create_task(self._put(client, tokens, stacked))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _put(self, client, tokens: list[int], stacked: asyncio.Future) -> None:
        try:
            await client.aput(tokens, await stacked)
        except Exception:  # a failed store is a future miss, never a failed request
            self.counters["failed_stores"] += 1
            log.exception("storing %d tokens failed", len(tokens))

    async def drain(self) -> None:
        """Wait for the background stores (tests, and before a benchmark's next phase)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def _count(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += prompt_tokens
        self.counters["cached_tokens"] += cached_tokens


# How long a response's last chunk waits for its prompt's pages to be stored. They are put
# while the answer decodes and are almost always in by its end; the wait makes that certain, so
# that a client's next request (a chat's next turn) finds them, as a vLLM connector's
# wait_for_save does. A put slower than this goes on in the background.
PROMPT_STORE_WAIT_S = 2.0


async def _settled(stored: asyncio.Task | None) -> None:
    """Wait (bounded, never cancelling it) for a store task; its failure is already counted."""
    if stored is not None and not stored.done():
        await asyncio.wait({stored}, timeout=PROMPT_STORE_WAIT_S)


def _timed_call(function, *args) -> tuple[float, object]:
    start_s = time.perf_counter()
    result = function(*args)
    return time.perf_counter() - start_s, result


async def _timed(awaitable):
    start_s = time.perf_counter()
    result = await awaitable
    return time.perf_counter() - start_s, result
