"""RaykvConnector where a raykv page holds two of vLLM's blocks (256-token pages, as `raykv
start` runs by default, over vLLM's 128-token CPU blocks; on GPUs 16-token blocks): raykv
answers in whole pages, so a prompt with no whole page past what vLLM holds costs no lookup,
and one that has is looked up, saved and loaded page by page. vLLM's own prefix cache is off,
so every cached token a response reports came from raykv."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this "
                                   "tier in .venv-vllm")

import ray  # noqa: E402

from cluster import ModelSpec, connect  # noqa: E402
from tests.vllm.conftest import prompt_tokens  # noqa: E402
from tests.vllm.engine import served_engine  # noqa: E402

PAGE_TOKENS = 256  # two of vLLM's 128-token CPU blocks
MAX_TOKENS = 4
ENGINE = {"enable_prefix_caching": False, "max_model_len": 1024}


@pytest.fixture(scope="module")
def engine(model_dir):
    with served_engine(model_dir, PAGE_TOKENS, ENGINE) as started:
        yield started


def generate(engine, prompt):
    return ray.get(engine.generate.remote(prompt, MAX_TOKENS))


def lookups(engine) -> int:
    return ray.get(engine.scheduler_connector.remote("_lookups.num_started"))


def test_a_prompt_with_no_whole_page_to_ask_for_costs_no_lookup(engine):
    """200 tokens: one whole block (128) to ask about, no whole page. The lookup could only
    answer 0, and waiting for it could cost the request an engine step."""
    started = lookups(engine)
    ids, cached = generate(engine, prompt_tokens(200, seed=51))
    assert lookups(engine) == started and cached == 0 and len(ids) == MAX_TOKENS


def test_a_prompt_with_whole_pages_is_looked_up_saved_and_loaded(engine):
    prompt = prompt_tokens(600, seed=52)  # two whole pages (512 tokens)
    started = lookups(engine)
    ids, _ = generate(engine, prompt)
    assert lookups(engine) == started + 1
    client, deadline_s = connect(ModelSpec.preset("small-llama")), time.monotonic() + 30
    while client.lookup(prompt) < 2 * PAGE_TOKENS:
        assert time.monotonic() < deadline_s, "the engine's pages never reached raykv"
        time.sleep(0.2)
    again, cached = generate(engine, prompt)
    assert cached == 2 * PAGE_TOKENS and again == ids
