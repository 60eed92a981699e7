"""`raykv bench pages` without Ray: the geometry and its scaling to the memory budget, the
request plans, the per-page overhead and ratio arithmetic, and the put's memcpy baseline."""

import pytest
import torch

from cluster.core.kvcheck import page_slices
from cluster.tools.bench import common, harness, pages

KiB, GiB = 1 << 10, 1 << 30


def test_llama_8b_geometry_is_128_kib_per_token_and_2_mib_per_16_token_page():
    assert pages.FULL_SPEC.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 128 * KiB
    assert pages.FULL_SPEC.page_bytes(16) == 2 << 20


def test_fit_plan_keeps_the_real_geometry_when_it_fits():
    needed = pages.footprint_bytes(pages.FULL_SPEC, 32768)
    plan = pages.fit_plan(needed, (16, 64), (256, 32768), 3)
    assert plan.spec == pages.FULL_SPEC and plan.layer_scale == 1
    assert plan.request_tokens == (256, 32768) and plan.max_tokens == 32768


def test_fit_plan_halves_the_layers_until_the_largest_request_fits():
    budget = pages.footprint_bytes(pages.FULL_SPEC, 32768) // 5  # 32 / 5 layers: 4 fit
    plan = pages.fit_plan(budget, (16,), (256, 4096, 32768), 3)
    assert plan.spec.num_layers == 4 and plan.layer_scale == 8
    assert plan.spec.bytes_per_token == 16 * KiB
    assert (plan.spec.num_kv_heads, plan.spec.head_dim) == (8, 128)
    assert pages.footprint_bytes(plan.spec, 32768) <= budget
    assert plan.request_tokens == (256, 4096, 32768)


def test_fit_plan_drops_the_sizes_one_layer_cannot_hold_but_keeps_the_smallest():
    one_layer = pages.footprint_bytes(pages._with_layers(1), 4096)
    plan = pages.fit_plan(one_layer, (16,), (256, 4096, 32768), 3)
    assert plan.spec.num_layers == 1 and plan.request_tokens == (256, 4096)
    assert pages.fit_plan(1, (16,), (256, 4096), 3).request_tokens == (256,)


def test_the_plans_request_sizes_are_whole_pages_and_include_the_ratios_sizes():
    for sizes in (pages.REQUEST_TOKENS, pages.QUICK_REQUEST_TOKENS):
        assert all(n % p == 0 for n in sizes for p in pages.PAGE_TOKENS)
        assert {tokens for *_, tokens in pages.RATIOS.values()} <= set(sizes)
    assert pages.RATIO_PAGE_TOKENS in pages.QUICK_PAGE_TOKENS
    assert pages.reps_for(256) == pages.SMALL_REPS and pages.reps_for(32768) == pages.LARGE_REPS


def test_overhead_is_the_time_per_page_above_the_memcpy_in_us():
    values = pages.round_values("overhead", [0.010, 0.012], [0.009, 0.009], 256)
    assert values == pytest.approx([1e-3 / 256 * 1e6, 3e-3 / 256 * 1e6])
    assert pages.round_values("ratio", [2.0, 3.0], [1.0, 2.0], 7) == [2.0, 1.5]
    assert pages.round_values("floor", [1.0, 2.0], [3.0, 1.0], 7) == [4.0, 1.5]


def test_own_work_is_per_page_and_the_copy_excess_is_what_the_copy_adds_above_the_memcpy():
    assert pages.round_values("per_page", [0.001, 0.002], [9.0, 9.0], 250) == pytest.approx(
        [4.0, 8.0])
    # get 10 ms = own work 2 ms + copy 7 ms + 1 ms more than the memcpy alone took
    excess = pages.round_values("excess", [0.010], [0.002], 250, memcpys=[0.007])
    assert excess == pytest.approx([1e-3 / 250 * 1e6])


