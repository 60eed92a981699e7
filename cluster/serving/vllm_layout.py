"""Moving KV between raykv's layout and vLLM's paged blocks (pure torch: no vLLM, no Ray).

    raykv  kv[layer, k_or_v, head, token, :]              [L, 2, H, N, D]
    vLLM   layers[layer][block, head, offset, k_or_v*D:]   L x [num_blocks, H, B, 2*D]  (CPU)

Token t of a request lives in block block_ids[t // B] at offset t % B. Heads and tokens keep
their order in both layouts, so a block maps onto a token range of kv with one strided copy per
(layer, block): the only reordering is that K and V, side by side in vLLM's last dimension,
are two planes in raykv's. Each (head, token) therefore moves as two runs of D contiguous
elements (256 bytes for D = 64 float32), with no transpose across tokens; `raykv bench vllm`
measures what this costs against a plain memcpy.
"""

from __future__ import annotations

import torch

from cluster.core.copies import copy_page


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
                    f"{num_heads}, block_size, {2 * head_dim}] (K and V packed)")
        if layer.dtype != dtype:
            return f"cache dtype {layer.dtype}, raykv pages are {dtype}"
        if layer.stride(3) != 1:
            return "a layer's last dimension is not contiguous"
    return None


def _block_runs(block_ids: list[int], block_size: int, start: int, end: int):
    """(block id, first offset, last offset + 1, first token) per block touching [start, end)."""
    for index in range(start // block_size, -(-end // block_size)):
        first_token = index * block_size
        low, high = max(start, first_token), min(end, first_token + block_size)
        yield block_ids[index], low - first_token, high - first_token, low


def _kv_view(layer: torch.Tensor, block_id: int, low: int, high: int) -> torch.Tensor:
    """Tokens [low, high) of one block as a [2, H, n, D] view (K plane, V plane)."""
    block = layer[block_id, :, low:high, :]  # [H, n, 2*D]
    return block.unflatten(-1, (2, block.shape[-1] // 2)).permute(2, 0, 1, 3)


def kv_to_blocks(kv: torch.Tensor, layers: list[torch.Tensor], block_ids: list[int],
                 token_range: tuple[int, int]) -> None:
    """Write tokens [start, end) of kv [L, 2, H, >=end, D] into the request's blocks."""
    start, end = token_range
    block_size = block_tokens(layers)
    for block_id, low, high, first in _block_runs(block_ids, block_size, start, end):
        for index, layer in enumerate(layers):
            copy_page(_kv_view(layer, block_id, low, high),
                      kv[index, :, :, first:first + high - low])


def blocks_to_kv(layers: list[torch.Tensor], block_ids: list[int], num_tokens: int,
                 out: torch.Tensor) -> torch.Tensor:
    """Read tokens [0, num_tokens) of the request's blocks into out [L, 2, H, >=num_tokens, D];
    returns out[:, :, :, :num_tokens]."""
    block_size = block_tokens(layers)
    for block_id, low, high, first in _block_runs(block_ids, block_size, 0, num_tokens):
        for index, layer in enumerate(layers):
            copy_page(out[index, :, :, first:first + high - low],
                      _kv_view(layer, block_id, low, high))
    return out[:, :, :, :num_tokens]


def blocks_of(token_range: tuple[int, int], block_ids: list[int], block_size: int) -> set[int]:
    """The block ids holding tokens [start, end)."""
    start, end = token_range
    return {block_id for block_id, *_ in _block_runs(block_ids, block_size, start, end)}
