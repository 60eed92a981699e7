"""The operator API over HTTP: the bodies of the ingress's admin endpoints.

    POST /v1/raykv/admin/pin     {"namespace", prompt | messages | tokens, "ttl_s"}
    POST /v1/raykv/admin/unpin   {"namespace", prompt | messages | tokens}
    POST /v1/raykv/admin/warm    {"namespace", prompt | messages | tokens, "node"}

Only the admin key reaches them (cluster/serving/access.py). A prompt is keyed as the
completions endpoint keys it, messages as the chat endpoint does (its template), tokens as
they are: a pin or a warm-up covers exactly the pages those requests will look up.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.core.pins import PinRefused
from cluster.serving import tokenizer
from cluster.serving.protocol import ChatMessage


class PromptBody(BaseModel):
    """Which prompt's pages, in which namespace: exactly one of prompt, messages, tokens."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field("default", min_length=1, max_length=128)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tokens: list[int] | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        given = [v for v in (self.prompt, self.messages, self.tokens) if v is not None]
        if len(given) != 1:
            raise ValueError("give the prompt one way: prompt, messages or tokens")
        if self.tokens is not None and any(t < 0 for t in self.tokens):
            raise ValueError("tokens must be non-negative ids")
        return self

    def token_ids(self) -> list[int]:
        if self.tokens is not None:
            return list(self.tokens)
        if self.messages is not None:
            messages = [tokenizer.Message(m.role, m.text()) for m in self.messages]
            return tokenizer.encode(tokenizer.apply_chat_template(messages))
        return tokenizer.encode(self.prompt)


class PinBody(PromptBody):
    ttl_s: float = Field(gt=0, le=366 * 86400, description="seconds the pin lives")


class WarmBody(PromptBody):
    node: str = Field(min_length=1, max_length=128, description="a node id, or a unique "
                      "prefix of one")


def error_status(error: Exception) -> tuple[int, str]:
    """An operator call's failure as (HTTP status, error code): a pin past a node's cap is a
    409, other bad input a 400, a service that did not answer a 503."""
    if isinstance(error, PinRefused):
        return 409, "pin_cap_exceeded"
    if isinstance(error, ValueError):
        return 400, "invalid_request"
    return 503, "unavailable"
