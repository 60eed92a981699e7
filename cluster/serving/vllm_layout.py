"""Moving KV between raykv pages and vLLM's paged blocks: the vLLM-facing side of
cluster/core/kv_layout.py (pure torch: no vLLM import, no Ray).

    raykv  kv[layer, plane, head, token, :]     [L, 2, H, N, D]   plane 0 = K, 1 = V
    vLLM   caches[layer][block, head, slot, :]  L x [num_blocks, H, B, C], any stride order

vLLM 0.32 hands the connector one [B, H, N, C] view per layer, over one allocation laid out as
a KVCacheLayout member (layer-compact or cross-layer); kv_layout reads the views' strides, so
every member works, as does anything else with the same logical shape. What this module adds:

- which cells raykv moves (`cell_elems`): C = 2 x head_size for the model's dtype and for fp8
  with per-tensor scales (fp8, fp8_e4m3, fp8_e5m2); 2 x (head_size + 4 / element size) for
  int8_per_token_head and fp8_per_token_head, whose fp32 scales sit after each plane's data
  and travel inside the page; head_size for MLA's latent (its halves become planes 0 and 1,
  so the page is [L, 2, 1, N, latent / 2]). Anything else (nvfp4, turboquant, fp8_ds_mla, int4,
  MLA with per-token-head scales) is a LayoutError: the connector turns itself off.
- which block interior: the GPU backends split a cell in two (K | V); vLLM's CPU backend keeps
  a (block, head) as K then V, with K transposed by its "vec" kernels. The connector probes
  the CPU cache op for it (RaykvConnector's probe_layout) and `probed_interior` reads the
  answer.

The functions below keep the signatures the worker side (cluster/serving/vllm_io.py) calls:
`layers` is the CacheView that register_kv_caches built and `layout` its KVLayout. A plain list
of CPU-backend layers with a BlockLayout (the earlier spelling) is described on the fly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cluster.core.kv_layout import (
    CacheView,
    Interior,
    KVLayout,
    LayoutError,
    describe_caches,
)

__all__ = ["BlockLayout", "CacheFormat", "CacheView", "Interior", "KVLayout", "LayoutError",
           "block_tokens", "blocks_of", "blocks_to_kv", "cell_elems", "describe_worker",
           "kv_to_blocks", "probed_interior", "spec_mismatch"]

PLAIN_CACHE_DTYPES = frozenset({"auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3",
                                "fp8_e5m2"})
SCALED_CACHE_DTYPES = frozenset({"int8_per_token_head", "fp8_per_token_head"})
SCALE_BYTES = 4  # one fp32 scale per (token, head, plane) in the per-token-head formats
CPU_ATTENTION = "CPU_ATTN"  # vLLM's CPU attention backend: K and V per (block, head), K probed


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The CPU backend's block interior, as the connector first named it: K stored [D, B]
    (transposed, the "vec" kernels) or [B, D]."""

    key_transposed: bool

    @property
    def interior(self) -> Interior:
        return Interior.CPU_KEY_TRANSPOSED if self.key_transposed else Interior.CPU_KEY_ROWS


@dataclass(frozen=True, slots=True)
class CacheFormat:
    """What vLLM's config says about one worker's KV cells."""

    cache_dtype: str
    head_size: int
    use_mla: bool


