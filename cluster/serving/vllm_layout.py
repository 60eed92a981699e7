"""Moving KV between raykv's layout and vLLM's CPU paged blocks (pure torch: no vLLM, no Ray).

    raykv  kv[layer, k_or_v, head, token, :]          [L, 2, H, N, D]
    vLLM   layers[layer][block]                       L x [num_blocks, H, B, 2*D] (CPU)

The shape of vLLM's CPU cache hides its layout. Its attention kernel views each block as
[H, 2*B, D] and splits it in two: every (block, head) holds B*D elements of K, then B*D of V.
V is token-major, [B, D]. K is stored as the kernel reads it: with the "vec" kernels (float32
here), transposed, [D, B]. The connector asks vLLM's own cache op where it writes (see
RaykvConnector.register_kv_caches) and describes the answer as a BlockLayout.

Token t of a request lives in block block_ids[t // B] at offset t % B, and heads keep their
order, so a block maps onto a token range of kv with one copy per (layer, block, K or V). V is
copied in runs of D elements; a transposed K is a real transpose (B x D elements per head).
`raykv bench vllm` measures both against a plain memcpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Where one (block, head) of vLLM's cache keeps K: [D, B] (transposed) or [B, D]."""

    key_transposed: bool


def block_tokens(layers: list[torch.Tensor]) -> int:
    """B, the tokens per block of vLLM's per-layer caches [num_blocks, H, B, 2*D]."""
    return layers[0].shape[2]


def check_layers(layers: list[torch.Tensor], shape: tuple[int, int, int, int, int],
                 dtype: torch.dtype) -> str | None:
    """Why vLLM's caches do not fit raykv pages of `shape` [L, 2, H, T, D], or None if they do."""
    num_layers, _, num_heads, _, head_dim = shape
    if len(layers) != num_layers:
        return f"{len(layers)} KV layers, the model has {num_layers}"
    for layer in layers:
        if layer.dim() != 4 or layer.shape[1] != num_heads or layer.shape[3] != 2 * head_dim:
            return (f"a layer's cache is {tuple(layer.shape)}, expected [num_blocks, "
                    f"{num_heads}, block_size, {2 * head_dim}] (vLLM's CPU layout)")
        if layer.dtype != dtype:
            return f"cache dtype {layer.dtype}, raykv pages are {dtype}"
        if not layer[0].is_contiguous():
            return "a block of a layer's cache is not contiguous"
    return None


def planes(layer: torch.Tensor, block_id: int, layout: BlockLayout):
    """(K, V) of one block as [H, B, D] views (K a transposed view when stored [D, B])."""
    num_heads, block_size, width = layer.shape[1:]
    head_dim = width // 2
    halves = layer[block_id].view(num_heads, 2, block_size * head_dim)
    values = halves[:, 1].view(num_heads, block_size, head_dim)
    if layout.key_transposed:
        return halves[:, 0].view(num_heads, head_dim, block_size).transpose(1, 2), values
    return halves[:, 0].view(num_heads, block_size, head_dim), values


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src through numpy (memcpy speed, no OpenMP stalls on shared cores; see
    cluster/core/copies.py); torch for the dtypes numpy lacks."""
    if dst.dtype in (torch.float32, torch.float16):
        np.copyto(dst.detach().numpy(), src.detach().numpy())
    else:
        dst.copy_(src)


def _block_runs(block_ids: list[int], block_size: int, start: int, end: int):
    """(block id, first offset, last offset + 1, first token) per block touching [start, end)."""
    for index in range(start // block_size, -(-end // block_size)):
        first_token = index * block_size
        low, high = max(start, first_token), min(end, first_token + block_size)
        yield block_ids[index], low - first_token, high - first_token, low


def kv_to_blocks(kv: torch.Tensor, layers: list[torch.Tensor], layout: BlockLayout,
                 block_ids: list[int], token_range: tuple[int, int]) -> None:
    """Write tokens [start, end) of kv [L, 2, H, >=end, D] into the request's blocks."""
    start, end = token_range
    for block_id, low, high, first in _block_runs(block_ids, block_tokens(layers), start, end):
        tokens = slice(first, first + high - low)
        for index, layer in enumerate(layers):
            keys, values = planes(layer, block_id, layout)
            _copy(keys[:, low:high], kv[index, 0, :, tokens])
            _copy(values[:, low:high], kv[index, 1, :, tokens])


def blocks_to_kv(layers: list[torch.Tensor], layout: BlockLayout, block_ids: list[int],
                 num_tokens: int, out: torch.Tensor) -> torch.Tensor:
    """Read tokens [0, num_tokens) of the request's blocks into out [L, 2, H, >=num_tokens, D];
    returns out[:, :, :, :num_tokens]."""
    for block_id, low, high, first in _block_runs(block_ids, block_tokens(layers), 0,
                                                  num_tokens):
        tokens = slice(first, first + high - low)
        for index, layer in enumerate(layers):
            keys, values = planes(layer, block_id, layout)
            _copy(out[index, 0, :, tokens], keys[:, low:high])
            _copy(out[index, 1, :, tokens], values[:, low:high])
    return out[:, :, :, :num_tokens]


def blocks_of(token_range: tuple[int, int], block_ids: list[int], block_size: int) -> set[int]:
    """The block ids holding tokens [start, end)."""
    start, end = token_range
    return {block_id for block_id, *_ in _block_runs(block_ids, block_size, start, end)}
