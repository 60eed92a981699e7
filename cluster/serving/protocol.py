"""OpenAI's HTTP shapes, as far as raykv serves them: requests, responses, stream chunks,
usage (with prompt_tokens_details.cached_tokens) and errors."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.serving.sampling import MAX_STOP_STRINGS, SamplingParams

MAX_TOKENS_LIMIT = 4096


NULL_MEANS_DEFAULT = ("temperature", "top_p", "n", "stream")  # OpenAI allows null for these
# Asked for, these change what the answer holds; this server has none of them (a null, a
# false, an empty list or a 0 ask for nothing and pass).
UNSUPPORTED = {"logprobs": bool, "top_logprobs": bool, "echo": bool, "tools": bool,
               "suffix": bool, "best_of": lambda value: value not in (None, 1)}


class _Request(BaseModel):
    # Unknown fields (logprobs, presence_penalty, ...) are accepted and ignored, as OpenAI
    # clients send some by default.
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """A JSON null (the openai client's None) stands for the field's default; a feature
        this server cannot give is refused by name rather than silently left out (a client
        reading `.logprobs.content` would otherwise fail on a null)."""
        if not isinstance(data, dict):
            return data
        for name, wanted in UNSUPPORTED.items():
            if wanted(data.get(name)):
                raise ValueError(f"{name} is not supported by this server")
        return {k: v for k, v in data.items() if not (k in NULL_MEANS_DEFAULT and v is None)}

    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 63) - 1)  # torch's generator: int64
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, ge=1, le=1)
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is not None and len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return stops

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        return SamplingParams(max_tokens, self.temperature, self.top_p, self.seed,
                              tuple(self.stop or ()))


class CompletionRequest(_Request):
    # Text, or token ids (OpenAI takes both, and a list of either: one prompt here).
    prompt: str | list[str] | list[int] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        """One prompt: text, ids, or a list of exactly one of them; never an empty one."""
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("exactly one prompt per request is supported")
            value = value[0]
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        return value

    def token_ids(self) -> list[int] | None:
        """The prompt as token ids, when it came as ids (None: it is text)."""
        return self.prompt if isinstance(self.prompt, list) else None

    def text(self) -> str:
        """The prompt as text ("" when it came as token ids)."""
        return self.prompt if isinstance(self.prompt, str) else ""


class ContentPart(BaseModel):
    """One part of a message's content: the text ones are kept (images and the rest are
    accepted and ignored, as this app serves text)."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = ""

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def completion_body(request_id: str, model: str, text: str, finish: str | None,
                    use: dict | None, created: int | None = None) -> dict:
    body = {"id": request_id, "object": "text_completion", "created": created or int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if use is not None:
        body["usage"] = use
    return body


def chat_body(request_id: str, model: str, text: str, finish: str | None,
              use: dict | None) -> dict:
    body = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "finish_reason": finish, "logprobs": None,
                         "message": {"role": "assistant", "content": text}}]}
    if use is not None:
        body["usage"] = use
    return body


def chat_chunk(request_id: str, model: str, delta: dict, finish: str | None,
               use: dict | None, created: int | None = None) -> dict:
    """One chunk of a chat stream; `created`: the stream's (one value for all its chunks)."""
    body = {"id": request_id, "object": "chat.completion.chunk",
            "created": created or int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish}]}
    if use is not None:
        body["usage"] = use
    return body


def error_body(message: str, kind: str, code: str | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
