"""RaykvConnector in one vLLM engine (CPU backend) with LoRA, chunked prefill and few KV
blocks: lookups off the scheduler's thread, loads in the background, saves of new pages only,
and keys that keep LoRA adapters and cache salts apart. vLLM's own prefix cache is off, so
every cached token a response reports came from raykv."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this "
                                   "tier in .venv-vllm")

import ray  # noqa: E402

from cluster import ModelSpec, connect  # noqa: E402
from tests.vllm.conftest import prompt_tokens  # noqa: E402
from tests.vllm.engine import served_engine  # noqa: E402

BLOCK_TOKENS = 128  # vLLM's CPU block, and raykv's page here
MAX_TOKENS = 8
SMALL_LLAMA = ModelSpec.preset("small-llama")
LORA_RANK = 8
ENGINE = {"enable_prefix_caching": False,
          "max_num_batched_tokens": 256,  # a long prompt prefills over several steps
          "num_gpu_blocks_override": 11,  # 10 usable: two 700-token requests do not fit
          "max_model_len": 1024,
          "enable_lora": True, "max_loras": 2, "max_lora_rank": LORA_RANK}


@pytest.fixture(scope="module")
def engine(model_dir):
    with served_engine(model_dir, BLOCK_TOKENS, ENGINE) as started:
        yield started


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """Two random LoRA adapters on q_proj and v_proj of the small Llama, as PEFT writes them."""
    root = tmp_path_factory.mktemp("lora")
    return {name: (name, index + 1, write_adapter(root / name, model_dir, seed=index + 1))
            for index, name in enumerate(("lora-a", "lora-b"))}


def write_adapter(path, model_dir: str, seed: int) -> str:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    head_dim = config.hidden_size // config.num_attention_heads
    widths = {"q_proj": config.num_attention_heads * head_dim,
              "v_proj": config.num_key_value_heads * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, width in widths.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = 0.1 * torch.randn(
                LORA_RANK, config.hidden_size, generator=generator)
            tensors[f"{name}.lora_B.weight"] = 0.1 * torch.randn(width, LORA_RANK,
                                                                 generator=generator)
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": 16,
        "lora_dropout": 0.0, "target_modules": list(widths), "bias": "none",
        "fan_in_fan_out": False, "base_model_name_or_path": model_dir,
        "modules_to_save": None, "use_rslora": False, "use_dora": False}))
    return str(path)


def generate(engine, prompt, **kwargs):
    return ray.get(engine.generate.remote(prompt, MAX_TOKENS, **kwargs))


def saved(engine, prompt, num_tokens, timeout_s: float = 30.0):
    """Wait until raykv holds the prompt's first num_tokens (saves are in the background)."""
    client = connect(SMALL_LLAMA)
    deadline_s = time.monotonic() + timeout_s
    while client.lookup(prompt) < num_tokens:
        assert time.monotonic() < deadline_s, "the engine's pages never reached raykv"
        time.sleep(0.2)


def settled_stats(engine, timeout_s: float = 10.0) -> dict:
    """The worker's stats once its queued puts are done (two equal reads 0.3 s apart)."""
    deadline_s, last = time.monotonic() + timeout_s, None
    while (stats := ray.get(engine.worker_stats.remote())) != last:
        assert time.monotonic() < deadline_s
        last = stats
        time.sleep(0.3)
    return stats


def test_chunked_prefill_saves_each_page_once_and_a_rerun_loads_them(engine):
    prompt = prompt_tokens(1000, seed=11)  # 7 full pages, prefilled 256 tokens a step
    full = 1000 // BLOCK_TOKENS * BLOCK_TOKENS
    before = settled_stats(engine)
    ids, cached = generate(engine, prompt)
    assert cached == 0
    saved(engine, prompt, full)
    after = settled_stats(engine)
    # Each page was copied out and put once: 896 tokens, not 256 + 512 + 768 + 896.
    assert after["saved_tokens"] - before.get("saved_tokens", 0) == full
    assert after["gathered_tokens"] - before.get("gathered_tokens", 0) == full
    rerun, cached = generate(engine, prompt)
    assert cached == full and rerun == ids


