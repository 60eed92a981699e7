"""The tiny real transformers model that tests and the demo run; built from a config, never
downloaded, with seeded random weights.

KV moves between transformers' DynamicCache (per layer [1, H, N, D] keys and values) and raykv's
layout [num_layers, 2, num_kv_heads, num_tokens, head_dim]. Pure: no Ray.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from cluster.core.spec import ModelSpec

TINY_VOCAB = 512
TINY_MAX_POSITIONS = 16384  # RoPE has no learned positions: this is only a limit
# Wider than Llama's 0.02 so that random logits have a clear top-1 instead of a near tie.
TINY_INIT_STD = 0.1


@dataclass(frozen=True, slots=True)
class Shape:
    """What a ModelSpec does not say: the rest of a Llama's architecture."""

    hidden: int
    attention_heads: int  # GQA: attention_heads / num_kv_heads query heads per kv head
    intermediate: int


# Keyed by ModelSpec preset. "tiny-llama" is what tests run; "small-llama" is big enough that
# its prefill costs more than fetching its cached KV, as a real model's does.
SHAPES: dict[str, Shape] = {
    "tiny-llama": Shape(hidden=64, attention_heads=4, intermediate=128),
    "small-llama": Shape(hidden=512, attention_heads=8, intermediate=1536),
}

# transformers renamed the forward's `past_key_values` to `cache` (and the output field with it).
CACHE_ARG = (
    "cache"
    if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
    else "past_key_values"
)


def build_llama(preset: str, seed: int = 0) -> tuple[LlamaForCausalLM, ModelSpec]:
    """A random-weight Llama of a raykv preset's geometry (see SHAPES), eval mode.

    The same seed gives the same weights; the global torch RNG is left as it was.
    """
    if preset not in SHAPES:
        raise ValueError(f"no Llama shape for {preset!r}; known: {sorted(SHAPES)}")
    spec, shape = ModelSpec.preset(preset), SHAPES[preset]
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=shape.attention_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=TINY_MAX_POSITIONS,
        initializer_range=TINY_INIT_STD,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(spec.torch_dtype()).eval()
    return model, spec


