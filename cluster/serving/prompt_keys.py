"""Page keys of an OpenAI request that carries text, not keys: what raykv's router needs in
front of Ray Serve LLM's vLLM engines (their requests have `.prompt` or `.messages`).

The prompt is tokenized as vLLM does it: a completion's text with the tokenizer's own special
tokens, a chat rendered by the tokenizer's chat template (with the generation prompt) and then
encoded without adding any; its full pages are keyed with the model's KV geometry and the
namespace, exactly as RaykvConnector keys them, so the router finds the connector's pages:
with the namespace's secret, asked of the running service the first time (when it cannot be
had, requests are routed without keys).

Where the router knows the engine's arguments (`engine`: engine_tokens.renderer_spec), it
renders a request with the engine's own renderer instead (cluster/serving/engine_tokens.py):
the ids are then the engine's for any chat (its server-side template, tools, template
arguments), and the ids go to the engine ready-made (`forward_ids`), so that it does not
render the prompt again. A client's own ids (a chat's in `kv_transfer_params`, a completion's
prompt of ids) are what the engine prefills, so they are keyed as they are.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from functools import cached_property

from cluster.core.keys import KeyChain
from cluster.core.spec import ModelSpec
from cluster.serving.engine_tokens import EngineTokens, client_token_ids, forwardable

log = logging.getLogger("raykv.router")
RETRY_S = 10.0


@dataclass(frozen=True)
class PromptIds:
    """A request's prompt ids, and whether the engine may take them ready-made."""

    token_ids: list[int] | None
    forward: bool = False


class PromptKeys:
    def __init__(self, tokenizer_dir: str, spec: ModelSpec, namespace: str, page_tokens: int,
                 secret: bytes | None = None, engine: EngineTokens | None = None,
                 forward_ids: bool = True):
        """`secret`: the namespace's key-chain secret; None asks the running service.
        `engine`: renders prompts as the engine does (None: the tokenizer's own template);
        `forward_ids`: hand the engine the ids rendered that way."""
        self.tokenizer_dir, self.spec = tokenizer_dir, spec
        self.namespace, self.page_tokens = namespace, page_tokens
        self.secret = secret
        self.engine, self.forward_ids = engine, forward_ids
        self._chain: KeyChain | None = None
        self._failed_s = -RETRY_S

    @property
    def chain(self) -> KeyChain | None:
        """The key chain; None while the service cannot give the secret (asked again after
        RETRY_S)."""
        if self._chain is None and self.secret is not None:
            self._chain = KeyChain.of(self.spec, self.namespace, self.page_tokens, self.secret)
        if self._chain is None and time.monotonic() - self._failed_s >= RETRY_S:
            from cluster.api import key_chain

            try:
                self._chain = key_chain(self.spec, self.namespace, self.page_tokens)
            except Exception as error:  # raykv not running here: route without keys
                self._failed_s = time.monotonic()
                log.warning("no key chain for namespace %r (%s): routing without keys",
                            self.namespace, error)
        return self._chain

    @property
    def known_chain(self) -> KeyChain | None:
        """The key chain if it is known already (never asks the service)."""
        return self._chain

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer_dir)

    def token_ids(self, request: object) -> list[int] | None:
        """The prompt's token ids, or None when the request has no prompt or messages."""
        prompt = getattr(request, "prompt", None)
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        messages = getattr(request, "messages", None)
        if not messages:
            return None
        chat = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
        text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                  tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def keys(self, token_ids: list[int] | None) -> bytes:
        """The concatenated page keys of these ids' full pages (b"" without the chain)."""
        chain = self.chain
        return b"".join(chain.keys(token_ids)) if token_ids and chain is not None else b""

    async def request_ids(self, request: object) -> PromptIds:
        """The ids the engine will prefill for the request: a client's own, else the
        engine's rendering (forwardable where `forward_ids` and the request allow), else
        the tokenizer's (in a thread: CPU work off the router's loop)."""
        own = client_token_ids(request)
        if own is not None:
            return PromptIds(own)
        if self.engine is not None:
            ids = await self.engine.token_ids(request)
            if ids is not None:
                return PromptIds(ids, self.forward_ids and forwardable(request))
        try:
            return PromptIds(await asyncio.to_thread(self.token_ids, request))
        except Exception:  # a prompt the tokenizer cannot take: route without keys
            return PromptIds(None)
