"""The vLLM app's OpenAI ingress with raykv's API keys.

Ray Serve LLM's own `OpenAiIngress` takes no keys, so on any bind beyond loopback every caller
that reaches the port could use the engines and read `cached_tokens`. This subclass holds the
same rules as raykv's own app (cluster/serving/access.py):

- a request without a known key gets 401, one whose key belongs to another namespace 403:
  the app serves the one namespace its engines' connector keys pages under;
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

from cluster.serving.access import Access, require_keys_for_bind


class KeyedOpenAiIngress(OpenAiIngress):
    """OpenAiIngress behind bearer keys: `key_digests` maps key_digest(key) -> namespace
    ({}: no key needed, for a loopback bind only); `namespace` is the one the app serves."""

    def __init__(self, llm_deployments: dict, model_cards: dict, *,
                 key_digests: dict[bytes, str] | None = None, namespace: str = "default",
                 **kwargs: Any):
        from cluster.serving.ingress import serve_bind_host

        self._access = Access(dict(key_digests or {}))
        self._namespace = namespace
        require_keys_for_bind(self._access, serve_bind_host())  # raises: the replica fails
        super().__init__(llm_deployments, model_cards, **kwargs)

    def _refused(self, request: Request) -> Response | None:
        """The error reply for a request without this app's key, or None to go on."""
        if not self._access.keyed:
            return None
        namespace = self._access.namespace_of(request.headers.get("authorization"))
        if namespace is None:
            return _error(401, "Incorrect API key provided: pass 'Authorization: Bearer "
                               "<key>'.", "invalid_api_key")
        if namespace != self._namespace:
            return _error(403, f"this key is for namespace {namespace!r}; this app serves "
                               f"{self._namespace!r}", "namespace_forbidden")
        return None

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


def _error(status: int, message: str, code: str) -> JSONResponse:
    """OpenAI's error shape, as raykv's own app answers."""
    kind = "invalid_request_error" if status == 401 else "permission_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": code}}, status_code=status)
