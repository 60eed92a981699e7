"""Choosing the next token, and where a generation stops.

Greedy by default (temperature 0); temperature, nucleus (top_p) and a seed are honoured, and a
seeded request samples the same tokens whatever replica runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_STOP_STRINGS = 4


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


class Sampler:
    """Next-token choice for one request; `mask` (additive) rules ids out."""

    def __init__(self, params: SamplingParams, mask: torch.Tensor):
        self.params = params
        self.mask = mask
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def next(self, logits: torch.Tensor) -> int:
        logits = logits.float() + self.mask[: logits.shape[-1]]
        if self.params.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            probs = _nucleus(probs, self.params.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely ids whose mass reaches top_p; renormalize."""
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the ids ahead
    sorted_probs[before >= top_p] = 0.0
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()


class StopText:
    """Text released to the client as it is generated, minus any stop string.

    Text that could still turn into a stop string is held back until it cannot.
    """

    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)
        self.hold_chars = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.released = 0
        self.stopped = False

    def push(self, delta: str) -> str:
        """New text -> what may be sent now ("" while held back or after a stop)."""
        if self.stopped:
            return ""
        self.text += delta
        hits = [i for i in (self.text.find(s, max(0, self.released - self.hold_chars))
                            for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(min(hits))
        return self._release(len(self.text) - self.hold_chars)

    def finish(self) -> str:
        """Whatever is still held back, at the end of the generation."""
        return "" if self.stopped else self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.released:
            return ""
        out, self.released = self.text[self.released : upto], upto
        return out
