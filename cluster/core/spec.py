"""Model geometry: how many bytes of KV a token and a page cost.

Pure: no Ray, no torch import at module load (torch dtypes resolve lazily).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Element sizes of the dtypes a KV cache is stored in. fp8/int8 are quantized formats.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "int8": 1,
}
# A quantized (fp8/int8) page keeps one float32 scale per (layer, K or V, kv head).
SCALE_BYTES = 4
DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "float8_e4m3fn": "fp8",
    "e4m3": "fp8",
}


def canonical_dtype(dtype: object) -> str:
    """Return the canonical dtype name for a string or a torch dtype; ValueError if unknown."""
    name = str(dtype).removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    return name


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The KV geometry of one model.

    KV bytes per token = 2 (K and V) x num_layers x num_kv_heads x head_dim x element bytes.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("ModelSpec.name must be a non-empty string")
        for field in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelSpec.{field} must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def page_bytes(self, page_tokens: int) -> int:
        """Bytes of one full page of `page_tokens` tokens."""
        if page_tokens <= 0:
            raise ValueError(f"page_tokens must be positive, got {page_tokens}")
        return self.bytes_per_token * page_tokens

    def page_shape(self, page_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of one page: [num_layers, 2, num_kv_heads, page_tokens, head_dim]."""
        return (self.num_layers, 2, self.num_kv_heads, page_tokens, self.head_dim)

    def with_dtype(self, dtype: object) -> ModelSpec:
        return dataclasses.replace(self, dtype=canonical_dtype(dtype))

    def torch_dtype(self):
        """The torch dtype of this spec's KV tensors."""
        import torch

        return {
            "float32": torch.float32,
            "float16": torch.float16,
            "bfloat16": torch.bfloat16,
            "fp8": torch.float8_e4m3fn,
            "int8": torch.int8,
        }[self.dtype]

    def canonical_bytes(self) -> bytes:
        """Stable bytes naming this geometry; part of every page key's namespace."""
        return (
            f"{self.name}|{self.num_layers}|{self.num_kv_heads}|{self.head_dim}|{self.dtype}"
        ).encode()

    @staticmethod
    def preset(name: str, dtype: str | None = None) -> ModelSpec:
        """A known model's geometry, e.g. ModelSpec.preset("llama-3.1-8b")."""
        key = name.lower()
        if key not in PRESETS:
            raise ValueError(f"unknown model {name!r}; known presets: {', '.join(sorted(PRESETS))}")
        spec = PRESETS[key]
        return spec.with_dtype(dtype) if dtype else spec


# Geometry from the models' published configs (GQA: num_key_value_heads < attention heads).
PRESETS: dict[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", 32, 8, 128, "bfloat16"),
    "llama-3.1-70b": ModelSpec("llama-3.1-70b", 80, 8, 128, "bfloat16"),
    "llama-3.1-405b": ModelSpec("llama-3.1-405b", 126, 8, 128, "bfloat16"),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 28, 4, 128, "bfloat16"),
    "qwen2.5-72b": ModelSpec("qwen2.5-72b", 80, 8, 128, "bfloat16"),
    "mistral-7b": ModelSpec("mistral-7b", 32, 8, 128, "bfloat16"),
    # The tiny Llama that tests and the demo build from a config with random weights.
    "tiny-llama": ModelSpec("tiny-llama", 2, 2, 16, "float32"),
    # A small one for the demo: prefill costs more than fetching its KV, as with real models.
    "small-llama": ModelSpec("small-llama", 4, 2, 64, "float32"),
}
