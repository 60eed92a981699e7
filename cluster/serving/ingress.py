"""The HTTP ingress: OpenAI-compatible /v1/completions, /v1/chat/completions and /v1/models.

It tokenizes (bytes), computes the prompt's page keys once, and calls the engine through a
handle, whose request router (raykv's, Serve's pow2, or Ray Serve LLM's prefix router) runs
here and can see those keys. Errors use OpenAI's JSON shape; a bad request gets a 4xx and
never reaches an engine.

Admission comes first (cluster/serving/admission.py): per-tenant token buckets (the tenant is
the x-raykv-namespace), priority classes (x-raykv-priority: high|normal|low, else the
tenant's default) and bounded queues. A refused request, or one that waited past the bound,
gets 429 with Retry-After before it reaches an engine. The engines' own queue bound
(max_queued_requests, Serve's BackPressureError) still answers 503.

The operator's admin endpoints (/v1/raykv/admin/pin, unpin, warm: cluster/serving/admin.py)
answer only to the admin key, which the access middleware checks before any body is read.
"""


import asyncio
import functools
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.api import key_chain, running_config
from cluster.calls import Steps, run_async
from cluster.core.geometry import PageGeometry
from cluster.core.keys import KeyChain
from cluster.core.spec import ModelSpec
from cluster.operator import Operator, Prefix
from cluster.serving import access, admin, protocol, tokenizer
from cluster.serving.access import Access
from cluster.serving.admission import AdmissionGate, Overloaded
from cluster.serving.engine import Chunk, GenerationRequest
from cluster.serving.local_cache import LocalCacheSettings
from policies.admission import AdmissionLimits

log = logging.getLogger("raykv.ingress")
app = FastAPI(title="raykv", docs_url=None, redoc_url=None)
app.add_middleware(access.AccessMiddleware)
RETRY_AFTER_S = 1
NAMESPACE_REFRESH_S = 1.0
MAX_UNKNOWN_NAMESPACES = 4096
RETRYABLE = (RayActorError, ActorDiedError, ActorUnavailableError)


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str, code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.body = status, protocol.error_body(message, kind, code, param)
        self.retry_after = str(RETRY_AFTER_S)


@app.exception_handler(ApiError)
async def _api_error(_: Request, error: ApiError) -> JSONResponse:
    headers = {"Retry-After": error.retry_after} if error.status in (429, 503) else None
    return JSONResponse(error.body, status_code=error.status, headers=headers)


@app.exception_handler(Overloaded)
async def _overloaded(_: Request, error: Overloaded) -> JSONResponse:
    body = protocol.error_body(str(error), "rate_limit_error", error.code)
    return JSONResponse(body, status_code=429, headers={"Retry-After": error.retry_after_header})


@app.exception_handler(RequestValidationError)
async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0] if error.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    message = f"{first.get('msg', 'invalid request')}" + (f" ({param})" if param else "")
    return JSONResponse(protocol.error_body(message, "invalid_request_error", None, param),
                        status_code=400)


@app.exception_handler(Exception)
async def _unexpected(_: Request, error: Exception) -> JSONResponse:
    log.exception("request failed")  # logged here; the client gets no traceback
    return JSONResponse(protocol.error_body(f"internal error: {type(error).__name__}",
                                            "server_error"), status_code=500)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return JSONResponse(protocol.error_body(str(error.detail), kind), status_code=error.status_code)


# Helpers come before the class: Serve pickles the ingress class with the globals it
# finds at that moment.


@dataclass(frozen=True, slots=True)
class IngressSettings:
    max_context_tokens: int
    default_max_tokens: int = 16
    admission: AdmissionLimits | None = None
    access: Access = field(default_factory=Access)
    local_cache: LocalCacheSettings | None = None  # the engines' own caches; no raykv


def _namespace(request: Request) -> str:
    """The request's namespace: its API key's when keys are configured (a header naming
    another one is refused), else "default". Without keys a header naming another namespace
    is refused too: nothing tells that caller from any other, so it would read (through
    cached_tokens) and spend (its rate limit) another tenant's cache."""
    asked = request.headers.get("x-raykv-namespace") or None
    owned = request.scope.get("state", {}).get(access.NAMESPACE_KEY)
    if owned is None:
        if asked not in (None, access.DEFAULT_NAMESPACE):
            raise ApiError(403, f"namespace {asked!r} needs an API key: without API keys this "
                           f"server serves only the {access.DEFAULT_NAMESPACE!r} namespace",
                           "permission_error", "namespace_forbidden")
        return access.DEFAULT_NAMESPACE
    if asked is not None and asked != owned:
        raise ApiError(403, f"this API key may not use namespace {asked!r}", "permission_error",
                       "namespace_forbidden")
    return owned