def test_a_prompt_raykv_holds_whole_is_loaded_but_for_its_last_token(engine):
    """A prompt of whole pages that raykv holds: vLLM takes all but its last token from raykv
    and computes that one (not its whole last 128-token block), and decodes the same
    tokens."""
    prompt = prompt_tokens(7 * BLOCK_TOKENS, seed=31)
    ids, cached = generate(engine, prompt)
    assert cached == 0
    saved(engine, prompt, len(prompt))
    before = settled_stats(engine)
    rerun, cached = generate(engine, prompt)
    assert cached == len(prompt) - 1 and rerun == ids
    after = settled_stats(engine)
    assert after["saved_tokens"] == before["saved_tokens"]  # its last page is not put again


def test_a_finished_request_s_pages_are_in_the_directory_when_its_output_is_out(engine):
    """raykv.save_mode "auto": each save is flushed, and the step after it waits for that, so
    another engine that asks for the prompt right after the response finds every page. Its
    commit alone, from the busy engine's background threads, took up to 0.7 s.

    The wait is bounded by the saved tokens' recompute time (README, save_mode): on a loaded
    machine a save can outlast it and is counted in late_saves, which "auto" allows. CI on
    49b3fb7 saw one such save (alongside the main tier's tests); its pages were still found."""
    reader = connect(SMALL_LLAMA)
    for seed in (21, 22, 23):
        prompt = prompt_tokens(900, seed=seed)  # 7 full pages, over 4 prefill steps
        before = ray.get(engine.worker_stats.remote())
        generate(engine, prompt)
        assert reader.lookup(prompt) == 900 // BLOCK_TOKENS * BLOCK_TOKENS, f"seed {seed}"
        after = ray.get(engine.worker_stats.remote())
        assert after["num_settles"] > before.get("num_settles", 0)  # the step waited
        assert after["unflushed_saves"] == 0


def test_the_connector_measures_its_loads_per_tier_and_the_engine_s_prefill(engine):
    """The worker's loads reach the scheduler side on vLLM's stats path (RaykvLoadStats), and
    the scheduler side times the steps: what the replica publishes for raykv's router."""
    prompt = prompt_tokens(900, seed=23)
    full = 900 // BLOCK_TOKENS * BLOCK_TOKENS
    generate(engine, prompt)
    saved(engine, prompt, full)
    before = engine_rates(engine)
    _, cached = generate(engine, prompt)
    assert cached == full
    after = engine_rates(engine)
    host_bytes_per_s, host_latency_s, num_samples = after["paths"]["host"]
    assert num_samples == before.get("paths", {}).get("host", [0, 0, 0])[2] + 1
    assert host_bytes_per_s > 0
    # The load's time outside its raykv reads (the directory, the hand-off) is measured as the
    # path's latency, not spread over its bytes (engine_rates.load_samples).
    assert host_latency_s > 0
    assert after["prefill_samples"] > before.get("prefill_samples", 0)
    assert after["prefill_tokens_per_s"] > 0 and after["step_overhead_s"] >= 0
    assert after["page_tokens"] == BLOCK_TOKENS
    assert after["page_bytes"] == SMALL_LLAMA.page_bytes(BLOCK_TOKENS)


def test_load_stats_aggregate_across_workers_and_reduce_for_vllm_s_log():
    from cluster.serving.vllm_connector import RaykvConnector
    from cluster.serving.vllm_stats import RaykvLoadStats

    one = RaykvLoadStats({"loads": [["host", 2_000_000, 0.001]],
                          "in_step": [[2_000_000, 0.001, 1]]})
    two = RaykvConnector.build_kv_connector_stats({"loads": [["disk", 1_000_000, 0.01, 0.004],
                                                              ["host", 2_000_000, 0.003]]})
    merged = one.aggregate(two)
    assert merged.samples == [("host", 2_000_000, 0.001), ("disk", 1_000_000, 0.01, 0.004),
                              ("host", 2_000_000, 0.003)]
    assert merged.in_step == [(2_000_000, 0.001, True)]
    assert merged.reduce() == {"raykv disk loads": 1, "raykv disk MB/s": 100.0,
                               "raykv host loads": 2, "raykv host MB/s": 1000.0,
                               "raykv loads in the step": 1}
    assert not merged.is_empty()
    merged.reset()
    assert merged.is_empty() and RaykvConnector.build_kv_connector_stats(None).is_empty()


def engine_rates(engine) -> dict:
    """What the scheduler side's meter would publish now ({} before it has one)."""
    meter = ray.get(engine.scheduler_connector.remote("_meter"))
    return {} if meter is None else meter.published()


