"""KV quantization codecs: round trips, error bounds, payload sizes."""

import math

import numpy as np
import pytest
import torch

from cluster.core.quant import (
    CODECS,
    codec_id,
    codec_name,
    decode_page,
    decode_pages,
    encode_page,
    payload_bytes,
    quant_report,
)

SHAPE = (2, 2, 2, 16, 16)  # [layers, k/v, kv heads, tokens, head_dim]
NUM_SCALES = 2 * 2 * 2
NUM_ELEMENTS = 2 * 2 * 2 * 16 * 16
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_page(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # Heads of very different magnitudes, so that per-head scales matter.
    head_scale = torch.logspace(-2, 1, NUM_SCALES).view(2, 2, 2, 1, 1)
    return (torch.randn(SHAPE, generator=generator) * head_scale).to(dtype)


def round_trip(page: torch.Tensor, codec: str) -> torch.Tensor:
    return decode_page(encode_page(page, codec), codec, tuple(page.shape), page.dtype)


def rel_rms(decoded: torch.Tensor, page: torch.Tensor) -> float:
    error = decoded.float() - page.float()
    return float(error.square().mean().sqrt() / page.float().square().mean().sqrt())


@pytest.mark.parametrize("dtype", DTYPES)
def test_none_round_trip_is_bit_exact(dtype):
    page = make_page(dtype)
    payload = encode_page(page, "none")
    assert payload.dtype == np.uint8 and payload.ndim == 1
    assert payload.size == NUM_ELEMENTS * dtype.itemsize == payload_bytes(SHAPE, dtype, "none")
    assert payload.tobytes() == page.view(torch.uint8).numpy().tobytes()
    decoded = decode_page(payload, "none", SHAPE, dtype)
    assert decoded.dtype == dtype and torch.equal(decoded.view(torch.uint8), page.view(torch.uint8))


def test_none_payload_is_a_copy():
    page = make_page()
    payload = encode_page(page, "none")
    decoded = decode_page(payload, "none", SHAPE, torch.float32)
    page.zero_()
    payload[:] = 0
    assert decoded.abs().sum() > 0


# Measured on make_page(seed 0) over the three dtypes: int8 rel_rms 0.0073-0.0074,
# fp8 rel_rms 0.0256-0.0267 (e4m3 keeps 3 mantissa bits: ~2^-4 worst-case relative error).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("codec", "max_rel_rms"), [("int8", 1e-2), ("fp8", 4e-2)])
def test_quantized_round_trip_error_is_bounded(dtype, codec, max_rel_rms):
    page = make_page(dtype)
    decoded = round_trip(page, codec)
    assert decoded.dtype == dtype and decoded.shape == SHAPE
    assert rel_rms(decoded, page) < max_rel_rms


def test_int8_error_is_at_most_half_a_step_per_head():
    page = make_page()
    step = page.abs().amax(dim=(-2, -1), keepdim=True) / 127
    error = (round_trip(page, "int8") - page).abs()
    assert bool((error <= step * (0.5 + 1e-5)).all())


def test_fp8_error_is_relative_per_element():
    page = make_page()
    scale = page.abs().amax(dim=(-2, -1), keepdim=True) / 448
    error = (round_trip(page, "fp8") - page).abs()
    # Normal e4m3 values round to within 2^-4 relative; subnormals to within 2^-10 of a scale.
    bound = torch.maximum(page.abs() * 2**-4, scale * 2**-10) * (1 + 1e-5)
    assert bool((error <= bound).all())


@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_quantized_payload_is_scales_then_one_byte_per_element(codec):
    payload = encode_page(make_page(), codec)
    assert payload.size == NUM_SCALES * 4 + NUM_ELEMENTS == 2080
    assert payload.size == payload_bytes(SHAPE, torch.float32, codec)
    assert payload_bytes(SHAPE, torch.bfloat16, codec) == 2080
    # float32 -> one byte per element, less the scales: 8192 / 2080 = 3.94x smaller.
    assert payload_bytes(SHAPE, torch.float32, "none") / payload.size == pytest.approx(3.938, 1e-3)
    scales = payload[: NUM_SCALES * 4].view(np.float32)
    expected = make_page().abs().amax(dim=(-2, -1)).reshape(-1) / CODECS[codec].qmax
    assert np.allclose(scales, expected.numpy(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_fills_out_in_place(codec, dtype):
    page = make_page(dtype)
    payload = encode_page(page, codec)
    out = torch.full(SHAPE, 7.0, dtype=dtype)
    address = out.data_ptr()
    result = decode_page(payload, codec, SHAPE, dtype, out=out)
    assert result is out and out.data_ptr() == address
    assert torch.equal(out, decode_page(payload, codec, SHAPE, dtype))


@pytest.mark.parametrize("codec", list(CODECS))
def test_encode_into_a_larger_buffer_uses_its_head(codec):
    page = make_page()
    buffer = np.full(8192 + 4096, 0xAB, dtype=np.uint8)
    payload = encode_page(page, codec, out=buffer)
    assert np.shares_memory(payload, buffer) and payload.size == payload_bytes(
        SHAPE, torch.float32, codec
    )
    assert payload.tobytes() == encode_page(page, codec).tobytes()
    assert (buffer[payload.size :] == 0xAB).all()


@pytest.mark.parametrize("codec", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_page_round_trips_to_zero(codec, dtype):
    page = torch.zeros(SHAPE, dtype=dtype)
    payload = encode_page(page, codec)
    assert (payload[: NUM_SCALES * 4].view(np.float32) == 1.0).all()
    decoded = decode_page(payload, codec, SHAPE, dtype)
    assert torch.equal(decoded, page)


def test_read_only_payload_decodes():
    page = make_page()
    payload = encode_page(page, "int8")
    payload.flags.writeable = False
    assert torch.equal(decode_page(payload, "int8", SHAPE, torch.float32), round_trip(page, "int8"))


def test_unknown_codec_names_the_known_ones():
    page = make_page()
    with pytest.raises(ValueError, match="none, fp8, int8"):
        encode_page(page, "int4")
    with pytest.raises(ValueError, match="none, fp8, int8"):
        decode_page(np.zeros(16, np.uint8), "int4", SHAPE, torch.float32)
    with pytest.raises(ValueError, match="none, fp8, int8"):
        payload_bytes(SHAPE, torch.float32, "int4")
    with pytest.raises(ValueError, match="none, fp8, int8"):
        codec_id("int4")


def test_bad_payload_out_and_shape_are_value_errors():
    payload = encode_page(make_page(), "fp8")
    with pytest.raises(ValueError, match="2080 bytes"):
        decode_page(payload[:-1], "fp8", SHAPE, torch.float32)
    with pytest.raises(ValueError, match="out must be"):
        decode_page(payload, "fp8", SHAPE, torch.float32, out=torch.empty(SHAPE, dtype=torch.half))
    with pytest.raises(ValueError, match="at least 2080 bytes"):
        encode_page(make_page(), "fp8", out=np.empty(2079, np.uint8))
    with pytest.raises(ValueError, match="a page is"):
        encode_page(torch.zeros(2, 2, 16), "int8")


def test_codec_ids_are_stable():
    assert {name: codec_id(name) for name in CODECS} == {"none": 0, "fp8": 1, "int8": 2}
    assert [codec_name(i) for i in range(3)] == ["none", "fp8", "int8"]
    with pytest.raises(ValueError, match="known ids"):
        codec_name(3)


def test_quant_report_counts_bytes_and_errors():
    kv = torch.cat([make_page(seed=0), make_page(seed=1)[:, :, :, :8]], dim=3)  # 24 tokens
    report = {row["codec"]: row for row in quant_report(kv, page_tokens=16)}
    assert list(report) == ["none", "fp8", "int8"]
    before_bytes = 24 * 2 * 2 * 2 * 16 * 4
    assert all(
        row["bytes_before"] == before_bytes and row["num_pages"] == 2 for row in report.values()
    )
    assert report["none"]["bytes_after"] == before_bytes
    assert report["none"]["max_abs_err"] == 0.0 and report["none"]["bytes_saved_ratio"] == 0.0
    quantized_bytes = 2 * NUM_SCALES * 4 + before_bytes // 4
    for codec in ("fp8", "int8"):
        assert report[codec]["bytes_after"] == quantized_bytes
        assert report[codec]["bytes_saved_ratio"] == pytest.approx(
            1 - quantized_bytes / before_bytes
        )
    assert 0 < report["int8"]["rel_rms_err"] < 1e-2 < report["fp8"]["rel_rms_err"] < 4e-2
    assert 0 < report["int8"]["max_abs_err"] < report["fp8"]["max_abs_err"]


def _payload_of(codes: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """A quantized payload from raw codes and per-head scales (the layout encode_page writes)."""
    return np.concatenate([scales.reshape(-1).numpy().view(np.uint8),
                           codes.reshape(-1).view(torch.uint8).numpy()])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 3e-7, 1e3, 2.0**20])  # 2^20: past the folded scale
def test_fp8_decode_is_exact_for_every_code(dtype, scale):
    # Every e4m3 bit pattern but the two NaNs, subnormals and -0 included, in each head.
    patterns = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    shape = (1, 2, 1, 2, 127)
    codes = patterns.repeat(2).view(torch.float8_e4m3fn).view(shape)
    scales = torch.tensor([scale, scale / 3], dtype=torch.float32).view(1, 2, 1, 1, 1)
    expected = (codes.float() * scales).to(dtype)
    decoded = decode_page(_payload_of(codes, scales), "fp8", shape, dtype)
    assert torch.equal(decoded.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_batch_decodes_as_its_pages_do_one_by_one(codec, dtype):
    """decode_pages over padded rows into strided outs (a window's aligned buffers) gives each
    page exactly what decode_page gives it, and touches nothing between the rows."""
    pages = [make_page(dtype) * (index + 1) for index in range(3)]
    payloads = [encode_page(page, codec) for page in pages]
    row_bytes = payloads[0].size + 4096 - payloads[0].size % 4096
    rows = torch.zeros(3, row_bytes, dtype=torch.uint8)
    for row, payload in zip(rows, payloads, strict=True):
        row[: payload.size] = torch.from_numpy(payload)
    elements = math.prod(SHAPE)
    block = torch.full((3, elements + 64), 5.0, dtype=dtype)  # each out row padded by 64
    out = block[:, :elements].unflatten(1, SHAPE)
    decode_pages(rows, codec, SHAPE, out)
    for index, payload in enumerate(payloads):
        assert torch.equal(out[index], decode_page(payload, codec, SHAPE, dtype))
    assert (block[:, elements:] == 5.0).all()


def test_decode_pages_refuses_a_batch_that_does_not_match():
    rows = torch.zeros(2, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="payloads"):
        decode_pages(rows, "fp8", SHAPE, torch.empty(2, *SHAPE))