def cell_elems(cache_format: CacheFormat, element_bytes: int) -> int:
    """C of vLLM's [B, H, N, C] in this format; LayoutError for a format raykv does not move."""
    dtype, head_size = cache_format.cache_dtype, cache_format.head_size
    if dtype in PLAIN_CACHE_DTYPES:
        return head_size if cache_format.use_mla else 2 * head_size
    if dtype in SCALED_CACHE_DTYPES and not cache_format.use_mla:
        return 2 * (head_size + SCALE_BYTES // element_bytes)
    known = sorted(PLAIN_CACHE_DTYPES | SCALED_CACHE_DTYPES)
    raise LayoutError(f"KV cache dtype {dtype!r}{' with MLA' if cache_format.use_mla else ''}"
                      f" is not one raykv moves (it moves {', '.join(known)})")


def describe_worker(layers: Sequence[torch.Tensor], cache_format: CacheFormat,
                    backends: set[str], probe: Callable[[torch.Tensor], Interior | None]
                    ) -> CacheView:
    """The worker's caches (in layer order) as a CacheView. `backends` names the layers'
    attention backends: vLLM's CPU backend (CPU_ATTN) keeps its own block interior, which
    `probe` finds out (None: unknown); every other backend splits its cells. LayoutError says
    why raykv cannot move the caches."""
    if not layers:
        raise LayoutError("vLLM registered no KV cache layers")
    first = layers[0]
    if first.dim() != 4:
        raise LayoutError(f"a layer's cache is {tuple(first.shape)}; vLLM 0.32 hands "
                          f"[blocks, heads, block_size, cell] views")
    want = cell_elems(cache_format, first.element_size())
    if first.shape[3] != want:
        raise LayoutError(f"cells of {first.shape[3]} elements; {cache_format} has {want}")
    if CPU_ATTENTION not in backends:
        return describe_caches(list(layers), Interior.SPLIT_CELL)
    if not first.is_floating_point():
        raise LayoutError(f"vLLM's CPU backend with a {cache_format.cache_dtype} KV cache: "
                          f"its quantized block layout is not probed")
    interior = probe(first)
    if interior is None:
        raise LayoutError("vLLM's CPU cache op writes a block layout raykv does not know")
    return describe_caches(list(layers), interior)


def spec_mismatch(layout: KVLayout, page_shape: tuple[int, ...], element_bytes: int) -> str:
    """Why raykv pages of page_shape [L, 2, H, T, D] (element_bytes each) cannot hold these
    caches' blocks of T tokens ("" when they can)."""
    want = layout.page_shape(layout.block_size)
    if tuple(page_shape) != want or element_bytes != layout.element_bytes:
        return (f"the caches fill pages {list(want)} of {layout.element_bytes}-byte elements, "
                f"raykv's are {list(page_shape)} of {element_bytes}-byte elements")
    return ""


def probed_interior(scratch: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor) -> Interior | None:
    """Which CPU interior reads back what vLLM's cache op wrote: `scratch` is one block
    [1, H, B, C] holding keys and values [B, H, D] at slots 0..B-1 (None unless exactly one)."""
    block_size = scratch.shape[2]
    fits = []
    for interior in (Interior.CPU_KEY_TRANSPOSED, Interior.CPU_KEY_ROWS):
        view = describe_caches([scratch], interior)
        page = torch.zeros(view.page_shape(block_size), dtype=scratch.dtype)
        view.gather([0], (0, block_size), page)
        if torch.equal(page[0, 0], keys.transpose(0, 1)) and torch.equal(
                page[0, 1], values.transpose(0, 1)):
            fits.append(interior)
    return fits[0] if len(fits) == 1 else None


def _view(layers: CacheView | Sequence[torch.Tensor],
          layout: KVLayout | BlockLayout | None) -> CacheView:
    if isinstance(layers, CacheView):
        return layers
    if isinstance(layout, BlockLayout | KVLayout):
        return describe_caches(list(layers), layout.interior)
    raise LayoutError(f"no layout to read {len(layers)} layers with")


def block_tokens(layers: CacheView | Sequence[torch.Tensor]) -> int:
    """B, the tokens per block of vLLM's caches [num_blocks, H, B, C]."""
    if isinstance(layers, CacheView):
        return layers.layout.block_size
    return layers[0].shape[2]


def kv_to_blocks(kv: torch.Tensor, layers: CacheView | Sequence[torch.Tensor],
                 layout: KVLayout | BlockLayout | None, block_ids: list[int],
                 token_range: tuple[int, int]) -> None:
    """Write tokens [start, end) of kv [L, 2, H, >=end, D] into the request's blocks."""
    _view(layers, layout).scatter(kv, block_ids, token_range)


def blocks_to_kv(layers: CacheView | Sequence[torch.Tensor],
                 layout: KVLayout | BlockLayout | None, block_ids: list[int], num_tokens: int,
                 out: torch.Tensor) -> torch.Tensor:
    """Read tokens [0, num_tokens) of the request's blocks into out [L, 2, H, >=num_tokens, D];
    returns out[:, :, :, :num_tokens]."""
    _view(layers, layout).gather(block_ids, (0, num_tokens), out)
    return out[:, :, :, :num_tokens]


def blocks_of(token_range: tuple[int, int], block_ids: list[int], block_size: int) -> set[int]:
    """The block ids holding tokens [start, end)."""
    start, end = token_range
    return {block_ids[index] for index in range(start // block_size, -(-end // block_size))}
