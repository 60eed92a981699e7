"""raykv's KV layout <-> vLLM's CPU paged blocks: exact round trips, any block/page split, both
block layouts (K stored [D, B] by the "vec" kernels, or [B, D])."""

import pytest
import torch

from cluster.serving.vllm_layout import (
    BlockLayout,
    blocks_of,
    blocks_to_kv,
    check_layers,
    kv_to_blocks,
    planes,
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
    keys, values = planes(caches[0], 6, layout)
    assert not keys[:, :2].any() and not values[:, :2].any() and keys[:, 2:].abs().sum() > 0
    out = torch.zeros(L, 2, H, 3 * B, D)
    got = blocks_to_kv(caches, layout, [4, 6, 8], 3 * B, out)
    assert torch.equal(got[:, :, :, B + 2:], kv[:, :, :, B + 2:])


def test_blocks_of_a_token_range():
    assert blocks_of((0, B), [5, 6, 7], B) == {5}
    assert blocks_of((B - 1, 2 * B + 1), [5, 6, 7], B) == {5, 6, 7}
    assert blocks_of((B, B), [5, 6, 7], B) == set()


def test_check_layers_names_the_mismatch():
    shape = (L, 2, H, 16, D)
    assert check_layers(layers(), shape, torch.float32) is None
    assert "3 KV layers" in check_layers(layers(), (4, 2, H, 16, D), torch.float32)
    assert "dtype" in check_layers(layers(), shape, torch.bfloat16)
    wrong = [torch.zeros(2, NUM_BLOCKS, B, H, D)] * L  # a GPU-style [2, blocks, B, H, D]
    assert "CPU layout" in check_layers(wrong, shape, torch.float32)
