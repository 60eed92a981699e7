"""raykv's KV layout <-> vLLM's paged blocks through cluster/serving/vllm_layout.py: the CPU
backend's blocks (K stored [D, B] by the "vec" kernels, or [B, D]) as a plain list of layers
with a BlockLayout, exact round trips with any block/page split; which cells raykv moves; and
how a worker's caches are described (cluster/core/kv_layout.py has the layouts' own tests)."""

import pytest
import torch

from cluster.core.kv_layout import Interior, LayoutError, allocate
from cluster.serving.vllm_layout import (
    BlockLayout,
    CacheFormat,
    CacheView,
    blocks_of,
    blocks_to_kv,
    cell_elems,
    describe_worker,
    kv_to_blocks,
    probed_interior,
    spec_mismatch,
)

L, H, D, B = 3, 2, 4, 8
NUM_BLOCKS = 10
LAYOUTS = [BlockLayout(key_transposed=True), BlockLayout(key_transposed=False)]


def layers():
    return [torch.zeros(NUM_BLOCKS, H, B, 2 * D) for _ in range(L)]


def kv_of(num_tokens, seed=0):
    return torch.randn(L, 2, H, num_tokens, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_block_holds_each_heads_k_then_its_v(layout):
    caches, kv = layers(), kv_of(2 * B)
    kv_to_blocks(kv, caches, layout, [7, 3], (0, 2 * B))
    memory = caches[1][3].reshape(H, 2, B * D)  # block 3 holds tokens B..2B-1
    keys = memory[0, 0].view(D, B).t() if layout.key_transposed else memory[0, 0].view(B, D)
    assert torch.equal(keys[5], kv[1, 0, 0, B + 5])  # head 0, token B + 5
    assert torch.equal(memory[1, 1].view(B, D)[0], kv[1, 1, 1, B])  # V is token-major


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_tokens", [B, 3 * B, 3 * B + 5])
def test_round_trip_through_scattered_blocks(layout, num_tokens):
    caches, kv = layers(), kv_of(num_tokens, seed=num_tokens)
    block_ids = [9, 2, 5, 0][: -(-num_tokens // B)]
    kv_to_blocks(kv, caches, layout, block_ids, (0, num_tokens))
    out = torch.full((L, 2, H, 4 * B, D), float("nan"))
    got = blocks_to_kv(caches, layout, block_ids, num_tokens, out)
    assert got.shape[3] == num_tokens and torch.equal(got, kv)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_range_writes_only_its_tokens(layout):
    caches, kv = layers(), kv_of(3 * B)
    kv_to_blocks(kv, caches, layout, [4, 6, 8], (B + 2, 3 * B))
    assert not caches[0][4].any()  # the first block is untouched
    memory = caches[0][6].reshape(H, 2, B * D)  # per head: K's B*D elements, then V's
    values = memory[:, 1].view(H, B, D)
    keys = (memory[:, 0].view(H, D, B).transpose(1, 2) if layout.key_transposed
            else memory[:, 0].view(H, B, D))
    assert not keys[:, :2].any() and not values[:, :2].any() and keys[:, 2:].abs().sum() > 0
    out = torch.zeros(L, 2, H, 3 * B, D)
    got = blocks_to_kv(caches, layout, [4, 6, 8], 3 * B, out)
    assert torch.equal(got[:, :, :, B + 2:], kv[:, :, :, B + 2:])


def test_blocks_of_a_token_range():
    assert blocks_of((0, B), [5, 6, 7], B) == {5}
    assert blocks_of((B - 1, 2 * B + 1), [5, 6, 7], B) == {5, 6, 7}
    assert blocks_of((B, B), [5, 6, 7], B) == set()


GPU = {"FLASH_ATTN"}
CPU = {"CPU_ATTN"}


def test_the_cells_raykv_moves():
    assert cell_elems(CacheFormat("auto", 128, False), 2) == 256
    assert cell_elems(CacheFormat("fp8_e5m2", 128, False), 1) == 256  # uint8, scales per layer
    assert cell_elems(CacheFormat("int8_per_token_head", 128, False), 1) == 2 * (128 + 4)
    assert cell_elems(CacheFormat("auto", 576, True), 2) == 576  # MLA: one latent
    for dtype, mla in (("nvfp4", False), ("fp8_ds_mla", True), ("int4_per_token_head", False),
                       ("int8_per_token_head", True)):
        with pytest.raises(LayoutError, match="not one raykv moves"):
            cell_elems(CacheFormat(dtype, 128, mla), 1)


def never_probed(layer):
    raise AssertionError("a GPU backend's caches are not probed")


def test_a_gpu_backend_splits_its_cells_in_any_layout():
    cache = allocate("LBNHC", (L, NUM_BLOCKS, H, B, 2 * D), torch.float32)  # NHD, GPU default
    view = describe_worker(list(cache.unbind(0)), CacheFormat("auto", D, False), GPU,
                           never_probed)
    assert isinstance(view, CacheView) and view.layout.interior is Interior.SPLIT_CELL
    assert view.layout.name == "LBNHC" and len(view) == L and view[1] is not None
    kv = kv_of(2 * B)
    kv_to_blocks(kv, view, view.layout, [5, 1], (0, 2 * B))
    keys = cache[2].transpose(1, 2).split(D, dim=-1)[0]  # FlashAttention's own read
    assert torch.equal(keys[1, 3], kv[2, 0, :, B + 3])
    out = torch.zeros(L, 2, H, 2 * B, D)
    assert torch.equal(blocks_to_kv(view, view.layout, [5, 1], 2 * B, out), kv)


def test_the_cpu_backend_is_probed():
    caches = layers()
    view = describe_worker(caches, CacheFormat("float32", D, False), CPU,
                           lambda layer: Interior.CPU_KEY_TRANSPOSED)
    assert view.layout.interior is Interior.CPU_KEY_TRANSPOSED
    with pytest.raises(LayoutError, match="does not know"):
        describe_worker(caches, CacheFormat("float32", D, False), CPU, lambda layer: None)
    fp8 = [torch.zeros(NUM_BLOCKS, H, B, 2 * D, dtype=torch.uint8)]
    with pytest.raises(LayoutError, match="not probed"):
        describe_worker(fp8, CacheFormat("fp8", D, False), CPU, never_probed)


def test_caches_a_worker_cannot_describe():
    fmt = CacheFormat("auto", D, False)
    with pytest.raises(LayoutError, match="no KV cache"):
        describe_worker([], fmt, GPU, never_probed)
    with pytest.raises(LayoutError, match="cells of"):
        describe_worker([torch.zeros(NUM_BLOCKS, H, B, 3 * D)], fmt, GPU, never_probed)
    wrong = [torch.zeros(2, NUM_BLOCKS, B, H, D)] * L  # an older GPU shape [2, blocks, B, H, D]
    with pytest.raises(LayoutError, match="vLLM 0.32"):
        describe_worker(wrong, fmt, GPU, never_probed)


def test_page_geometry_must_match_raykvs():
    view = describe_worker(layers(), CacheFormat("float32", D, False), CPU,
                           lambda layer: Interior.CPU_KEY_ROWS)
    assert spec_mismatch(view.layout, (L, 2, H, B, D), 4) == ""
    assert "raykv's are" in spec_mismatch(view.layout, (L + 1, 2, H, B, D), 4)
    assert "2-byte" in spec_mismatch(view.layout, (L, 2, H, B, D), 2)


@pytest.mark.parametrize("transposed", [True, False])
def test_probed_interior_reads_back_what_the_op_wrote(transposed):
    """What the CPU cache op would write, for each interior: the probe names that one."""
    scratch = torch.zeros(1, H, B, 2 * D)
    known = torch.arange(B * H * D, dtype=torch.float32).view(B, H, D) + 1
    memory = scratch[0].view(H, 2, B * D)
    memory[:, 1] = (-known).permute(1, 0, 2).reshape(H, B * D)
    keys = known.permute(1, 2, 0) if transposed else known.permute(1, 0, 2)
    memory[:, 0] = keys.reshape(H, B * D)
    want = Interior.CPU_KEY_TRANSPOSED if transposed else Interior.CPU_KEY_ROWS
    assert probed_interior(scratch, known, -known) is want
    assert probed_interior(torch.zeros(1, H, B, 2 * D), known, -known) is None
