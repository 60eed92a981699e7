"""A serving engine's paged KV caches described by strides, and block gathers and scatters
between them and raykv pages (pure: torch only; no vLLM, no Ray; runs on CPU or CUDA tensors).

raykv's page is [L, 2, H, T, D]: layer, plane (0 = K, 1 = V), head, token, element.

vLLM 0.32 gives every layer's cache one logical shape, [B, H, N, C] (block, head, token in the
block, cell of C elements), over one allocation whose physical axis order is a member of
`vllm.v1.kv_cache_layout.KVCacheLayout` (LAYOUT_ORDERS below: the permutation of the logical
[L, B, H, N, C] axes, outermost first). A layer-compact member (L outermost) keeps each
layer's blocks together; a cross-layer one (B outermost) keeps each block's layers together.
Either way a layer is a strided 4D view, and this module reads only those strides: it never
asks which member it is (the name is for logs), so any stride order works.

Inside a (block, head), the Interior says where the two planes are:
  SPLIT_CELL          the GPU backends: plane p of token t is cell[t][p*C/2:(p+1)*C/2]
                      (FlashAttention's `kv_cache.transpose(1, 2).split(head_size, -1)`)
  CPU_KEY_TRANSPOSED  vLLM's CPU backend, "vec" kernels: the N*C elements of a (block, head)
  CPU_KEY_ROWS          are K then V, V as [N, D], K as [D, N] (transposed) or [N, D]
The CPU backend's interior is what its cache op writes; the connector probes it.

Cells that are not plain K|V split the same way, byte for byte:
  MLA (one latent per token): the latent's halves are planes 0 and 1 of a [L, 2, 1, T, C/2]
    page, so a page keeps raykv's usual shape.
  fp8 with per-tensor scales (fp8, fp8_e4m3, fp8_e5m2): uint8 cells; the scales live in the
    attention layers, not in the cache.
  per-token-head int8/fp8: each plane is [data (head_size) | fp32 scale (4 bytes)], so the
    page's D is head_size + 4 / element size and the scales travel inside the page.

Gathers and scatters work on strided views of the caches, a tile at a time (up to
STAGING_BYTES of consecutive layers and blocks). On CUDA (BlockCopies.BATCHED): one
index_select / index_copy_ per plane for all the tile's full blocks, a copy_ for a block cut by
the token range, on the view's own stream, ordered after the engine's stream (the one current
when the caches were described) and the caller's, through pinned host staging; the engine's
stream then waits on their event. On CPU the same tiles and views, no stream and no staging,
and the blocks move by np.copyto one block at a time (BlockCopies.PER_BLOCK: faster there, see
its docstring); the tests run both ways on CPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from itertools import pairwise

import numpy as np
import torch

from cluster.core.kv_staging import Stager

# KVCacheLayout member -> physical order of the logical axes (L, B, H, N, C) = (0, 1, 2, 3, 4),
# outermost first (vLLM 0.32's enum values; tests/vllm checks this table against vLLM's).
LAYOUT_ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
STAGING_BYTES = 64 << 20  # the most bytes one tile moves (device scratch, pinned staging)
_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class LayoutError(ValueError):
    """The caches are not something this module can describe (the message says why)."""


class BlockCopies(Enum):
    """How a run of full blocks moves. BATCHED: one index_select / index_copy_ per plane and
    tile (CUDA: one kernel each). PER_BLOCK: np.copyto per block and plane (CPU: memory speed;
    measured here, torch's CPU index_select on a strided 5D view ran at ~0.3 GB/s and its
    OpenMP copies stall on shared cores, while np.copyto per block ran at 3-5 GB/s)."""

    BATCHED = "batched"
    PER_BLOCK = "per-block"


class Interior(Enum):
    """Where planes 0 (K) and 1 (V) sit inside one (block, head); see the module docstring."""

    SPLIT_CELL = "split-cell"
    CPU_KEY_TRANSPOSED = "cpu-key-transposed"
    CPU_KEY_ROWS = "cpu-key-rows"


@dataclass(frozen=True, slots=True)
class PlaneStrides:
    """One plane inside a (layer, block, head), in elements: its start, token and dim strides."""

    offset: int
    token_stride: int
    dim_stride: int


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a worker's caches look like to raykv: geometry and element strides, no tensors.

    layer_stride is None when the layers are separate allocations (not one strided tensor).
    """

    name: str
    interior: Interior
    num_layers: int
    num_blocks: int
    num_heads: int
    block_size: int
    plane_elems: int
    dtype: torch.dtype
    layer_stride: int | None
    block_stride: int
    head_stride: int
    planes: tuple[PlaneStrides, PlaneStrides]

    def page_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """The raykv page [L, 2, H, T, D] that holds num_tokens tokens of these caches."""
        return (self.num_layers, 2, self.num_heads, num_tokens, self.plane_elems)

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def order_strides(order: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides, in logical axis order, of a dense tensor of `shape` (logical order)
    whose physical axis order is `order` (outermost first): vLLM's compute_layout_strides."""
    strides, current = [0] * len(shape), 1
    for axis in reversed(order):
        strides[axis] = current
        current *= shape[axis]
    return tuple(strides)


def allocate(name: str, shape: Sequence[int], dtype: torch.dtype,
             device: str | torch.device = "cpu") -> torch.Tensor:
    """A [L, B, H, N, C] cache laid out as KVCacheLayout member `name`, over one flat buffer,
    as vLLM's allocate_kv_cache makes it; tensor[l] is layer l's view (test and check helper)."""
    flat = torch.zeros(int(torch.tensor(shape).prod()), dtype=dtype, device=device)
    return flat.as_strided(tuple(shape), order_strides(LAYOUT_ORDERS[name], shape))


def layout_name(layer: torch.Tensor, layer_stride: int | None) -> str:
    """The KVCacheLayout member whose order these strides follow ("strided" if none). Axes of
    size 1 are left out: their stride says nothing."""
    sizes = (2 if layer_stride is not None else 1, *layer.shape)
    strides = (layer_stride if layer_stride is not None else layer.numel(), *layer.stride())
    axes = [axis for axis in range(5) if sizes[axis] > 1 or axis == 0]
    physical = sorted(axes, key=lambda axis: (-strides[axis], axis))
    for name, order in LAYOUT_ORDERS.items():
        if [axis for axis in order if axis in axes] == physical:
            return name
    return "strided"


def plane_strides(layer: torch.Tensor, interior: Interior) -> tuple[PlaneStrides, PlaneStrides]:
    """Planes 0 and 1 of a layer's [B, H, N, C] view, relative to a (block, head)."""
    _, _, block_size, cell = layer.shape
    _, _, token_stride, cell_stride = layer.stride()
    half = cell // 2
    if interior is Interior.SPLIT_CELL:
        return (PlaneStrides(0, token_stride, cell_stride),
                PlaneStrides(half * cell_stride, token_stride, cell_stride))
    if cell_stride != 1 or token_stride != cell:
        raise LayoutError(f"the CPU backend's blocks need each (block, head) dense, got strides "
                          f"{layer.stride()} for shape {tuple(layer.shape)}")
    values = PlaneStrides(block_size * half, half, 1)
    if interior is Interior.CPU_KEY_TRANSPOSED:
        return PlaneStrides(0, 1, block_size), values
    return PlaneStrides(0, half, 1), values


def describe_caches(caches: Sequence[torch.Tensor] | torch.Tensor,
                    interior: Interior) -> CacheView:
    """A CacheView of a worker's caches: per-layer [B, H, N, C] views in layer order, or one
    cross-layer [L, B, H, N, C] tensor. LayoutError says what does not fit."""
    layers = list(caches.unbind(0)) if isinstance(caches, torch.Tensor) else list(caches)
    _check_layers(layers)
    first = layers[0]
    num_blocks, num_heads, block_size, cell = first.shape
    if cell % 2:
        raise LayoutError(f"a cell of {cell} elements does not split into two planes")
    raw = [layer.view(_raw_dtype(layer)) for layer in layers]
    layer_stride = _uniform_layer_stride(raw)
    block_stride, head_stride = first.stride()[:2]
    layout = KVLayout(layout_name(first, layer_stride), interior, len(layers), num_blocks,
                      num_heads, block_size, cell // 2, first.dtype, layer_stride,
                      block_stride, head_stride, plane_strides(first, interior))
    return CacheView(layout, tuple(layers), _plane_groups(layout, raw))


def _check_layers(layers: list[torch.Tensor]) -> None:
    if not layers:
        raise LayoutError("no KV cache layers")
    first = layers[0]
    if first.dim() != 4:
        raise LayoutError(f"a layer's cache is {first.dim()}D {tuple(first.shape)}; expected "
                          f"[blocks, heads, block_size, cell]")
    for layer in layers:
        same = (layer.shape, layer.stride(), layer.dtype, layer.device) == (
            first.shape, first.stride(), first.dtype, first.device)
        if not same:
            raise LayoutError(f"layers differ: {tuple(layer.shape)} {layer.stride()} "
                              f"{layer.dtype} on {layer.device} against {tuple(first.shape)} "
                              f"{first.stride()} {first.dtype} on {first.device}")
    if first.element_size() not in _RAW:
        raise LayoutError(f"cache elements of {first.element_size()} bytes")
    dims = sorted((s, n) for s, n in zip(first.stride(), first.shape, strict=True) if n > 1)
    if any(s <= 0 for s, _ in dims) or any(
            outer < inner * size for (inner, size), (outer, _) in pairwise(dims)):
        raise LayoutError(f"a layer's strides {first.stride()} overlap for shape "
                          f"{tuple(first.shape)}")


def _raw_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The integer dtype of tensor's element size: copies move bytes, whatever they mean."""
    return _RAW[tensor.element_size()]


def _uniform_layer_stride(raw: list[torch.Tensor]) -> int | None:
    """The constant element distance between consecutive layers in one storage, or None."""
    if len(raw) == 1:
        return raw[0].numel() or 1
    pointer = raw[0].untyped_storage().data_ptr()
    offsets = [layer.storage_offset() for layer in raw]
    step = offsets[1] - offsets[0]
    uniform = step > 0 and all(b - a == step for a, b in pairwise(offsets))
    if uniform and all(layer.untyped_storage().data_ptr() == pointer for layer in raw):
        return step
    return None


def _plane_groups(layout: KVLayout, raw: list[torch.Tensor]) -> list[_Group]:
    """Planes as 5D [layers, B, H, N, D] views: one group of every layer when they are one
    strided tensor, else one group per layer."""
    if layout.layer_stride is not None:
        starts = [(0, raw[0], len(raw))]
    else:
        starts = [(index, layer, 1) for index, layer in enumerate(raw)]
    groups = []
    for first, base, count in starts:
        planes = tuple(base.as_strided(
            (count, layout.num_blocks, layout.num_heads, layout.block_size, layout.plane_elems),
            (layout.layer_stride or 1, layout.block_stride, layout.head_stride,
             plane.token_stride, plane.dim_stride),
            base.storage_offset() + plane.offset) for plane in layout.planes)
        groups.append(_Group(first, count, planes))
    return groups


@dataclass(frozen=True, slots=True)
class _Group:
    first: int
    count: int
    planes: tuple[torch.Tensor, ...]


@dataclass(frozen=True, slots=True)
class _Tile:
    """Layers [first, first + count) of a group, tokens [start, end) of a request."""

    group: _Group
    first: int
    count: int
    start: int
    end: int


class CacheView:
    """A worker's caches, described (`layout`), with gather and scatter of a request's blocks.

    Sized like the list of per-layer caches it describes (len, [i]), so code written for a list
    of layers keeps working. Thread-safe: one transfer at a time per direction.
    """

    def __init__(self, layout: KVLayout, layers: tuple[torch.Tensor, ...], groups: list[_Group]):
        self.layout = layout
        self._layers = layers
        self._groups = groups
        self._stager = Stager(layers[0].device)
        self.tile_bytes = STAGING_BYTES  # the most bytes one gather or scatter step moves
        self.block_copies = (BlockCopies.PER_BLOCK if self.device.type == "cpu"
                             else BlockCopies.BATCHED)

    def __len__(self) -> int:
        return self.layout.num_layers

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._layers[index]

    @property
    def device(self) -> torch.device:
        return self._layers[0].device

    def page_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return self.layout.page_shape(num_tokens)

    def scatter(self, kv: torch.Tensor, block_ids: Sequence[int],
                token_range: tuple[int, int]) -> None:
        """Write tokens [start, end) of the page kv [L, 2, H, >=end, D] into the request's
        blocks (token t in block_ids[t // block_size] at t % block_size)."""
        kv = self._page(kv, token_range[1])
        with self._stager.scatter_lock:
            self._stager.join()
            for tile in self._tiles(block_ids, token_range):
                source = self._stager.to_device(_tile_of(kv, tile))
                with self._stager.on_stream():
                    _scatter_tile(tile, source, self._segments(block_ids, tile),
                                  self.block_copies)
                self._stager.after_scatter()

    def gather(self, block_ids: Sequence[int], token_range: tuple[int, int],
               out: torch.Tensor) -> None:
        """Read tokens [start, end) of the request's blocks into out [L, 2, H, >=end, D]."""
        out = self._page(out, token_range[1])
        with self._stager.gather_lock:
            self._stager.join()
            for tile in self._tiles(block_ids, token_range):
                target = _tile_of(out, tile)
                with self._stager.on_stream():
                    scratch = self._stager.device_scratch(target)
                    _gather_tile(tile, scratch, self._segments(block_ids, tile),
                                 self.block_copies)
                self._stager.to_host(scratch, target)

    def _page(self, kv: torch.Tensor, num_tokens: int) -> torch.Tensor:
        want = self.layout.page_shape(kv.shape[3] if kv.dim() == 5 else 0)
        if kv.dim() != 5 or tuple(kv.shape) != want or kv.shape[3] < num_tokens:
            raise ValueError(f"page {tuple(kv.shape)} does not fit these caches: "
                             f"{self.layout.page_shape(num_tokens)} or more tokens")
        if kv.element_size() != self.layout.element_bytes:
            raise ValueError(f"page elements are {kv.dtype}, the caches' {self.layout.dtype}")
        return kv.view(_raw_dtype(kv))

    def _tiles(self, block_ids: Sequence[int], token_range: tuple[int, int]) -> Iterator[_Tile]:
        start, end = token_range
        size = self.layout.block_size
        if start >= end:
            return
        if start < 0 or end > len(block_ids) * size:
            raise ValueError(f"tokens {token_range} beyond {len(block_ids)} blocks of {size}")
        used = block_ids[start // size:-(-end // size)]
        if any(not 0 <= block_id < self.layout.num_blocks for block_id in used):
            # checked here: on CUDA an index out of range is a device assert, not an error
            raise ValueError(f"block ids {list(used)} outside 0..{self.layout.num_blocks - 1}")
        block_bytes = 2 * self.layout.num_heads * size * self.layout.plane_elems * (
            self.layout.element_bytes)
        for group in self._groups:
            layers = max(1, min(group.count, self.tile_bytes // block_bytes))
            blocks = max(1, self.tile_bytes // (block_bytes * layers))
            for first in range(0, group.count, layers):
                count = min(layers, group.count - first)
                for low in range(start - start % size, end, blocks * size):
                    yield _Tile(group, first, count, max(low, start), min(low + blocks * size, end))

    def _segments(self, block_ids: Sequence[int], tile: _Tile) -> list[_Segment]:
        """The tile's tokens as runs: a block cut by the range, or full blocks in a row."""
        size, segments = self.layout.block_size, []
        for index in range(tile.start // size, -(-tile.end // size)):
            low, high = max(tile.start, index * size), min(tile.end, (index + 1) * size)
            full = high - low == size
            if full and segments and segments[-1].full:
                segments[-1].block_ids.append(block_ids[index])
            else:
                segments.append(_Segment([block_ids[index]], low - index * size,
                                         low - tile.start, full))
            if not full:
                segments[-1].num_tokens = high - low
        return segments


@dataclass(slots=True)
class _Segment:
    """block_ids hold tokens [offset, offset + num_tokens) of the tile from in-block position
    `low` (full: whole blocks, low 0)."""

    block_ids: list[int]
    low: int
    offset: int
    full: bool
    num_tokens: int = 0


def _tile_of(page: torch.Tensor, tile: _Tile) -> torch.Tensor:
    layers = slice(tile.group.first + tile.first, tile.group.first + tile.first + tile.count)
    return page[layers, :, :, tile.start:tile.end]


def _plane_runs(tile: _Tile, page: torch.Tensor, segments: list[_Segment]):
    """(cache plane [l, B, H, N, D], page plane [l, H, T, D], segment) per plane and run."""
    for index, plane in enumerate(tile.group.planes):
        cache = plane[tile.first:tile.first + tile.count]
        for segment in segments:
            yield cache, page[:, index], segment


def _block_parts(tile: _Tile, page: torch.Tensor, segments: list[_Segment]):
    """(cache part, page part) as numpy views, per plane and block: [l, H, tokens, D] each."""
    for cache, page_plane, segment in _plane_runs(tile, page, segments):
        cache_np, page_np = cache.numpy(), page_plane.numpy()
        if not segment.full:
            first, count = segment.offset, segment.num_tokens
            yield (cache_np[:, segment.block_ids[0], :, segment.low:segment.low + count],
                   page_np[:, :, first:first + count])
            continue
        size = cache.shape[3]
        for index, block_id in enumerate(segment.block_ids):
            first = segment.offset + index * size
            yield cache_np[:, block_id], page_np[:, :, first:first + size]


def _scatter_tile(tile: _Tile, page: torch.Tensor, segments: list[_Segment],
                  copies: BlockCopies) -> None:
    if copies is BlockCopies.PER_BLOCK:
        for cache_part, page_part in _block_parts(tile, page, segments):
            np.copyto(cache_part, page_part)
        return
    for cache, source, segment in _plane_runs(tile, page, segments):
        if segment.full:
            ids = torch.tensor(segment.block_ids, device=cache.device)
            tokens = source[:, :, segment.offset:segment.offset + len(ids) * cache.shape[3]]
            cache.index_copy_(1, ids, tokens.unflatten(2, (len(ids), -1)).transpose(1, 2))
        else:
            count = segment.num_tokens
            cache[:, segment.block_ids[0], :, segment.low:segment.low + count].copy_(
                source[:, :, segment.offset:segment.offset + count])


def _gather_tile(tile: _Tile, page: torch.Tensor, segments: list[_Segment],
                 copies: BlockCopies) -> None:
    if copies is BlockCopies.PER_BLOCK:
        for cache_part, page_part in _block_parts(tile, page, segments):
            np.copyto(page_part, cache_part)
        return
    for cache, target, segment in _plane_runs(tile, page, segments):
        if segment.full:
            ids = torch.tensor(segment.block_ids, device=cache.device)
            tokens = target[:, :, segment.offset:segment.offset + len(ids) * cache.shape[3]]
            tokens.unflatten(2, (len(ids), -1)).copy_(cache.index_select(1, ids).transpose(1, 2))
        else:
            count = segment.num_tokens
            target[:, :, segment.offset:segment.offset + count].copy_(
                cache[:, segment.block_ids[0], :, segment.low:segment.low + count])