def test_lookups_answer_none_while_in_flight(engine):
    """With raykv.load_mode "async", every new request's lookup runs off the scheduler's
    thread: vLLM heard None ("ask again") at least once per request while it was out, and
    went on stepping."""
    ray.get(engine.set_scheduler_connector.remote("_budget.mode", "async"))
    try:
        asked = ray.get(engine.scheduler_connector.remote("_lookups.num_in_flight_answers"))
        generate(engine, prompt_tokens(300, seed=12))
        after = ray.get(engine.scheduler_connector.remote("_lookups.num_in_flight_answers"))
    finally:
        ray.get(engine.set_scheduler_connector.remote("_budget.mode", "auto"))
    assert asked is not None and after > asked


def test_an_engine_that_runs_nothing_waits_for_its_lookup_in_the_step(engine):
    """raykv.load_mode "auto": a request that arrives at an engine running nothing has its
    lookup waited for in the step, even one measured far slower than the step's budget (the
    lookup time is set to 10 s before each): waiting holds up no other request, and not
    waiting cost it whole steps. Bounded by one step's measured time, so at least two of
    three fresh prompts land theirs in the step that asked."""
    waited_before = ray.get(engine.scheduler_connector.remote("_lookups.num_waited_answers"))
    for seed in (31, 32, 33):
        ray.get(engine.set_scheduler_connector.remote("_lookups.lookup_s", 10.0))
        generate(engine, prompt_tokens(300, seed=seed))
    waited = ray.get(engine.scheduler_connector.remote("_lookups.num_waited_answers"))
    assert waited - waited_before >= 2


def test_a_load_made_in_the_step_gives_the_tokens_computed_and_a_failed_one_recomputes(
        engine):
    """raykv.load_mode "sync": the lookup is waited for and the hit loaded in the step
    (vLLM's synchronous load), with the same greedy tokens as the prefill that computed it.
    A load in the step that fails is a miss: vLLM recomputes those blocks, same tokens."""
    prompt = prompt_tokens(700, seed=24)
    full = 700 // BLOCK_TOKENS * BLOCK_TOKENS
    ids, _ = generate(engine, prompt)
    saved(engine, prompt, full)
    ray.get(engine.set_scheduler_connector.remote("_budget.mode", "sync"))
    try:
        sync_before = ray.get(engine.scheduler_connector.remote("num_sync_loads"))
        none_before = ray.get(engine.scheduler_connector.remote(
            "_lookups.num_in_flight_answers"))
        loaded_before = settled_stats(engine).get("loaded_tokens", 0)
        again, cached = generate(engine, prompt)
        assert cached == full and again == ids
        assert ray.get(engine.scheduler_connector.remote("num_sync_loads")) == sync_before + 1
        assert ray.get(engine.scheduler_connector.remote(
            "_lookups.num_in_flight_answers")) == none_before  # never "ask again"
        assert settled_stats(engine)["loaded_tokens"] == loaded_before + full
        ray.get(engine.fail_loads.remote(1))
        failed_before = settled_stats(engine).get("failed_tokens", 0)
        recomputed, _ = generate(engine, prompt)
        assert recomputed == ids
        assert ray.get(engine.scheduler_connector.remote("num_sync_loads")) == sync_before + 2
    finally:
        ray.get(engine.set_scheduler_connector.remote("_budget.mode", "auto"))
    assert settled_stats(engine)["failed_tokens"] == failed_before + full


def test_a_step_whose_load_failed_saves_nothing_so_raykv_never_holds_its_wrong_pages(engine):
    """A load in the step that fails leaves its blocks unfilled, and the same step's forward
    computes the next tokens over them; vLLM learns of the blocks only after the step's saves,
    then recomputes. Those pages must never reach raykv (a stored page is never replaced):
    a later request that loads the prompt gets the tokens the recomputed prefill gave."""
    prompt = prompt_tokens(700, seed=42)
    generate(engine, prompt[:300])
    saved(engine, prompt, 2 * BLOCK_TOKENS)  # the first two pages, shared with `prompt`
    ray.get(engine.set_scheduler_connector.remote("_budget.mode", "sync"))
    try:
        skipped_before = ray.get(engine.worker_connector.remote("skipped_saves"))
        ray.get(engine.fail_loads.remote(1))
        # The hit (2 pages) fails in the step, whose forward computes pages 2 and 3 over it.
        recomputed, _ = generate(engine, prompt)
        assert ray.get(engine.worker_connector.remote("skipped_saves")) > skipped_before
        settled_stats(engine)
        held = connect(SMALL_LLAMA).lookup(prompt)
        again, cached = generate(engine, prompt)  # loads all raykv holds of it, in the step
        assert cached == held >= 2 * BLOCK_TOKENS and again == recomputed
    finally:
        ray.get(engine.set_scheduler_connector.remote("_budget.mode", "auto"))