def prefill(
    model: LlamaForCausalLM, tokens: list[int] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the whole prompt (batch 1): last-position logits [vocab] and its KV [L, 2, H, N, D]."""
    input_ids = _input_ids(model, tokens)
    logits, cache = _forward(model, input_ids, DynamicCache(config=model.config), 0)
    return logits, kv_from_cache(cache)


def continue_from(
    model: LlamaForCausalLM, kv_prefix: torch.Tensor, tokens: list[int] | torch.Tensor
) -> torch.Tensor:
    """Last-position logits of `tokens` from the KV of its first P tokens; runs only tokens[P:]."""
    input_ids = _input_ids(model, tokens)
    num_prefix_tokens = kv_prefix.shape[3] if kv_prefix.dim() == 5 else -1
    if not 0 <= num_prefix_tokens < input_ids.shape[1]:
        raise ValueError(
            f"kv_prefix must cover fewer tokens than the {input_ids.shape[1]} given, "
            f"got shape {tuple(kv_prefix.shape)}"
        )
    cache = cache_from_kv(kv_prefix, model)
    logits, _ = _forward(model, input_ids[:, num_prefix_tokens:], cache, num_prefix_tokens)
    return logits


def prefill_from(
    model: LlamaForCausalLM, kv_prefix: torch.Tensor | None, tokens: list[int] | torch.Tensor
) -> tuple[torch.Tensor, DynamicCache]:
    """(last-position logits, the cache of all `tokens`), running only the tokens past the P
    that `kv_prefix` [L, 2, H, P, D] covers (None: all of them). P must be < len(tokens)."""
    input_ids = _input_ids(model, tokens)
    if kv_prefix is None:
        return _forward(model, input_ids, DynamicCache(config=model.config), 0)
    num_prefix_tokens = kv_prefix.shape[3]
    if not 0 <= num_prefix_tokens < input_ids.shape[1]:
        raise ValueError(f"kv_prefix covers {num_prefix_tokens} tokens; it must cover fewer "
                         f"than the {input_ids.shape[1]} given")
    cache = cache_from_kv(kv_prefix, model)
    return _forward(model, input_ids[:, num_prefix_tokens:], cache, num_prefix_tokens)


def decode_step(model: LlamaForCausalLM, cache: DynamicCache, token: int,
                position: int) -> torch.Tensor:
    """Logits after appending one token at `position` to `cache` (which grows by one)."""
    logits, _ = _forward(model, _input_ids(model, [token]), cache, position)
    return logits


def kv_from_cache(cache: DynamicCache) -> torch.Tensor:
    """A batch-1 DynamicCache as one tensor [num_layers, 2, num_kv_heads, num_tokens, head_dim]."""
    return stack_views(prefix_views(cache, cache.get_seq_length()))


def prefix_views(cache: DynamicCache, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (keys, values) of a batch-1 cache's first `num_tokens` positions as views,
    with no copy: cheap on any thread, and still those positions' KV after the cache grows
    (growing appends to new tensors and never rewrites an earlier position)."""
    layers = cache.layers
    assert layers and all(layer.keys.shape[0] == 1 for layer in layers), "expected a batch-1 cache"
    assert num_tokens <= layers[0].keys.shape[2], "more tokens than the cache holds"
    return [(layer.keys[0, :, :num_tokens], layer.values[0, :, :num_tokens]) for layer in layers]


def stack_views(views: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """prefix_views' tensors as one [num_layers, 2, num_kv_heads, num_tokens, head_dim] (a copy:
    run it on the thread that runs the model, see engine.py)."""
    return torch.stack([torch.stack(pair) for pair in views])


def cache_from_kv(kv: torch.Tensor, model: LlamaForCausalLM) -> DynamicCache:
    """A fresh DynamicCache holding a copy of `kv` [L, 2, H, N, D], on the model's device."""
    config = model.config
    expected = (config.num_hidden_layers, 2, config.num_key_value_heads, config.head_dim)
    if kv.dim() != 5 or (*kv.shape[:3], kv.shape[4]) != expected:
        raise ValueError(
            f"kv must be [L, 2, H, N, D] with (L, 2, H, D) = {expected}, got {tuple(kv.shape)}"
        )
    if kv.dtype != model.dtype:
        raise ValueError(f"kv dtype {kv.dtype} does not match the model's {model.dtype}")
    kv = kv.to(model.device)
    cache = DynamicCache(config=config)
    for layer_idx in range(kv.shape[0]):
        cache.update(kv[layer_idx, 0].unsqueeze(0), kv[layer_idx, 1].unsqueeze(0), layer_idx)
    return cache


def _input_ids(model: LlamaForCausalLM, tokens: list[int] | torch.Tensor) -> torch.Tensor:
    input_ids = torch.as_tensor(tokens)
    if input_ids.dim() != 1 or input_ids.numel() == 0:
        raise ValueError(
            f"tokens must be a non-empty 1-D sequence, got shape {tuple(input_ids.shape)}"
        )
    if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
        raise TypeError(f"tokens must be integers, got dtype {input_ids.dtype}")
    return input_ids.to(device=model.device, dtype=torch.long).unsqueeze(0)


def _forward(
    model: LlamaForCausalLM, input_ids: torch.Tensor, cache: DynamicCache, start_position: int
) -> tuple[torch.Tensor, DynamicCache]:
    """One batch-1 forward that extends `cache`; positions start at `start_position`."""
    num_tokens = input_ids.shape[1]
    position_ids = torch.arange(
        start_position, start_position + num_tokens, device=input_ids.device
    )
    with torch.inference_mode():
        output = model(
            input_ids=input_ids,
            position_ids=position_ids.unsqueeze(0),
            use_cache=True,
            logits_to_keep=1,
            **{CACHE_ARG: cache},
        )
    # A clone outside inference mode is an ordinary tensor that callers may update in place.
    return output.logits[0, -1].clone(), getattr(output, CACHE_ARG)