def serve_bind_host(timeout_s: float = 10.0) -> str | None:
    """The host Serve's HTTP proxies bind, as Serve's controller holds it (its http_options),
    or None where it cannot be read: no Ray, no Serve controller, no answer in time."""
    http = _controller_answer("get_http_config", timeout_s)
    return None if http is None else http.host


def serve_proxy_location(timeout_s: float = 10.0) -> str | None:
    """Where Serve runs its HTTP proxies ("HeadOnly", "EveryNode", ...), as its controller
    holds it, or None where it cannot be read (as serve_bind_host)."""
    location = _controller_answer("get_proxy_location", timeout_s)
    return None if location is None else getattr(location, "value", str(location))


def _controller_answer(method: str, timeout_s: float):
    """What Serve's controller answers to `method` (no arguments), or None where it cannot
    be read: no Ray, no Serve controller, no answer in time."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    if not ray.is_initialized():
        return None
    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:  # no Serve on this cluster (yet)
        return None
    try:
        return ray.get(getattr(controller, method).remote(), timeout=timeout_s)
    except Exception:  # unknown, which the callers take as the cautious answer
        log.warning("could not read Serve's %s", method, exc_info=True)
        return None


def _usage(chunk: Chunk) -> dict:
    return protocol.usage(chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_tokens)


def _headers(chunk: Chunk) -> dict:
    return {"x-raykv-replica": chunk.replica, "x-raykv-cached-tokens": str(chunk.cached_tokens)}


async def _completion_events(stream, head: Chunk, request_id: str, model: str,
                             include_usage: bool) -> AsyncIterator[dict]:
    last, created = head, int(time.time())  # one `created` for every chunk of the stream
    async for chunk in stream:
        last = chunk
        if chunk.text or chunk.finish_reason:
            yield protocol.completion_body(request_id, model, chunk.text, chunk.finish_reason,
                                           None, created)
    if include_usage:
        yield {**protocol.completion_body(request_id, model, "", None, _usage(last), created),
               "choices": []}


async def _chat_events(stream, head: Chunk, request_id: str, model: str,
                       include_usage: bool) -> AsyncIterator[dict]:
    created = int(time.time())  # one for every chunk of the stream
    yield protocol.chat_chunk(request_id, model, {"role": "assistant", "content": ""}, None,
                              None, created)
    last = head
    async for chunk in stream:
        last = chunk
        if chunk.text or chunk.finish_reason:
            delta = {"content": chunk.text} if chunk.text else {}
            yield protocol.chat_chunk(request_id, model, delta, chunk.finish_reason, None,
                                      created)
    if include_usage:
        yield {**protocol.chat_chunk(request_id, model, {}, None, _usage(last), created),
               "choices": []}


async def _sse(events: AsyncIterator[dict], done: Callable[[], object]) -> AsyncIterator[str]:
    """Server-sent events; `done()` (the admission slot's release) runs when the stream ends,
    however it ends."""
    try:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
    except Exception as error:  # the stream is open: report in-band, as OpenAI does
        log.exception("generation failed mid-stream")  # the detail here, as _unexpected
        message = f"internal error mid-stream: {type(error).__name__}"
        yield f"data: {json.dumps(protocol.error_body(message, 'server_error'))}\n\n"
    finally:
        done()
    yield "data: [DONE]\n\n"


# kind -> (id prefix, stream events, whole body)
RESPONSES = {"completion": ("cmpl", _completion_events, protocol.completion_body),
             "chat": ("chatcmpl", _chat_events, protocol.chat_body)}


def _priority(request: Request) -> str | None:
    return request.headers.get("x-raykv-priority") or None


# Ongoing requests include those waiting at the admission gate, which bounds them itself.
@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Ingress:
    """OpenAI-compatible HTTP in front of the engine deployment."""

    def __init__(self, engine, spec: ModelSpec, settings: IngressSettings):
        # Checked here too, not only when the app is built: a builder may run before Serve
        # (`serve run`), while a replica always runs under the controller that binds HTTP.
        access.require_keys_for_bind(settings.access, serve_bind_host())
        self.engine = engine.options(stream=True)
        self.spec = spec
        self.local_cache = settings.local_cache
        self.config = running_config() if self.local_cache is None else None
        self.chains: dict[str, KeyChain] = {}  # namespace -> its key chain (secret inside)
        self.unknown: dict[str, float] = {}  # namespace -> when the controller refused it
        self.max_context_tokens = settings.max_context_tokens
        self.default_max_tokens = settings.default_max_tokens
        admission = settings.admission
        access.CURRENT[0] = settings.access
        self.gate = AdmissionGate(admission or AdmissionLimits())
        self.operator = Operator.of(self.config) if self.config is not None else None

    @app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model}")
    async def model(self, model: str) -> dict:
        """The model's card (the openai client's models.retrieve); 404 for another name."""
        if model != self.spec.name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{self.spec.name}`.", "invalid_request_error", "model_not_found",
                           "model")
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.spec.name, "object": "model", "created": 0, "owned_by": "raykv"}

    @app.get("/v1/raykv/admission")
    async def admission(self) -> dict:
        """This replica's gate: slots in flight, waiters per class, refusals."""
        return self.gate.stats()

    @app.post("/v1/raykv/admin/pin")
    async def admin_pin(self, body: admin.PinBody, request: Request) -> dict:
        """Pin a prompt's stored pages for ttl_s on every node holding them."""
        prefix = await self._admin_prefix(body, request)
        pages = await self._operate(self.operator.pin(prefix, body.ttl_s))
        return {"pinned_pages": pages, "prompt_pages": len(prefix.keys),
                "namespace": body.namespace, "ttl_s": body.ttl_s}

    @app.post("/v1/raykv/admin/unpin")
    async def admin_unpin(self, body: admin.PromptBody, request: Request) -> dict:
        prefix = await self._admin_prefix(body, request)
        pages = await self._operate(self.operator.unpin(prefix))
        return {"unpinned_pages": pages, "namespace": body.namespace}

    @app.post("/v1/raykv/admin/warm")
    async def admin_warm(self, body: admin.WarmBody, request: Request) -> dict:
        """Copy a prompt's stored pages onto a node ahead of its traffic."""
        prefix = await self._admin_prefix(body, request)
        pages = await self._operate(self.operator.warm(prefix, body.node))
        return {"node_pages": pages, "prompt_pages": len(prefix.keys),
                "namespace": body.namespace, "node": body.node}

    async def _admin_prefix(self, body: admin.PromptBody, request: Request) -> Prefix:
        if not access.admin_passed(request.scope):  # the gate's own check, on the route
            raise ApiError(403, "This key may not use the admin endpoints.", "permission_error",
                           "admin_only")
        if self.operator is None:
            raise ApiError(409, "this app runs without raykv (local_cache): nothing to pin or "
                           "warm", "invalid_request_error", "no_service")
        chain = await self._chain(body.namespace)
        try:
            keys = chain.keys(body.token_ids())
        except (TypeError, ValueError) as error:
            raise ApiError(400, str(error), "invalid_request_error", "invalid_tokens") from None
        if not keys:
            raise ApiError(400, f"the prompt has no full page ({chain.page_tokens} tokens "
                           "each)", "invalid_request_error", "no_full_page")
        geometry = PageGeometry.of(self.spec, self.config.page_tokens)
        return Prefix(geometry, tuple(keys), body.namespace)

    async def _operate(self, steps: Steps[int]) -> int:
        try:
            return await run_async(steps, self.config.call_timeout_s)
        except (ValueError, RuntimeError) as error:
            status, code = admin.error_status(error)
            kind = "server_error" if status >= 500 else "invalid_request_error"
            raise ApiError(status, str(error), kind, code) from None

    @app.post("/v1/completions")
    async def completions(self, body: protocol.CompletionRequest, request: Request):
        generation = await self._generation(body, body.text(), request, body.token_ids(),
                                            "prompt")
        return await self._admitted(generation, body, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(self, body: protocol.ChatCompletionRequest, request: Request):
        messages = [tokenizer.Message(m.role, m.text()) for m in body.messages]
        generation = await self._generation(body, tokenizer.apply_chat_template(messages), request)
        return await self._admitted(generation, body, request, "chat")

    async def _admitted(self, generation: GenerationRequest, body, request: Request,
                        kind: str):
        """Run a request once the gate lets it in; its slot is held until the answer (or the
        stream) ends. `kind` names its shapes in RESPONSES."""
        id_prefix, events, whole = RESPONSES[kind]
        request_id = generation.request_id = protocol.new_id(id_prefix)
        try:
            ticket = await self.gate.enter(generation.namespace, _priority(request))
        except ValueError as error:  # an unknown priority class
            raise ApiError(400, str(error), "invalid_request_error", "invalid_priority",
                           "x-raykv-priority") from None
        release = functools.partial(self.gate.leave, ticket)  # idempotent
        try:
            if body.stream:
                return await self._stream(generation, request_id, body, events, release)
            text, last = await self._collect(generation)
        except BaseException:
            release()
            raise
        release()
        return JSONResponse(whole(request_id, body.model, text, last.finish_reason,
                                  _usage(last)), headers=_headers(last))

    async def _generation(self, body, prompt: str, request: Request,
                          token_ids: list[int] | None = None,
                          prompt_param: str = "messages") -> GenerationRequest:
        """The engine's request: the prompt's tokens (its text's, or `token_ids` as given),
        sampling, namespace and page keys. 404 for another model, 400 for a prompt past the
        context or with ids outside the vocabulary (`prompt_param` names the field)."""
        if body.model != self.spec.name:
            raise ApiError(404, f"The model `{body.model}` does not exist; this server "
                           f"serves `{self.spec.name}`.", "invalid_request_error",
                           "model_not_found", "model")
        namespace = _namespace(request)
        chain = await self._chain(namespace)
        if token_ids is None:
            tokens = tokenizer.encode(prompt)
        elif any(not 0 <= token < tokenizer.NUM_TEXT_IDS for token in token_ids):
            raise ApiError(400, f"prompt token ids must lie in [0, {tokenizer.NUM_TEXT_IDS})",
                           "invalid_request_error", "invalid_token_ids", prompt_param)
        else:
            tokens, prompt = list(token_ids), tokenizer.decode(token_ids)
        params = body.sampling(self.default_max_tokens)
        if len(tokens) + params.max_tokens > self.max_context_tokens:
            # 400, as OpenAI answers it (the openai client raises BadRequestError)
            raise ApiError(400, f"This model's maximum context length is "
                           f"{self.max_context_tokens} tokens; the prompt has {len(tokens)} "
                           f"and max_tokens asks for {params.max_tokens}.",
                           "invalid_request_error", "context_length_exceeded", prompt_param)
        keys = chain.keys(tokens)
        return GenerationRequest(prompt, tokens, params, namespace, b"".join(keys))

    async def _chain(self, namespace: str) -> KeyChain:
        """The namespace's key chain, asked of the controller the first time; an unknown
        namespace is a 400 (and is not asked about again for NAMESPACE_REFRESH_S: one added
        at run time is served within that)."""
        chain = self.chains.get(namespace)
        if chain is not None:
            return chain
        if self.local_cache is not None:  # no service: keyed as the engines' own caches key
            chain = self.chains[namespace] = KeyChain.of(self.spec, namespace,
                                                         self.local_cache.page_tokens)
            return chain
        now_s = time.monotonic()
        if now_s - self.unknown.get(namespace, -NAMESPACE_REFRESH_S) >= NAMESPACE_REFRESH_S:
            try:
                chain = await asyncio.to_thread(key_chain, self.spec, namespace)
            except ValueError:
                if len(self.unknown) >= MAX_UNKNOWN_NAMESPACES:
                    self.unknown.clear()
                self.unknown[namespace] = now_s
        if chain is None:
            raise ApiError(400, f"unknown namespace {namespace!r}", "invalid_request_error",
                           "unknown_namespace")
        self.chains[namespace] = chain
        return chain

    def _call(self, generation: GenerationRequest):
        try:
            return self.engine.generate.remote(generation)
        except BackPressureError as error:
            raise ApiError(503, f"the engines are overloaded: {error}", "server_error",
                           "overloaded") from None

    async def _first(self, generation: GenerationRequest):
        """The engine's stream and its first chunk; a replica that died before answering is
        retried once on another (nothing was sent to the client yet)."""
        for attempt in range(2):
            stream = self._call(generation)
            try:
                return stream, await stream.__anext__()
            except BackPressureError as error:
                raise ApiError(503, f"the engines are overloaded: {error}", "server_error",
                               "overloaded") from None
            except RETRYABLE:
                if attempt:
                    raise
                log.warning("engine replica died before answering; retrying once")

    async def _collect(self, generation: GenerationRequest) -> tuple[str, Chunk]:
        """The whole generation; a replica that dies mid-way is retried once from scratch
        (the text so far is dropped, so no response mixes two generations)."""
        for attempt in range(2):
            stream, last = await self._first(generation)
            parts = []
            try:
                async for chunk in stream:
                    parts.append(chunk.text)
                    last = chunk
                return "".join(parts), last
            except RETRYABLE:
                if attempt:
                    raise
                log.warning("engine replica died mid-generation; retrying once")

    async def _stream(self, generation: GenerationRequest, request_id: str, body, events,
                      done: Callable[[], object]):
        stream, head = await self._first(generation)
        include_usage = bool((getattr(body, "stream_options", None) or {}).get("include_usage"))
        sse = _sse(events(stream, head, request_id, body.model, include_usage), done)
        # A stream dropped before it was ever iterated (its client left first) never runs
        # its finally: release the slot when it is collected.
        weakref.finalize(sse, done)
        return StreamingResponse(sse, media_type="text/event-stream", headers=_headers(head))
