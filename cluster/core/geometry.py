"""Page geometry: the shape and dtype of one page, which fixes its size in bytes."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from cluster.core.spec import DTYPE_BYTES, ModelSpec
from cluster.core.tiers.aligned import round_up

TIER_NAMES = ("device", "host", "disk")
DEVICE, HOST, DISK = 0, 1, 2


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """One page: [num_layers, 2, num_kv_heads, page_tokens, head_dim] of `dtype`."""

    shape: tuple[int, int, int, int, int]
    dtype: str

    @staticmethod
    def of(spec: ModelSpec, page_tokens: int) -> PageGeometry:
        return PageGeometry(spec.page_shape(page_tokens), spec.dtype)

    def validate(self) -> None:
        """ValueError unless the shape is 5 positive ints and the dtype a known one (a
        geometry can arrive from any client)."""
        shape = self.shape
        if (not isinstance(shape, tuple) or len(shape) != 5
                or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape)):
            raise ValueError(f"page shape must be 5 positive ints, got {shape!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown page dtype {self.dtype!r}; expected one of "
                             f"{sorted(DTYPE_BYTES)}")

    @property
    def page_bytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]

    @property
    def slot_bytes(self) -> int:
        """Page bytes rounded up to 4096, so slots suit O_DIRECT and huge pages."""
        return round_up(self.page_bytes)

    @property
    def name(self) -> str:
        return "x".join(map(str, self.shape)) + "-" + self.dtype

    def torch_dtype(self):
        return _torch_dtype(self.dtype)


@functools.cache
def _torch_dtype(dtype: str):
    return ModelSpec("g", 1, 1, 1, dtype).torch_dtype()
