"""How a vLLM process reaches raykv: the connector's settings, the page geometry read from
vLLM's config, a lazy connection that treats an absent service as a miss, and the scheduler's
lookups, off its thread (no vLLM import).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass

from cluster.core import cpu_sets
from cluster.core.spec import DTYPE_BYTES, ModelSpec, canonical_dtype
from cluster.serving.step_budget import StepBudget, checked_load_mode
from policies.cost_routing import ewma

log = logging.getLogger("raykv.vllm")
RETRY_CONNECT_S = 30.0
# How long a lookup may take before raykv answers (the client's call timeout once connected;
# this while it connects): past it the request is a miss.
CONNECT_LOOKUP_TIMEOUT_S = 10.0
# vLLM's fp8 caches hold e4m3 bytes ("fp8" is e4m3), raykv's "fp8" pages too.
FP8_E4M3 = ("fp8", "fp8_e4m3")


class UnsupportedConfig(ValueError):
    """A vLLM configuration raykv cannot key or store safely: the connector turns off."""


@dataclass(frozen=True, slots=True)
class RaykvSettings:
    """kv_connector_extra_config, read once.

    raykv.namespace    the raykv namespace (tenant) of the pages; "default"
    raykv.ray_address  the Ray cluster raykv runs on; RAY_ADDRESS, else "auto". A process
                       already connected to Ray (a Ray actor) keeps its connection.
    raykv.model_name   names the model in page keys; vLLM's served model name by default.
                       Give raykv's own name (e.g. "small-llama") to share pages with it.
    raykv.pd_wait_s    P/D: how long a decode waits for its prefill's pages to reach raykv's
                       directory (asked again, never blocking vLLM's scheduler), then loads
                       what is there and recomputes the rest; 2 s
    raykv.rates_file   where the scheduler side writes the rates it measures (its loads per
                       source tier, its prefill rate: engine_rates.py) for its Serve replica
                       to publish to raykv's router; None: not written. RaykvLLMServer sets it
    raykv.load_mode    "auto": a lookup or load that the engine's measured step can afford is
                       waited for in the step, the others run off it; "async": never wait;
                       "sync": always wait (cluster/serving/step_budget.py); "auto"
    raykv.save_mode    "auto": a save is flushed (committed, the directory told), and the
                       step after it waits for that, bounded by its tokens' recompute time;
                       "sync": the saving step waits; "async": never wait (step_budget.py);
                       "auto"
    """

    namespace: str = "default"
    ray_address: str = "auto"
    model_name: str | None = None
    pd_wait_s: float = 2.0
    rates_file: str | None = None
    load_mode: str = "auto"
    save_mode: str = "auto"

    @staticmethod
    def from_extra(extra: dict | None) -> RaykvSettings:
        extra = extra or {}
        known = {"raykv.namespace", "raykv.ray_address", "raykv.model_name", "raykv.pd_wait_s",
                 "raykv.rates_file", "raykv.load_mode", "raykv.save_mode"}
        unknown = sorted(k for k in extra if k.startswith("raykv.") and k not in known)
        if unknown:
            raise ValueError(f"unknown raykv settings {unknown}; known: {sorted(known)}")
        pd_wait_s = float(extra.get("raykv.pd_wait_s", 2.0))
        if not pd_wait_s >= 0:
            raise ValueError(f"raykv.pd_wait_s must be >= 0, got {pd_wait_s}")
        load_mode = checked_load_mode(str(extra.get("raykv.load_mode", "auto")))
        save_mode = checked_load_mode(str(extra.get("raykv.save_mode", "auto")),
                                      "raykv.save_mode")
        return RaykvSettings(
            namespace=str(extra.get("raykv.namespace", "default")),
            ray_address=str(extra.get("raykv.ray_address")
                            or os.environ.get("RAY_ADDRESS") or "auto"),
            model_name=extra.get("raykv.model_name"), pd_wait_s=pd_wait_s,
            rates_file=extra.get("raykv.rates_file") or None, load_mode=load_mode,
            save_mode=save_mode)


def spec_of(vllm_config, model_name: str | None) -> ModelSpec:
    """The KV geometry one vLLM worker holds: layers of its pipeline stage, KV heads per
    tensor-parallel rank, head size (for MLA, half the latent: vllm_layout.py) and the cache
    dtype ("auto" is the model's dtype).

    Each TP rank and PP stage holds other KV: their pages are keyed apart (the rank and stage
    are in the name, hence in every key's root). UnsupportedConfig for a cache dtype raykv has
    no page dtype for (fp8_e5m2, fp8_inc...)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    for setting in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, setting, 1) or 1
        if size > 1:  # a block's tokens are spread over the ranks, not whole on each
            raise UnsupportedConfig(f"{setting}={size}: context parallelism spreads each "
                                    f"block's tokens over ranks, which raykv's pages do not")
    name = model_name or _served_name(model.served_model_name)
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if tp_size > 1:  # vLLM's layout: rank = (dp x) pp x tp
        name = f"{name}|tp{parallel.rank % tp_size}of{tp_size}"
    if pp_size > 1:
        name = f"{name}|pp{parallel.rank // tp_size % pp_size}of{pp_size}"
    head_size = model.get_head_size()
    if getattr(model, "use_mla", False):  # one latent a token: its halves are K's and V's planes
        if head_size % 2:
            raise UnsupportedConfig(f"MLA latent of {head_size} values: raykv's page holds it "
                                    f"as two equal halves")
        head_size //= 2
    return ModelSpec(name, model.get_num_layers(parallel), model.get_num_kv_heads(parallel),
                     head_size, cache_dtype_of(vllm_config))


def cache_dtype_of(vllm_config) -> str:
    """raykv's page dtype for vLLM's KV cache dtype; UnsupportedConfig when it has none."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype == "auto":
        cache_dtype = vllm_config.model_config.dtype
    if cache_dtype in FP8_E4M3:
        return "fp8"
    try:
        return canonical_dtype(cache_dtype)
    except ValueError:
        raise UnsupportedConfig(f"KV cache dtype {cache_dtype!r} has no raykv page dtype "
                                f"(raykv keeps {sorted(DTYPE_BYTES)}; fp8 is e4m3)") from None


def _served_name(served: str | list[str]) -> str:
    return served[0] if isinstance(served, list) else served


class ServiceLink:
    """A raykv client for one process, made on first use. While raykv cannot be reached it is
    None, and the connection is tried again RETRY_CONNECT_S later."""

    def __init__(self, settings: RaykvSettings, spec: ModelSpec):
        self.settings, self.spec = settings, spec
        self._client = None
        self._next_try_s = 0.0
        self._lock = threading.Lock()
        self._connecting = False

    def client(self):
        """The client, connecting now (blocking) when due; None while raykv is unreachable."""
        with self._lock:
            if self._client is None and time.monotonic() >= self._next_try_s:
                try:
                    self._client = self._connect()
                except Exception as error:  # no service is a miss, never an engine failure
                    self._next_try_s = time.monotonic() + RETRY_CONNECT_S
                    log.warning("raykv unreachable (%s); misses for %.0f s", error,
                                RETRY_CONNECT_S)
            return self._client

    def ready(self):
        """The client if connected, else None at once, with a connection started in the
        background when one is due: for the engine's step, which never waits on raykv."""
        if self._client is None and not self._connecting \
                and time.monotonic() >= self._next_try_s:
            self._connecting = True
            threading.Thread(target=self._connect_in_background, name="raykv-connect",
                             daemon=True).start()
        return self._client

    def call_timeout_s(self) -> float:
        """How long one raykv call may take: the client's timeout, once connected."""
        client = self._client
        return client.timeout_s if client is not None else CONNECT_LOOKUP_TIMEOUT_S

    def prefetch(self, client, tokens: list[int]) -> int:
        """Tokens of `tokens` raykv holds (one lookup); their pull toward this node starts."""
        try:
            return client.prefetch(tokens)
        except Exception:
            log.exception("raykv lookup failed")
            return 0

    def _connect_in_background(self) -> None:
        cpu_sets.follow()  # Ray's threads, started here at the first connect, inherit it
        try:
            self.client()
        finally:
            self._connecting = False

    def _connect(self):
        import ray

        from cluster import connect
        from cluster.api import join_ray

        # An engine process outside Ray's process tree (vLLM's engine core, `vllm serve`) joins
        # with the token at hand when the cluster uses token auth, or says what to export.
        joined_here = not ray.is_initialized()
        join_ray(self.settings.ray_address)
        if joined_here:
            stop_error_listener()
        client = connect(self.spec, self.settings.namespace)
        log.info("raykv connected: %s, namespace %r, %d tokens a page", self.spec,
                 self.settings.namespace, client.page_tokens)
        return client


def stop_error_listener() -> None:
    """Stop the thread that Ray starts in every driver to print the cluster's error messages
    (ray._private.worker.listen_error_messages), in an engine process that joined Ray only
    for raykv's calls: nobody reads that process's stderr for Ray's errors, and under
    `raykv bench vllm-serve` the engines' listeners kept the GCS polling about 1,200 times
    a second (docs/benchmarks.md, vllm-serve). Ray's own shutdown sets the same event."""
    import ray._private.worker as ray_worker

    worker = ray_worker.global_worker
    if getattr(worker, "listener_thread", None) is not None:
        worker.threads_stopped.set()


@dataclass(frozen=True, slots=True)
class Answer:
    """A request's lookup: what sets its keys apart (None: raykv cannot key it, and never
    saves it), the prompt tokens raykv holds, and the service's page size (None: raykv was
    not reached)."""

    salt: bytes | None
    num_tokens: int
    page_tokens: int | None


MISS = Answer(None, 0, None)


class Lookups:
    """The scheduler's raykv lookups, in one background thread. poll() starts a request's
    lookup and waits for it only as long as the step's budget allows (step_budget.py; no
    budget: never); it answers None while the lookup is in flight (vLLM asks again next
    step). A lookup still out past the call timeout is a miss."""

    def __init__(self, link: ServiceLink):
        self._link = link
        self._pool = cpu_sets.thread_pool(1, "raykv-lookup")
        self._pending: dict[str, tuple[Future, float]] = {}
        self._due_s: dict[str, float] = {}  # id -> when its retried lookup may start
        self.num_in_flight_answers = 0  # polls answered None: how often a request waited
        self.num_waited_answers = 0  # lookups answered in the step that asked, by waiting
        self.num_started = 0  # lookups sent to raykv
        self.lookup_s: float | None = None  # EWMA of the lookups' own seconds
        self._num_timed = 0

    def poll(self, request_id: str, tokens: list[int],
             salt_of: Callable[[], bytes | None],
             budget: StepBudget | None = None) -> Answer | None:
        """The request's answer once its lookup is back; None while it is in flight.
        `salt_of()` (run in the lookup thread) names what sets the request's KV apart. With
        a `budget`, a lookup whose measured time fits it is waited for, and the wait charged."""
        due_s = self._due_s.get(request_id)
        if due_s is not None:
            if time.monotonic() < due_s:
                self.num_in_flight_answers += 1
                return None
            del self._due_s[request_id]
        pending = self._pending.get(request_id)
        if pending is None:
            future = self._pool.submit(self._lookup, tokens, salt_of)
            self.num_started += 1
            self._pending[request_id] = (future, time.monotonic() + self._link.call_timeout_s())
            pending = self._pending[request_id]
        future, deadline_s = pending
        if not future.done() and budget is not None and budget.may_wait_for_lookup(self.lookup_s):
            self._wait(future, budget, deadline_s)
        if not future.done():
            if time.monotonic() < deadline_s:
                self.num_in_flight_answers += 1
                return None
            del self._pending[request_id]
            log.warning("raykv lookup of %s took over %.1f s: a miss", request_id,
                        self._link.call_timeout_s())
            return MISS
        del self._pending[request_id]
        try:
            return future.result()
        except Exception:  # a lookup that failed is a miss
            log.exception("raykv lookup of %s failed", request_id)
            return MISS

    def retry(self, request_id: str, after_s: float) -> None:
        """Look the request up afresh once `after_s` has passed (its answer was taken); polls
        answer None until then."""
        self._pending.pop(request_id, None)
        self._due_s[request_id] = time.monotonic() + after_s

    def forget(self, request_id: str) -> None:
        """The request is gone: its lookup's answer, when it comes, is dropped."""
        self._pending.pop(request_id, None)
        self._due_s.pop(request_id, None)

    def forget_all(self) -> None:
        """Every lookup's answer is dropped (their keys are stale: a cache reset)."""
        self._pending.clear()
        self._due_s.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _wait(self, future: Future, budget: StepBudget, deadline_s: float) -> None:
        started_s = time.monotonic()
        limit_s = min(budget.wait_limit_s(self._link.call_timeout_s()), deadline_s - started_s)
        wait([future], timeout=max(0.0, limit_s))
        budget.spend(time.monotonic() - started_s)
        if future.done():
            self.num_waited_answers += 1

    def _lookup(self, tokens: list[int], salt_of: Callable[[], bytes | None]) -> Answer:
        started_s = time.monotonic()
        salt = salt_of()
        client = self._link.client()
        if salt is None or client is None:
            return Answer(salt, 0, None if client is None else client.page_tokens)
        num_tokens = self._link.prefetch(client.salted(salt), tokens) if tokens else 0
        # Only this thread writes it; the scheduler reads a float, whole.
        self.lookup_s = ewma(self.lookup_s or 0.0, time.monotonic() - started_s,
                             self._num_timed)
        self._num_timed += 1
        return Answer(salt, num_tokens, client.page_tokens)
