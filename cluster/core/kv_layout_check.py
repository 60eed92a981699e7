"""Checks of cluster/core/kv_layout.py against an independent reference, on any device (pure:
torch only). `make gpu-check` runs them on CUDA through selfcheck below; the unit tests on
CPU.

The reference writes token by token through vLLM's logical per-layer view [B, H, N, C] with
advanced indexing (the way vLLM's attention backends read a cache), never through kv_layout's
strides. A case passes when a scatter leaves every byte of the cache's storage as the
reference leaves it (the request's tokens in place, nothing else touched) and a gather returns
the page's bytes for the token range, leaving the rest of the page as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.core.kv_layout import (
    LAYOUT_ORDERS,
    BlockCopies,
    Interior,
    describe_caches,
    order_strides,
)

NUM_LAYERS, NUM_BLOCKS, NUM_HEADS, BLOCK_TOKENS, HEAD_DIM = 3, 12, 2, 16, 16
BLOCK_IDS = (11, 3, 7, 0, 9, 5, 1, 10, 2, 8)  # a request's blocks, out of order
PARTIAL_RANGE = (5, 150)  # starts and ends inside a block
SCALE_BYTES = 4  # a per-token-head quantized plane: [data | fp32 scale]
FLAT_SLACK = 4096  # elements past the caches (gaps of separate layers; must stay untouched)


@dataclass(frozen=True)
class Case:
    """One cache to round-trip: `make(flat)` views a flat buffer as the caches vLLM hands."""

    name: str
    shape: tuple[int, int, int, int, int]  # [L, B, H, N, C]
    dtype: torch.dtype
    interior: Interior
    make: Callable[[torch.Tensor], list[torch.Tensor] | torch.Tensor]
    token_range: tuple[int, int] = PARTIAL_RANGE
    tile_bytes: int | None = None


def strided(order: str, shape: tuple[int, ...], as_list: bool = True):
    """A maker: the member's one allocation, as per-layer views (as vLLM's register_kv_caches
    gets them) or as the 5D cross-layer tensor."""
    def make(flat: torch.Tensor):
        tensor = flat.as_strided(shape, order_strides(LAYOUT_ORDERS[order], shape))
        return list(tensor.unbind(0)) if as_list else tensor
    return make


def separate(shape: tuple[int, ...]):
    """A maker: layers at uneven distances, as separate allocations would be (so no one
    layer stride covers them)."""
    def make(flat: torch.Tensor):
        count = _count(shape[1:])
        starts = [i * count + 16 * i * i for i in range(shape[0])]
        return [flat[start:start + count].view(shape[1:]) for start in starts]
    return make


def _count(shape) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def cases() -> list[Case]:
    """Every KVCacheLayout member (per-layer views and one cross-layer tensor), separate
    layers, whole blocks, small tiles, MLA, per-token-head int8 with scales, fp8, and the CPU
    backend's block interiors; 16-token blocks throughout."""
    shape = (NUM_LAYERS, NUM_BLOCKS, NUM_HEADS, BLOCK_TOKENS, 2 * HEAD_DIM)
    split, bf16 = Interior.SPLIT_CELL, torch.bfloat16
    found = []
    for order in LAYOUT_ORDERS:
        found.append(Case(f"{order}/layer-views", shape, bf16, split, strided(order, shape)))
        found.append(Case(f"{order}/one-tensor", shape, bf16, split,
                          strided(order, shape, as_list=False)))
    mla = (NUM_LAYERS, NUM_BLOCKS, 1, BLOCK_TOKENS, 72)  # latent 64 + rope 8, one head slot
    quant = (NUM_LAYERS, NUM_BLOCKS, NUM_HEADS, BLOCK_TOKENS, 2 * (HEAD_DIM + SCALE_BYTES))
    found += [
        Case("separate-layers/fp32", shape, torch.float32, split, separate(shape)),
        Case("LBNHC/whole-blocks", shape, torch.float16, split, strided("LBNHC", shape),
             token_range=(0, len(BLOCK_IDS) * BLOCK_TOKENS)),
        Case("BLHNC/small-tiles", shape, bf16, split, strided("BLHNC", shape),
             tile_bytes=2 * NUM_HEADS * BLOCK_TOKENS * HEAD_DIM * 2),
        Case("mla/LBNHC/bf16", mla, bf16, split, strided("LBNHC", mla)),
        Case("mla/BLNHC/fp8", mla, torch.uint8, split, strided("BLNHC", mla)),
        Case("fp8-per-tensor/LBNHC", shape, torch.uint8, split, strided("LBNHC", shape)),
        Case("int8-per-token-head+scales/LBNHC", quant, torch.int8, split,
             strided("LBNHC", quant)),
        Case("int8-per-token-head+scales/BHLNC", quant, torch.int8, split,
             strided("BHLNC", quant)),
        Case("cpu-key-transposed/LBHNC", shape, torch.float32, Interior.CPU_KEY_TRANSPOSED,
             strided("LBHNC", shape)),
        Case("cpu-key-rows/LBHNC", shape, torch.float32, Interior.CPU_KEY_ROWS,
             strided("LBHNC", shape)),
    ]
    return found


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, seed: int,
                 device: str | torch.device) -> torch.Tensor:
    """A tensor of `shape` whose bytes are random (NaN patterns included: compared as bytes)."""
    element = torch.empty((), dtype=dtype).element_size()
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (_count(shape) * element,), dtype=torch.uint8,
                         generator=generator)
    return data.view(dtype).view(shape).to(device)


