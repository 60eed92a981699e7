"""vLLM tier: run in .venv-vllm (`make test-vllm`). Real vLLM engines (CPU backend) on a
random-weight Llama saved to a temp directory; Ray started per module."""

from __future__ import annotations

import os

import pytest

# vLLM's CPU KV space per engine, in GiB: small, so that engines fit beside each other.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from cluster.serving.model_dir import save_model_dir

    return save_model_dir(str(tmp_path_factory.mktemp("model") / "small-llama"))


def prompt_tokens(num_tokens: int, seed: int) -> list[int]:
    """Byte-level token ids (0..255) that are not a repeat of another seed's."""
    return [(seed * 131 + i * 7 + i * i) % 251 for i in range(num_tokens)]