def fake_page_size(rounds: dict[int, dict[str, list[float]]], not_taken=None) -> dict:
    return {"per_request": {str(n): {"pages": n // 16, "rounds": figures}
                            for n, figures in rounds.items()},
            "not_taken": not_taken or {}}


def rounds_of(get, memcpy, noop=1e-4) -> dict[str, list[float]]:
    return {"get": get, "memcpy_get": memcpy, "noop": [noop] * len(get),
            "acquire_get": get, "warm_get": memcpy, "put": get, "memcpy_put": memcpy,
            "own_get": [g - m for g, m in zip(get, memcpy, strict=True)],
            "own_get_after_copy": [g - m for g, m in zip(get, memcpy, strict=True)]}


def test_set_ratios_takes_each_ratio_from_its_size_as_a_median_of_rounds():
    report = harness.Report("pages", "us", {}, pages.GOALS)
    page_size = fake_page_size({
        256: rounds_of([2e-4, 1.5e-4, 3e-4], [5e-5] * 3),
        4096: rounds_of([0.0030, 0.0026, 0.0028], [0.0020] * 3),
        32768: rounds_of([0.020, 0.025, 0.016], [0.016] * 3)})
    pages.set_ratios(report, {"16": page_size})
    ratios = report.ratios
    assert ratios["small_page_overhead_us"] == pytest.approx(0.0008 / 256 * 1e6)
    assert ratios["get_256_tokens_vs_noop_call"] == pytest.approx(2.0)
    assert ratios["get_32k_tokens_vs_memcpy"] == pytest.approx(0.8)
    assert ratios["get_256_tokens_floor_vs_noop_call"] == pytest.approx(1.5)
    assert report["spread"]["get_32k_tokens_vs_memcpy"]["rounds"] == pytest.approx(
        [0.8, 0.64, 1.0])
    assert ratios["small_page_own_work_us"] == pytest.approx(0.0008 / 256 * 1e6)
    assert ratios["small_page_copy_excess_us"] == pytest.approx(0.0)


def test_set_ratios_leaves_null_what_was_not_run_or_not_taken():
    report = harness.Report("pages", "us", {}, pages.GOALS)
    page_size = fake_page_size({256: rounds_of([2e-4] * 3, [5e-5] * 3),
                                4096: rounds_of([3e-3] * 3, [2e-3] * 3)},
                               {"get@4096": "a cold get did not take every page"})
    pages.set_ratios(report, {"16": page_size})
    assert report.ratios["get_32k_tokens_vs_memcpy"] is None
    assert "32768" in report["not_exercised"]["get_32k_tokens_vs_memcpy"]
    assert report.ratios["small_page_overhead_us"] is None
    assert report["not_exercised"]["small_page_overhead_us"].startswith("a cold get")
    assert report.ratios["get_256_tokens_vs_noop_call"] == pytest.approx(2.0)
    assert harness.failed(report.result)


def test_memcpy_put_copies_kv_pages_into_the_private_buffers_with_copy_pages():
    spec = pages._with_layers(1)
    kv = common.page_kv(spec, 16, 4)
    targets = torch.zeros((4, *spec.page_shape(16)), dtype=kv.dtype)
    plan = pages.Plan(spec, (16,), (64,), 3, GiB)
    session = pages.Session(plan, 16, None, None, kv, common.touched_like(kv), targets)
    assert pages.contenders(session, 64)["memcpy_put"](0) > 0
    for p in range(4):
        common.check_same(targets[p], kv[:, :, :, page_slices(p, 16)], f"page {p}")


def test_every_batch_of_tokens_is_distinct_and_within_the_token_id_space():
    """A full run puts ~1,000 fresh batches; their ids must stay valid uint32 token ids
    (a stride of 1 << 24 overflowed past batch 255) and never overlap."""
    from cluster.core.keys import MAX_TOKEN_ID

    last = pages.batch_tokens(pages.MAX_BATCHES - 1, 32768)
    assert int(last.max()) <= MAX_TOKEN_ID
    first, second = pages.batch_tokens(1, 32768), pages.batch_tokens(2, 256)
    assert int(first.max()) < int(second.min())
    with pytest.raises(ValueError):
        pages.batch_tokens(pages.MAX_BATCHES, 16)