def page_with_scales(case: Case, num_tokens: int, device) -> torch.Tensor:
    """A page of int8 codes whose planes end in real fp32 scales, as vLLM packs them."""
    plane = case.shape[4] // 2
    page = random_bytes((case.shape[0], 2, case.shape[2], num_tokens, plane), case.dtype, 7,
                        device)
    scales = torch.rand(page.shape[:4], generator=torch.Generator().manual_seed(8)) + 0.5
    page[..., plane - SCALE_BYTES:].copy_(scales.to(device).unsqueeze(-1).view(torch.int8))
    return page


def reference_scatter(layers: list[torch.Tensor], interior: Interior, kv: torch.Tensor,
                      block_ids: tuple[int, ...], token_range: tuple[int, int]) -> None:
    """Tokens [start, end) of kv into the layers' blocks, through the logical view only."""
    start, end = token_range
    size = layers[0].shape[2]
    tokens = torch.arange(start, end, device=kv.device)
    blocks = torch.tensor(block_ids, device=kv.device)[tokens // size]
    offsets = tokens % size
    for index, layer in enumerate(layers):
        keys = kv[index, 0, :, start:end].transpose(0, 1)  # [T, H, D]
        values = kv[index, 1, :, start:end].transpose(0, 1)
        if interior is Interior.SPLIT_CELL:
            layer[blocks, :, offsets] = torch.cat([keys, values], dim=-1)
            continue
        half = layer.shape[3] // 2
        cells = layer.flatten(2)  # the CPU backend's (block, head): K then V, N*D each
        stored_values = cells[..., size * half:].unflatten(-1, (size, half))
        stored_values[blocks, :, offsets] = values
        if interior is Interior.CPU_KEY_TRANSPOSED:
            cells[..., :size * half].unflatten(-1, (half, size))[blocks, :, :, offsets] = keys
        else:
            cells[..., :size * half].unflatten(-1, (size, half))[blocks, :, offsets] = keys


def run_case(case: Case, device: str | torch.device, page_device=None,
             copies: BlockCopies | None = None) -> tuple[bool, str]:
    """Scatter then gather one case (pages on page_device, CPU by default; blocks moved the
    device's way unless `copies` says); (ok, what differed or what was moved)."""
    page_device = page_device or "cpu"
    num_bytes = _count(case.shape) * torch.empty((), dtype=case.dtype).element_size()
    flat = random_bytes((_count(case.shape) + FLAT_SLACK,), case.dtype, 1, device)
    expected_flat = flat.clone()
    view = describe_caches(case.make(flat), case.interior)
    if case.tile_bytes:
        view.tile_bytes = case.tile_bytes
    view.block_copies = copies or view.block_copies
    num_tokens = len(BLOCK_IDS) * case.shape[3]
    kv = (page_with_scales(case, num_tokens, page_device) if case.dtype == torch.int8
          else random_bytes(view.page_shape(num_tokens), case.dtype, 2, page_device))
    view.scatter(kv, BLOCK_IDS, case.token_range)
    expected = case.make(expected_flat)
    reference_scatter(list(expected), case.interior, kv.to(device), BLOCK_IDS, case.token_range)
    wrong = _bytes_differ(flat, expected_flat)
    if wrong:
        return False, f"scatter: {wrong} of {num_bytes} cache bytes differ from the reference"
    out = random_bytes(view.page_shape(num_tokens), case.dtype, 3, page_device)
    want = out.clone()
    start, end = case.token_range
    want[:, :, :, start:end] = kv[:, :, :, start:end]
    view.gather(BLOCK_IDS, case.token_range, out)
    wrong = _bytes_differ(out, want)
    if wrong:
        return False, f"gather: {wrong} page bytes differ"
    return True, (f"{view.layout.name} {view.layout.interior.value} "
                  f"{view.block_copies.value}, {case.shape} "
                  f"{case.dtype}, tokens [{start}, {end})")


def _bytes_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    left = a.contiguous().view(-1).view(torch.uint8)
    right = b.contiguous().view(-1).view(torch.uint8)
    return int((left != right).sum().item())


def selfcheck(device: str) -> list[tuple[str, bool, str]]:
    """Round-trip every layout kv_layout knows, byte for byte, on tensors of `device` ("cpu",
    "cuda", "cuda:1"): every KVCacheLayout member as layer views and as one tensor, 16-token
    blocks, partial blocks, MLA, fp8, int8 with its scales, the CPU backend's blocks; on CUDA
    also a page already on the device. Returns (name, ok, detail) rows."""
    rows = []
    for case in cases():
        rows.append((case.name, *_guarded(case, device, None)))
    if torch.device(device).type == "cuda":
        case = cases()[2]  # LBNHC, per-layer views: pages on the device, no host staging
        rows.append((f"{case.name}/device-page", *_guarded(case, device, device)))
    return rows


def _guarded(case: Case, device: str, page_device) -> tuple[bool, str]:
    try:
        return run_case(case, device, page_device)
    except Exception as error:  # a failed case is a FAIL row, not a crashed check
        return False, f"{type(error).__name__}: {error}"
