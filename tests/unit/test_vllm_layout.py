"""raykv's KV layout <-> vLLM's CPU paged blocks: exact round trips, any block/page split."""

import pytest
import torch

from cluster.serving.vllm_layout import blocks_of, blocks_to_kv, check_layers, kv_to_blocks

L, H, D, B = 3, 2, 4, 8
NUM_BLOCKS = 10


def layers():
    return [torch.zeros(NUM_BLOCKS, H, B, 2 * D) for _ in range(L)]


def kv_of(num_tokens, seed=0):
    return torch.randn(L, 2, H, num_tokens, D, generator=torch.Generator().manual_seed(seed))


def test_block_holds_k_then_v_of_each_head_and_token():
    caches, kv = layers(), kv_of(2 * B)
    kv_to_blocks(kv, caches, [7, 3], (0, 2 * B))
    # token B + 5 is in the second block (id 3), offset 5
    assert torch.equal(caches[1][3, 0, 5, :D], kv[1, 0, 0, B + 5])
    assert torch.equal(caches[1][3, 0, 5, D:], kv[1, 1, 0, B + 5])
    assert torch.equal(caches[2][7, 1, 0, D:], kv[2, 1, 1, 0])


@pytest.mark.parametrize("num_tokens", [B, 3 * B, 3 * B + 5])
def test_round_trip_through_scattered_blocks(num_tokens):
    caches, kv = layers(), kv_of(num_tokens, seed=num_tokens)
    block_ids = [9, 2, 5, 0][: -(-num_tokens // B)]
    kv_to_blocks(kv, caches, block_ids, (0, num_tokens))
    out = torch.full((L, 2, H, 4 * B, D), float("nan"))
    got = blocks_to_kv(caches, block_ids, num_tokens, out)
    assert got.shape[3] == num_tokens and torch.equal(got, kv)


def test_a_range_writes_only_its_tokens():
    caches, kv = layers(), kv_of(3 * B)
    kv_to_blocks(kv, caches, [4, 6, 8], (B + 2, 3 * B))
    assert not caches[0][4].any()  # the first block is untouched
    assert not caches[0][6, :, :2].any() and caches[0][6, :, 2:].abs().sum() > 0
    out = torch.zeros(L, 2, H, 3 * B, D)
    got = blocks_to_kv(caches, [4, 6, 8], 3 * B, out)
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
    wrong = [torch.zeros(NUM_BLOCKS, 2, H, B, D)] * L  # a K/V-first layout
    assert "K and V packed" in check_layers(wrong, shape, torch.float32)
