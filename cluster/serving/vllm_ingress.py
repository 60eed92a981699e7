"""The vLLM app's OpenAI ingress with raykv's API keys.

Ray Serve LLM's own `OpenAiIngress` takes no keys, so on any bind beyond loopback every caller
that reaches the port could use the engines and read `cached_tokens`. This subclass holds the
same rules as raykv's own app (cluster/serving/access.py):

- a request without a known key gets 401, one whose key belongs to another namespace 403:
  the app serves the one namespace its engines' connector keys pages under;
- the key is checked before any of the body is read (`KeyFirstMiddleware`, put in front of
  the replica's app when Serve hands it over), and a body over `max_request_bytes` is a 413:
  FastAPI would otherwise read and parse any body, of any size, before a route could look at
  the key. Each route checks the key again, should the middleware ever be missing;
- keys are kept as digests only;
- a replica refuses to start without keys when Serve's HTTP binds a non-loopback (or an
  unknown) host, as raykv's ingress does (the builder checks first where Serve already runs).

`build_vllm_app` puts it in through `ingress_cls_config` (Ray Serve LLM's documented hook).
No `from __future__ import annotations` here: FastAPI reads the routes' annotations.
"""

from typing import Annotated, Any

from fastapi import Form, Request
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    ScoreRequest,
    TokenizeCompletionRequest,
    TranscriptionRequest,
)
from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress
from starlette.responses import JSONResponse, Response

from cluster.serving import protocol
from cluster.serving.access import (
    VLLM_MAX_REQUEST_BYTES,
    Access,
    namespace_refusal,
    pass_capped,
    reply_error,
    require_keys_for_bind,
    scope_headers,
)


class KeyFirstMiddleware:
    """ASGI middleware in front of the keyed ingress's app: the key (401, 403), then the
    body's size (413), before FastAPI reads or parses anything."""

    def __init__(self, app, *, access: Access, namespace: str):
        self.app, self.access, self.namespace = app, access, namespace

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope_headers(scope)
        refused = namespace_refusal(self.access, self.namespace, headers.get("authorization"))
        if refused is not None:
            return await reply_error(send, *refused)
        await pass_capped(self.app, scope, receive, send, self.access.max_request_bytes,
                          headers)


class KeyedOpenAiIngress(OpenAiIngress):
    """OpenAiIngress behind bearer keys: `key_digests` maps key_digest(key) -> namespace
    ({}: no key needed, for a loopback bind only); `namespace` is the one the app serves;
    `max_request_bytes` a body's limit."""

    def __init__(self, llm_deployments: dict, model_cards: dict, *,
                 key_digests: dict[bytes, str] | None = None, namespace: str = "default",
                 max_request_bytes: int = VLLM_MAX_REQUEST_BYTES, **kwargs: Any):
        from cluster.serving.ingress import serve_bind_host

        self._access = Access(dict(key_digests or {}), max_request_bytes)
        self._namespace = namespace
        require_keys_for_bind(self._access, serve_bind_host())  # raises: the replica fails
        super().__init__(llm_deployments, model_cards, **kwargs)

    def _set_asgi_app(self, app) -> None:
        """Serve's replica wrapper (ray.serve's ASGIAppReplicaWrapper, after this class in the
        replica class's MRO) hands over the replica's own copy of the FastAPI app here: the
        key's middleware goes in front of it before it serves anything."""
        from ray.llm._internal.serve.core.server.llm_server import _add_middleware_to_built_app

        _add_middleware_to_built_app(app, KeyFirstMiddleware, access=self._access,
                                     namespace=self._namespace)
        super()._set_asgi_app(app)

    def _refused(self, request: Request) -> Response | None:
        """The error reply for a request without this app's key, or None to go on."""
        refused = namespace_refusal(self._access, self._namespace,
                                    request.headers.get("authorization"))
        if refused is None:
            return None
        status, message, kind, code = refused
        return JSONResponse(protocol.error_body(message, kind, code), status_code=status)

    async def models(self, request: Request) -> ModelList:
        return self._refused(request) or await super().models()

    async def model_data(self, model: str, request: Request) -> ModelCard:
        return self._refused(request) or await super().model_data(model)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return self._refused(request) or await super().completions(body, request)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        return self._refused(request) or await super().chat(body, request)

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> Response:
        return self._refused(request) or await super().embeddings(body, request)

    async def transcriptions(self, body: Annotated[TranscriptionRequest, Form()],
                             request: Request) -> Response:
        return self._refused(request) or await super().transcriptions(body, request)

    async def score(self, body: ScoreRequest, request: Request) -> Response:
        return self._refused(request) or await super().score(body, request)

    async def tokenize(self, body: TokenizeCompletionRequest, request: Request) -> Response:
        return self._refused(request) or await super().tokenize(body, request)

    async def detokenize(self, body: DetokenizeRequest, request: Request) -> Response:
        return self._refused(request) or await super().detokenize(body, request)

