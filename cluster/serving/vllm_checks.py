"""What RaykvConnector asks of vLLM before it keys or moves a worker's KV: whether the model's
KV-cache groups are ones raykv can key (`unsupported_groups`), and where vLLM's CPU cache op
puts K and V inside a block (`probe_layout`, read by vllm_layout.describe_worker). Both import
vLLM, so the connector's engine process is their only caller."""

from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger

from cluster.serving.vllm_layout import Interior, probed_interior

log = init_logger(__name__)  # vLLM's handlers: these lines land in the engine's log


def unsupported_groups(kv_cache_config: Any) -> str | None:
    """Why raykv cannot key this model's KV-cache groups, or None: one group of full
    attention (or MLA) layers. Several groups (hybrid, sliding-window) share one request's
    block ids per group, and a window frees blocks raykv would read."""
    if kv_cache_config is None:
        return None
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return (f"the model has {len(groups)} KV-cache groups (hybrid or sliding-window "
                f"attention); raykv supports one group of full-attention layers")
    kind = type(groups[0].kv_cache_spec)
    if kind not in (FullAttentionSpec, MLAAttentionSpec):
        return f"the model's KV cache is {kind.__name__}; raykv supports full attention"
    if getattr(groups[0].kv_cache_spec, "non_causal", False):
        # A prefix-LM's prefix attends both ways: its KV depends on the tokens after it, so
        # no prefix's pages stand for another prompt's (vLLM turns its own prefix cache off)
        return "the model attends non-causally (a prefix LM); raykv's pages need causal KV"
    return None


def probe_layout(layer: torch.Tensor) -> Interior | None:
    """Where vLLM's CPU cache op puts K and V in a block like `layer`'s [blocks, H, B, C]: it
    writes one scratch block of distinct values, and the CPU interior that reads them back is
    the answer (None: none or both do, or the op is missing)."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        _, num_heads, block_size, cell = layer.shape
        head_dim = cell // 2
        scratch = torch.zeros((1, num_heads, block_size, cell), dtype=layer.dtype)
        keys, values = scratch.view(1, num_heads, 2 * block_size, head_dim).chunk(2, dim=2)
        known = (torch.arange(block_size * num_heads * head_dim) % 251 + 1).view(
            block_size, num_heads, head_dim).to(layer.dtype)
        ops.cpu_attn_reshape_and_cache(known, -known, keys, values, torch.arange(block_size),
                                       _get_attn_isa(layer.dtype, block_size, head_dim))
    except Exception:  # not vLLM's CPU backend, or its internals moved
        log.exception("could not probe vLLM's KV block layout")
        return None
    return probed_interior(scratch, known, -known)
