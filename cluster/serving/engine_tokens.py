"""A request's prompt tokens as its vLLM engine will compute them, rendered in the router's
process, and handed to the engine so that it does not render the prompt again.

raykv's router keys a prompt's pages from its token ids (cluster/serving/prompt_keys.py).
Ray Serve LLM's engines render a chat themselves: the chat template the engine was given,
its default template arguments, the request's tools and template arguments, then the
tokenizer. A router that renders with the tokenizer's own template alone keys some prompts
with ids the engine never computes (a system prompt the template moves, tools, a server-side
template), and the engine renders every prompt a second time.

EngineTokens renders with vLLM's own OnlineRenderer, configured from the engine's arguments
as the engine configures it (cluster/serving/vllm_renderer.py). Ray's KV-aware routing path
builds the same renderer in its ingress. The ids are then the engine's by construction.

vLLM takes a chat's ids ready-made in `kv_transfer_params["prompt_token_ids"]`
(vllm.renderers.online_renderer: its decode-side reuse, which Ray's own router forwards
through). The engine then skips templating and tokenizing, checks the ids against its
vocabulary, and pops the key before the request reaches the scheduler. vLLM ignores the ids,
and renders, for an echo or for messages with non-text content. It refuses them on a batch
of chats, so `forwardable` leaves a batch alone. A completion's ids go in as its prompt,
which vLLM takes as ids without tokenizing (not for an echo, whose reply carries the prompt's
text). A client's own ids are what the engine prefills, so the router keys those and leaves
them as they are (`client_token_ids`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

log = logging.getLogger("raykv.router")
RETRY_S = 300.0  # a renderer that could not be built is tried again after this long
FORWARD_KEY = "prompt_token_ids"  # vLLM's key in kv_transfer_params
# Engine arguments that do not change how a prompt is rendered, left out of the renderer's
# copy: the connector and the KV events belong to the engine, not to its renderer.
NOT_RENDERING = ("kv_transfer_config", "kv_events_config")


def renderer_spec(model_source: str, model_id: str, engine_kwargs: dict) -> dict | None:
    """What the router needs to render prompts as the engine does (JSON, as Serve requires of
    a router's kwargs): the model and the engine's arguments less NOT_RENDERING. None where
    the arguments are not JSON (the router then renders with the tokenizer alone)."""
    kwargs = {k: v for k, v in engine_kwargs.items() if k not in NOT_RENDERING}
    spec = {"model_source": model_source, "model_id": model_id, "engine_kwargs": kwargs}
    try:
        json.dumps(spec)
    except (TypeError, ValueError):
        log.warning("engine arguments are not JSON: raykv's router renders prompts with the "
                    "tokenizer's own chat template")
        return None
    return spec


def forwardable(request: Any) -> bool:
    """Whether the engine may take this request's rendered ids ready-made: a chat of one
    conversation (vLLM refuses ids on a batch) that has vLLM's `kv_transfer_params` (a
    tokenize request has none), or a completion of one text prompt, with no echo (an echo
    returns the prompt's text) and no prompt embeddings."""
    if not hasattr(request, "kv_transfer_params"):
        return False
    if _is_chat(request):
        return not isinstance(request.messages[0], list)
    return isinstance(getattr(request, "prompt", None), str) \
        and not getattr(request, "echo", False) \
        and getattr(request, "prompt_embeds", None) is None


def _is_chat(request: Any) -> bool:
    messages = getattr(request, "messages", None)
    return isinstance(messages, list) and bool(messages)


def client_token_ids(request: Any) -> list[int] | None:
    """The ids a client gave for the engine to prefill, or None: a chat's in its
    `kv_transfer_params`, a completion's as its prompt."""
    if _is_chat(request):
        params = getattr(request, "kv_transfer_params", None)
        ids = params.get(FORWARD_KEY) if isinstance(params, dict) else None
    else:
        ids = getattr(request, "prompt", None)
    if isinstance(ids, list) and ids and all(type(i) is int and i >= 0 for i in ids):
        return ids
    return None


def forward(request: Any, token_ids: list[int]) -> None:
    """Hand the engine the ids: a chat's in its `kv_transfer_params` (beside the router's hit
    and cut; a client's own ids there stay), a completion's as its prompt (vLLM reads a
    completion's ids from nowhere else; a prompt of ids is one vLLM takes as it is)."""
    if not _is_chat(request):
        request.prompt = list(token_ids)
        return
    params = getattr(request, "kv_transfer_params", None)
    params = dict(params) if isinstance(params, dict) else {}
    params.setdefault(FORWARD_KEY, list(token_ids))
    request.kv_transfer_params = params


def with_forwarded_ids(params: dict | None, request: Any) -> dict | None:
    """`params` (a P/D side's kv_transfer_params) plus the ids handed over on the client's
    chat `request`, where it has some: a copy of the request for another engine keeps them
    (a completion's ids are its prompt, which the copy keeps anyway)."""
    ids = client_token_ids(request) if _is_chat(request) and forwardable(request) else None
    if ids is None:
        return params
    return {**(params or {}), FORWARD_KEY: list(ids)}


def text_only(request: Any) -> bool:
    """Whether a chat's messages are text only (a completion's prompt always is). Rendering
    media would fetch and process it in the router's process, for ids vLLM does not take
    ready-made anyway: such a chat is keyed by the tokenizer."""
    if not _is_chat(request):
        return True
    for message in request.messages:
        content = message.get("content") if isinstance(message, dict) \
            else getattr(message, "content", None)
        if isinstance(content, list) and any(_part_type(part) != "text" for part in content):
            return False
    return True


def _part_type(part: Any) -> Any:
    return part.get("type") if isinstance(part, dict) else getattr(part, "type", None)


def payload_of(request: Any) -> dict | None:
    """The request's body as a dict (a pydantic request as its client set it, a namespace
    copy of a body as it is), or None."""
    if isinstance(request, dict):
        return request
    if hasattr(request, "model_dump"):
        return request.model_dump(exclude_unset=True)
    fields = getattr(request, "__dict__", None)
    return dict(fields) if isinstance(fields, dict) else None


class EngineTokens:
    """Renders requests with the engine's own renderer (`spec`: renderer_spec's). The
    renderer is built in a thread, started by the first request; until it is built (a
    second or so: vLLM reads the model's config), and while it cannot be, `token_ids`
    answers None and the caller keys with the tokenizer, so no request waits for it."""

    def __init__(self, spec: dict, build=None):
        """`build`: spec -> a tokenizer with `async tokenize(payload)` (tests pass a fake;
        default: vllm_renderer.VllmRenderer, vLLM's OnlineRenderer)."""
        self.spec = spec
        self._build = build or _vllm_renderer
        self._tokenizer = None
        self._building: asyncio.Future | None = None
        self._failed_s = -RETRY_S

    async def token_ids(self, request: Any) -> list[int] | None:
        """The ids the engine will compute for the request's prompt; None for a request with
        no single prompt, one the engine will refuse (it says why itself), or while the
        renderer is not built."""
        tokenizer = self._ready()
        if tokenizer is None or not text_only(request):
            return None
        payload = payload_of(request)
        if payload is None:
            return None
        try:
            return await tokenizer.tokenize(payload) or None
        except Exception as error:  # one the engine will refuse (it says why): the
            log.debug("rendering for routing failed: %s", error)  # tokenizer keys it
            return None

    def _ready(self):
        """The renderer, or None while it is being built or could not be (the build is
        started here, and again RETRY_S after a failure)."""
        if self._tokenizer is None and self._building is None \
                and time.monotonic() - self._failed_s >= RETRY_S:
            self._building = asyncio.ensure_future(asyncio.to_thread(self._build, self.spec))
            self._building.add_done_callback(self._built)
        return self._tokenizer

    def _built(self, building: asyncio.Future) -> None:
        self._building = None
        try:
            self._tokenizer = building.result()
        except Exception as error:  # no vLLM here, or its internals moved
            self._failed_s = time.monotonic()
            log.warning("raykv's router cannot render prompts as the engine does (%s): it "
                        "keys them with the tokenizer's chat template, and the engine renders "
                        "them again", error)


def _vllm_renderer(spec: dict):
    """vLLM's OnlineRenderer configured from the engine's arguments (vllm_renderer.py)."""
    from cluster.serving.vllm_renderer import VllmRenderer

    return VllmRenderer(spec)
