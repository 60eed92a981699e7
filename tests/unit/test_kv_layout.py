"""cluster/core/kv_layout.py on CPU tensors: every KVCacheLayout member (from kv_layout's own
table; tests/vllm checks the table against vLLM's enum), as per-layer views and as one
cross-layer tensor, 16-token blocks, token ranges cut mid-block, MLA, fp8 and int8 with scales,
and the CPU backend's block interiors, round-tripped byte for byte against a reference that
writes through vLLM's logical [B, H, N, C] view."""

import pytest
import torch

from cluster.core import kv_layout_check as check
from cluster.core.kv_layout import (
    LAYOUT_ORDERS,
    BlockCopies,
    Interior,
    LayoutError,
    allocate,
    describe_caches,
    layout_name,
    order_strides,
)

CASES = check.cases()
L, B, H, N, D = 3, 12, 2, 16, 8


@pytest.mark.parametrize("copies", list(BlockCopies), ids=[c.value for c in BlockCopies])
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_round_trip_byte_for_byte(case, copies):
    """Both ways of moving blocks: per block (CPU's) and batched (CUDA's, here on CPU)."""
    ok, detail = check.run_case(case, "cpu", copies=copies)
    assert ok, detail


def test_cases_cover_every_member_in_both_forms():
    names = {case.name for case in CASES}
    for order in LAYOUT_ORDERS:
        assert {f"{order}/layer-views", f"{order}/one-tensor"} <= names
    assert all(case.shape[3] == 16 for case in CASES)  # vLLM's GPU block size
    assert any(case.token_range[0] % 16 and case.token_range[1] % 16 for case in CASES)


def test_selfcheck_rows_for_the_gpu_check():
    rows = check.selfcheck("cpu")
    assert [name for name, _, _ in rows] == [case.name for case in CASES]
    assert all(ok for _, ok, _ in rows), [row for row in rows if not row[1]]
    assert all(isinstance(detail, str) and detail for _, _, detail in rows)


def test_the_reference_catches_a_wrong_interior():
    """The check has teeth: caches described with the wrong CPU interior do not match."""
    shape = (L, B, H, N, 2 * D)
    flat = check.random_bytes((L * B * H * N * 2 * D,), torch.float32, 1, "cpu")
    expected_flat = flat.clone()
    kv = check.random_bytes((L, 2, H, 10 * N, D), torch.float32, 2, "cpu")
    view = describe_caches(flat.view(shape), Interior.CPU_KEY_ROWS)
    view.scatter(kv, check.BLOCK_IDS, (0, 10 * N))
    check.reference_scatter(list(expected_flat.view(shape)), Interior.CPU_KEY_TRANSPOSED, kv,
                            check.BLOCK_IDS, (0, 10 * N))
    assert not torch.equal(flat, expected_flat)


def test_lands_where_flash_attention_reads():
    """Token t's K and V in block ids[t // N], slot t % N, through the exact expression
    vLLM's FlashAttention backend reads a cache with."""
    cache = allocate("LBNHC", (L, B, H, N, 2 * D), torch.float32)
    kv = torch.randn(L, 2, H, 3 * N, D)
    describe_caches(list(cache.unbind(0)), Interior.SPLIT_CELL).scatter(kv, [4, 9, 2], (3, 40))
    key_cache, value_cache = cache[2].transpose(1, 2).split(D, dim=-1)  # [B, N, H, D] each
    assert torch.equal(key_cache[9, 20 - N, 1], kv[2, 0, 1, 20])
    assert torch.equal(value_cache[2, 39 - 2 * N, 0], kv[2, 1, 0, 39])
    assert not key_cache[4, :3].any() and not cache[:, [0, 1, 3]].any()


def test_order_strides_are_vllms_dense_strides():
    shape = (L, B, H, N, 2 * D)
    C = 2 * D
    assert order_strides(LAYOUT_ORDERS["LBHNC"], shape) == (B * H * N * C, H * N * C, N * C,
                                                             C, 1)
    assert order_strides(LAYOUT_ORDERS["LBNHC"], shape) == (B * N * H * C, N * H * C, C,
                                                             H * C, 1)
    assert order_strides(LAYOUT_ORDERS["BHLNC"], shape) == (N * C, H * L * N * C, L * N * C,
                                                             C, 1)


