"""A real (tiny, random-weight) transformers Llama reuses its KV through raykv.

A prompt's KV is stored; a longer prompt with the same prefix restores it and runs only the
rest. The next-token logits must equal a full recompute: exactly for raw pages, within a stated
tolerance (and with the same top-1 token) for fp8/int8 pages demoted to disk.
"""

from __future__ import annotations

import pytest
import torch

from cluster import connect
from cluster.serving.model import build_llama, continue_from, prefill

PAGE_BYTES = 8192
PREFIX_TOKENS = 48  # three pages of 16
# Measured on seeds 0-3: fp8 <= 0.103, int8 <= 0.027 max |logit error|.
TOLERANCE = {"none": 0.0, "fp8": 0.15, "int8": 0.04}


@pytest.fixture(scope="module")
def model():
    return build_llama("tiny-llama", seed=0)


def prompts() -> tuple[list[int], list[int]]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (PREFIX_TOKENS + 16,), generator=generator).tolist()
    return tokens[:PREFIX_TOKENS], tokens


def push_to_disk(client) -> None:
    """Fill the small host tier with other pages so the prompt's pages go to disk."""
    for index in range(3):
        filler = [600 + index * 50 + i for i in range(32)]
        client.put(filler, torch.randn(2, 2, 2, 32, 16))


@pytest.mark.parametrize("codec,on_disk", [
    ("none", False), ("none", True), ("fp8", True), ("int8", True)])
def test_restored_prefix_gives_full_recompute_logits(service, model, codec, on_disk):
    llama, spec = model
    service(device_bytes=0, host_bytes=4 * PAGE_BYTES, disk_bytes=32 * (PAGE_BYTES + 4096),
            disk_codec=codec)
    client = connect(spec)
    prefix, longer = prompts()
    _, prefix_kv = prefill(llama, prefix)
    assert client.put(prefix, prefix_kv) == PREFIX_TOKENS
    if on_disk:
        push_to_disk(client)
        assert client.stats()["node"]["pages"]["disk"] >= 3

    cached_tokens, restored = client.get(longer)
    assert cached_tokens == PREFIX_TOKENS
    logits = continue_from(llama, restored, longer)
    full_logits, _ = prefill(llama, longer)

    assert logits.argmax() == full_logits.argmax()
    if codec == "none":
        assert torch.equal(restored, prefix_kv)
        assert torch.equal(logits, continue_from(llama, prefix_kv, longer))
        torch.testing.assert_close(logits, full_logits, rtol=0, atol=1e-5)
    else:
        assert not torch.equal(restored, prefix_kv)  # it really went through the codec
        error = (logits - full_logits).abs().max().item()
        assert error <= TOLERANCE[codec], f"{codec}: max logit error {error}"
