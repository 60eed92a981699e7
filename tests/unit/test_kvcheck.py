"""KV validation at the client boundary: each bad input gets an error naming the problem."""

import numpy as np
import pytest
import torch

from cluster.core.kvcheck import check_kv, check_out, page_slices
from cluster.core.spec import ModelSpec

SPEC = ModelSpec("tiny", 2, 2, 16, "float32")


def kv(num_tokens=8, dtype=torch.float32, shape=None):
    return torch.zeros(shape or (2, 2, 2, num_tokens, 16), dtype=dtype)


def test_valid_kv_passes():
    check_kv(kv(8), SPEC, 8)
    check_kv(kv(0), SPEC, 0)
    check_kv(kv(8)[:, :, :, :5], SPEC, 5)  # a non-contiguous slice is still valid


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int8])
def test_wrong_dtype_is_type_error_naming_dtype(dtype):
    with pytest.raises(TypeError, match=r"dtype.*" + str(dtype).replace(".", r"\.")) as info:
        check_kv(kv(8, dtype=dtype), SPEC, 8)
    assert "torch.float32" in str(info.value)
    assert "'tiny'" in str(info.value)


@pytest.mark.parametrize("shape", [
    (3, 2, 2, 8, 16),  # layers
    (2, 1, 2, 8, 16),  # K and V
    (2, 2, 4, 8, 16),  # kv heads
    (2, 2, 2, 8, 8),  # head_dim
    (2, 2, 8, 16),  # 4-D
    (1, 2, 2, 2, 8, 16),  # 6-D
    (),
])
def test_wrong_shape_is_value_error_naming_the_layout(shape):
    with pytest.raises(ValueError) as info:
        check_kv(kv(shape=shape) if shape else torch.tensor(0.0), SPEC, 8)
    message = str(info.value)
    assert f"shape {shape}" in message
    assert "[num_layers=2, 2, num_kv_heads=2, num_tokens, head_dim=16]" in message


def test_dtype_is_checked_before_shape():
    with pytest.raises(TypeError, match="dtype"):
        check_kv(kv(shape=(1, 1, 1), dtype=torch.float16), SPEC, 8)


@pytest.mark.parametrize(("held", "claimed"), [(8, 7), (8, 9), (0, 4), (4, 0)])
def test_token_count_mismatch_is_value_error(held, claimed):
    with pytest.raises(ValueError, match=f"kv holds {held} tokens but tokens has {claimed}"):
        check_kv(kv(held), SPEC, claimed)


@pytest.mark.parametrize("value", [np.zeros((2, 2, 2, 8, 16), np.float32), [[0.0]], None, 3.0])
def test_non_tensor_is_type_error(value):
    with pytest.raises(TypeError, match=r"kv must be a torch\.Tensor, got " + type(value).__name__):
        check_kv(value, SPEC, 8)


def test_check_out_needs_room_for_full_pages_only():
    check_out(kv(8), SPEC, num_tokens=11, page_tokens=4)  # 2 full pages = 8 tokens
    check_out(kv(16), SPEC, num_tokens=11, page_tokens=4)
    with pytest.raises(ValueError, match="out has room for 4 tokens; the full pages of tokens "
                                         "need 8"):
        check_out(kv(4), SPEC, num_tokens=11, page_tokens=4)


def test_check_out_names_out_in_errors():
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        check_out(np.zeros(4), SPEC, 4, 4)
    with pytest.raises(TypeError, match="out dtype"):
        check_out(kv(8, dtype=torch.float16), SPEC, 8, 4)
    with pytest.raises(ValueError, match="out shape"):
        check_out(kv(shape=(2, 2, 3, 8, 16)), SPEC, 8, 4)


def test_page_slices():
    assert page_slices(0, 4) == slice(0, 4)
    assert page_slices(3, 16) == slice(48, 64)


def test_a_tensor_on_a_device_raykv_cannot_copy_is_a_type_error_naming_it():
    """Found by a probe: a meta kv got torch's own error, after a leased put had taken its
    slots; now it is refused first, by name."""
    with pytest.raises(TypeError, match="kv is on device 'meta'"):
        check_kv(kv(8).to("meta"), SPEC, 8)
    with pytest.raises(TypeError, match="out is on device 'meta'"):
        check_out(kv(8).to("meta"), SPEC, 8, 4)