@pytest.mark.parametrize("name", list(LAYOUT_ORDERS))
def test_layout_name_read_from_strides(name):
    cache = allocate(name, (L, B, H, N, 2 * D), torch.bfloat16)
    view = describe_caches(list(cache.unbind(0)), Interior.SPLIT_CELL)
    assert view.layout.name == name == layout_name(cache[0], cache.stride(0))
    assert view.layout.layer_stride == cache.stride(0)
    assert view.layout.page_shape(N) == (L, 2, H, N, D) and len(view) == L


def test_caches_it_cannot_describe():
    with pytest.raises(LayoutError, match="3D"):
        describe_caches([torch.zeros(B, H, 2 * D)], Interior.SPLIT_CELL)
    with pytest.raises(LayoutError, match="differ"):
        describe_caches([torch.zeros(B, H, N, 2 * D), torch.zeros(B, H, N, 4 * D)],
                        Interior.SPLIT_CELL)
    with pytest.raises(LayoutError, match="two planes"):
        describe_caches([torch.zeros(B, H, N, 2 * D + 1)], Interior.SPLIT_CELL)
    with pytest.raises(LayoutError, match="overlap"):
        describe_caches([torch.zeros(1, H, N, 2 * D).expand(B, H, N, 2 * D)],
                        Interior.SPLIT_CELL)
    nhd = allocate("LBNHC", (L, B, H, N, 2 * D), torch.float32)
    with pytest.raises(LayoutError, match="CPU backend"):  # its (block, head) is not dense
        describe_caches(list(nhd.unbind(0)), Interior.CPU_KEY_TRANSPOSED)


def test_pages_that_do_not_fit_are_refused():
    view = describe_caches(allocate("LBNHC", (L, B, H, N, 2 * D), torch.bfloat16),
                           Interior.SPLIT_CELL)
    with pytest.raises(ValueError, match="page"):
        view.scatter(torch.zeros(L, 2, H, 2 * N, D + 1, dtype=torch.bfloat16), [0, 1], (0, 2))
    with pytest.raises(ValueError, match="elements"):
        view.scatter(torch.zeros(L, 2, H, 2 * N, D), [0, 1], (0, N))
    with pytest.raises(ValueError, match="beyond"):
        view.gather([0], (0, 2 * N), torch.zeros(L, 2, H, 2 * N, D, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="outside"):  # before anything is written
        view.scatter(torch.ones(L, 2, H, 2 * N, D, dtype=torch.bfloat16), [0, B], (0, 2 * N))
    assert not view[0].any()


def test_per_token_head_scales_travel_in_the_page():
    """int8 codes with their fp32 scales after each plane's data: the scales read back from a
    gathered page as the same floats."""
    case = next(case for case in CASES if case.name.startswith("int8-per-token-head"))
    cache = case.make(torch.zeros(check.NUM_LAYERS * 12 * 2 * 16 * 40 + 64, dtype=torch.int8))
    view = describe_caches(cache, case.interior)
    page = check.page_with_scales(case, 160, "cpu")
    view.scatter(page, check.BLOCK_IDS, (0, 160))
    out = torch.zeros_like(page)
    view.gather(check.BLOCK_IDS, (0, 160), out)
    scales = out[..., -check.SCALE_BYTES:].contiguous().view(torch.float32)
    assert torch.equal(scales, page[..., -check.SCALE_BYTES:].contiguous().view(torch.float32))
    assert float(scales.min()) >= 0.5


def test_an_empty_range_moves_nothing():
    cache = allocate("BLNHC", (L, B, H, N, 2 * D), torch.float32)
    view = describe_caches(cache, Interior.SPLIT_CELL)
    view.scatter(torch.ones(L, 2, H, N, D), [3], (5, 5))
    assert not cache.any()
