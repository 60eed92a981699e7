"""KV tensors with known, seeded contents, shared by every test tier."""

from __future__ import annotations

import torch

from cluster.core.spec import ModelSpec


def kv_for(spec: ModelSpec, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """[num_layers, 2, num_kv_heads, num_tokens, head_dim] of seeded normals in spec's dtype."""
    generator = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, 2, spec.num_kv_heads, num_tokens, spec.head_dim)
    return torch.randn(shape, generator=generator).to(spec.torch_dtype())