def test_after_a_cache_reset_the_engine_loads_nothing_saved_before_and_saves_anew(engine):
    """vLLM's reset_prefix_cache(reset_connector=True), asked around a weight update: pages
    raykv holds from before (other weights, for all raykv knows) are never loaded again by
    this engine, which keys its pages anew; it still saves and loads its new ones. The old
    pages stay for other engines."""
    prompt = prompt_tokens(520, seed=43)
    full = 520 // BLOCK_TOKENS * BLOCK_TOKENS
    ids, _ = generate(engine, prompt)
    saved(engine, prompt, full)
    assert generate(engine, prompt)[1] == full  # loaded from raykv
    assert ray.get(engine.reset_caches.remote())
    after, cached = generate(engine, prompt)
    assert cached == 0 and after == ids  # computed again: nothing of before was loaded
    assert connect(SMALL_LLAMA).lookup(prompt) == full  # still there, for other engines
    deadline_s = time.monotonic() + 30
    while (cached := generate(engine, prompt)[1]) == 0:  # its new pages, keyed anew
        assert time.monotonic() < deadline_s, "the engine never loaded its new pages"
        time.sleep(0.5)
    assert cached == full


def test_two_lora_adapters_on_one_prompt_never_share_pages(engine, adapters):
    prompt = prompt_tokens(640, seed=13)
    full = 640 - 1  # 5 whole pages, held whole: all but the last token, which vLLM computes
    ids_a, cached_a = generate(engine, prompt, lora=adapters["lora-a"])
    assert cached_a == 0
    time.sleep(0.5)  # lora-a's saves are keyed apart (a plain lookup cannot see them): wait
    settled_stats(engine)
    ids_b, cached_b = generate(engine, prompt, lora=adapters["lora-b"])
    assert cached_b == 0, "lora-b loaded lora-a's KV"
    assert ids_b != ids_a  # the adapters matter: a shared page would change the output
    # Each adapter's own pages load, and its greedy output is the one it computed itself.
    settled_stats(engine)
    again_a, cached = generate(engine, prompt, lora=adapters["lora-a"])
    assert cached == full and again_a == ids_a
    again_b, cached = generate(engine, prompt, lora=adapters["lora-b"])
    assert cached == full and again_b == ids_b
    plain, cached = generate(engine, prompt)  # the base model shares neither's pages
    assert cached == 0


def test_cache_salts_keep_tenants_apart(engine):
    prompt = prompt_tokens(640, seed=14)
    ids, cached = generate(engine, prompt, cache_salt="tenant-1")
    assert cached == 0
    time.sleep(0.5)
    settled_stats(engine)
    _, cached = generate(engine, prompt, cache_salt="tenant-2")
    assert cached == 0, "tenant-2 loaded tenant-1's KV"
    _, cached = generate(engine, prompt)
    assert cached == 0
    settled_stats(engine)
    again, cached = generate(engine, prompt, cache_salt="tenant-1")
    assert cached == 640 - 1 and again == ids  # its 5 pages, held whole


def test_a_preempted_request_reloads_its_pages_and_decodes_the_same_tokens(engine):
    prompts = [prompt_tokens(600, seed=seed) for seed in (15, 16)]
    # Each alone, under a salt of its own: computed, nothing loaded.
    expected = [ray.get(engine.generate_many.remote([p], 100, None, f"alone-{i}"))[0][0]
                for i, p in enumerate(prompts)]
    ray.get(engine.count_preemptions.remote())
    loaded = settled_stats(engine).get("loaded_tokens", 0)
    together = ray.get(engine.generate_many.remote(prompts, 100))
    assert ray.get(engine.preemptions.remote()) > 0  # ten blocks hold one of them, not both
    # The preempted one came back through raykv: the pages it saved before it was preempted.
    assert settled_stats(engine)["loaded_tokens"] > loaded
    assert [ids for ids, _ in together] == expected
