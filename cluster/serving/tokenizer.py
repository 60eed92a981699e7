"""A byte-level tokenizer: any text round-trips, nothing is downloaded.

    ids 0..255   the UTF-8 bytes of the text
    256          BOS, prepended to every prompt
    257          EOS, ends a generation

The random-weight model's vocabulary is larger; sampling is restricted to printable ASCII,
newline and EOS (see `text_token_mask`), so a random model's output is still readable text.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

import torch

BOS_ID = 256
EOS_ID = 257
NUM_TEXT_IDS = 258

# A simple chat template: role headers between messages, then the assistant's header.
ROLE_HEADER = "<|{role}|>\n"
TURN_END = "\n"
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str


def encode(text: str) -> list[int]:
    """BOS followed by the text's UTF-8 bytes."""
    return [BOS_ID, *text.encode("utf-8")]


def apply_chat_template(messages: list[Message]) -> str:
    """The prompt text of a chat: each message under its role header, then the assistant's."""
    parts = [ROLE_HEADER.format(role=m.role) + m.content + TURN_END for m in messages]
    return "".join(parts) + ROLE_HEADER.format(role="assistant")


def text_token_mask(vocab_size: int) -> torch.Tensor:
    """Additive logits mask: 0 for printable ASCII, newline and EOS, -inf elsewhere."""
    mask = torch.full((vocab_size,), float("-inf"))
    mask[32:127] = 0.0
    mask[ord("\n")] = 0.0
    mask[EOS_ID] = 0.0
    return mask


class StreamDecoder:
    """Decodes generated ids to text incrementally: a multi-byte character split across
    tokens comes out whole, and invalid bytes become U+FFFD rather than an error."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id >= 256:
            return ""
        return self._decoder.decode(bytes([token_id]))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def decode(token_ids: list[int]) -> str:
    return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")
