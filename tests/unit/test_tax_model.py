"""The paging-tax model: read bytes, pages on disk, the prediction and the ratios. Pure."""

import math

import pytest

from cluster.core.tax_model import (
    GOALS,
    MODES,
    DiskCost,
    defined,
    hidden_fraction,
    num_disk_pages,
    page_read_bytes,
    predicted_tax_s,
    round_taxes_s,
    tax_round_ratios,
)


def test_a_page_read_is_its_header_block_and_its_payload_rounded_up():
    assert page_read_bytes(1 << 20) == 4096 + (1 << 20)
    assert page_read_bytes(262_208) == 4096 + 266_240  # fp8 of a 1 MiB float32 page
    assert page_read_bytes(1) == 8192
    with pytest.raises(ValueError):
        page_read_bytes(0)


@pytest.mark.parametrize(("num_pages", "fraction", "expected"),
                         [(256, 0.25, 64), (10, 0.25, 2), (3, 0.01, 1), (7, 1.0, 7)])
def test_pages_on_disk(num_pages, fraction, expected):
    assert num_disk_pages(num_pages, fraction) == expected


@pytest.mark.parametrize(("num_pages", "fraction"), [(0, 0.5), (8, 0.0), (8, 1.5), (8, -0.1)])
def test_pages_on_disk_refuses_what_cannot_run(num_pages, fraction):
    with pytest.raises(ValueError):
        num_disk_pages(num_pages, fraction)


def test_prediction_is_pages_times_latency_plus_bytes_over_bandwidth():
    cost = DiskCost(latency_s=50e-6, bandwidth_bytes_per_s=2e9)
    assert cost.read_s(1_000_000) == pytest.approx(50e-6 + 500e-6)
    assert predicted_tax_s(64, 1_000_000, cost) == pytest.approx(64 * 550e-6)
    assert predicted_tax_s(0, 4096, cost) == 0.0
    # doubling the bytes of a bandwidth-bound page doubles its tax, less the latency share
    small, large = predicted_tax_s(10, 4096, cost), predicted_tax_s(10, 8192, cost)
    assert large - small == pytest.approx(10 * 4096 / 2e9)


def test_round_taxes_subtract_the_same_rounds_resident_time():
    token_s = {"resident": [1.0, 2.0], "none": [1.5, 2.25], "fp8": [1.25, 2.0]}
    assert round_taxes_s(token_s) == {"none": [0.5, 0.25], "fp8": [0.25, 0.0]}


def test_hidden_fraction():
    assert hidden_fraction(0.0, 2.0) == 1.0
    assert hidden_fraction(0.5, 2.0) == 0.75
    assert hidden_fraction(-0.2, 2.0) == pytest.approx(1.1)  # faster than resident: noise
    assert math.isnan(hidden_fraction(0.1, 0.0))


def test_ratios_are_taken_within_each_round():
    taxes_s = {"none": [2.0, 4.0, 3.0], "none+prefetch": [0.2, 2.0, 0.3],
               "fp8": [0.5, 2.0, 1.5], "int8": [1.0] * 3, "fp8+prefetch": [0.1] * 3,
               "loads-beside": [0.1, 2.0, 0.6]}
    ratios = tax_round_ratios(taxes_s, predicted_none_s=[2.5, 2.0, 3.0])
    assert ratios["tax_measured_vs_model"] == pytest.approx([0.8, 2.0, 1.0])
    assert ratios["tax_hidden_by_prefetch"] == pytest.approx([0.9, 0.5, 0.9])
    assert ratios["tax_fp8_vs_none"] == pytest.approx([0.25, 0.5, 0.5])
    assert ratios["tax_interference_share"] == pytest.approx([0.5, 1.0, 2.0])
    assert set(ratios) == set(GOALS) | {"tax_interference_share"}


def test_rounds_without_a_raw_page_tax_have_no_ratio_to_it():
    taxes_s = {"none": [2.0, -0.1, 4.0], "none+prefetch": [0.2, 0.5, 0.4],
               "fp8": [1.0, 0.3, 1.0], "int8": [1.0] * 3, "fp8+prefetch": [0.1] * 3,
               "loads-beside": [0.1, 0.1, 0.1]}
    ratios = tax_round_ratios(taxes_s, predicted_none_s=[2.0, 2.0, 2.0])
    assert defined(ratios["tax_hidden_by_prefetch"]) == pytest.approx([0.9, 0.9])
    assert defined(ratios["tax_fp8_vs_none"]) == pytest.approx([0.5, 0.25])
    assert defined([math.nan]) == [] and defined([1.0, math.nan]) == [1.0]


def test_every_mode_is_decodable_and_named_once():
    from cluster.core.paged_decode import DECODE_STEPS
    from cluster.core.quant import CODECS

    assert len({mode.name for mode in MODES}) == len(MODES)
    for mode in MODES:
        assert mode.step in DECODE_STEPS
        assert mode.codec is None or mode.codec in CODECS
