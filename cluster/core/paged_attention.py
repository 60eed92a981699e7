"""Decode attention over a KV context one page at a time, with an online softmax.

For one new token, each layer's query heads attend to every token of the context. Pages may
arrive in any order: per (layer, kv head, query head) the state keeps the running max score m,
the running sum of weights l and the weighted sum of values acc, and merges each page in:

    s = q . k / sqrt(head_dim)        for the page's tokens
    m' = max(m, max s)                p = exp(s - m')          c = exp(m - m')
    l' = l c + sum p                  acc' = acc c + p . v     out = acc / l

So an engine can attend to the pages it holds while others are still being read from disk.
A page is [num_layers, 2, num_kv_heads, page_tokens, head_dim]; the query is
[num_layers, num_kv_heads, query_heads_per_kv_head, head_dim] (grouped-query attention).
Pure: no Ray.
"""

from __future__ import annotations

import math

import torch


class OnlineAttention:
    """One token's attention state, fed page by page."""

    def __init__(self, query: torch.Tensor) -> None:
        if query.dim() != 4:
            raise ValueError(f"query must be [layers, kv_heads, group, head_dim], got "
                             f"{tuple(query.shape)}")
        self.query = query.float() / math.sqrt(query.shape[-1])
        state_shape = (*query.shape[:-1], 1)
        self.max = torch.full(state_shape, -math.inf)
        self.sum = torch.zeros(state_shape)
        self.acc = torch.zeros(query.shape)

    def add_page(self, page: torch.Tensor) -> None:
        """Merge one page's keys and values into the state."""
        keys, values = page[:, 0], page[:, 1]
        if page.dtype != torch.float32:  # CPUs compute in float32; bf16 matmuls are slow here
            keys, values = keys.float(), values.float()
        scores = torch.matmul(self.query, keys.transpose(-1, -2))
        new_max = torch.maximum(self.max, scores.amax(dim=-1, keepdim=True))
        weights = scores.sub_(new_max).exp_()
        rescale = torch.exp(self.max - new_max)
        self.sum.mul_(rescale).add_(weights.sum(dim=-1, keepdim=True))
        self.acc.mul_(rescale).add_(torch.matmul(weights, values))
        self.max = new_max

    def output(self) -> torch.Tensor:
        """The attention output, [layers, kv_heads, group, head_dim]."""
        return self.acc / self.sum
