"""KV-cache sizing: how many sequences of a given context fit in a VRAM budget.

Pure: no Ray. Figures are given for the model's own dtype and for 1-byte quantized storage
(fp8 e4m3 / int8), which also carries one float32 scale per page, per layer, per K/V and
per KV head:

    scale bytes per page = 4 x 2 x num_layers x num_kv_heads
    page bytes           = page_tokens x bytes_per_token (+ scale bytes when quantized)
    sequence bytes       = ceil(context_tokens / page_tokens) x page_bytes
    sequences that fit   = floor(vram_bytes / sequence bytes)
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction

from cluster.core.spec import DTYPE_BYTES, PRESETS, SCALE_BYTES, ModelSpec

QUANTIZED_DTYPES = ("fp8", "int8")

BYTE_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def parse_bytes(text: str) -> int:
    """ "80GiB", "1.5 GB", "4096" -> bytes. ValueError on anything else."""
    match = _BYTES_RE.match(text) if isinstance(text, str) else None
    unit = match.group(2).lower() if match else ""
    if match is None or (unit and unit not in BYTE_UNITS):
        units = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        raise ValueError(f"bad byte size {text!r}; expected a number and a unit ({units})")
    num_bytes = Fraction(match.group(1)) * BYTE_UNITS[unit or "b"]
    if num_bytes.denominator != 1:
        raise ValueError(f"bad byte size {text!r}: not a whole number of bytes")
    return int(num_bytes)


def format_bytes(num_bytes: int) -> str:
    """Binary human units: 17179869184 -> "16.0 GiB", 512 -> "512 B"."""
    value = float(num_bytes)
    for unit in _BINARY_UNITS:
        if abs(value) < 1024 or unit == _BINARY_UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def scale_bytes_per_page(spec: ModelSpec) -> int:
    """float32 scales of one quantized page: one per layer, K/V and KV head."""
    return SCALE_BYTES * 2 * spec.num_layers * spec.num_kv_heads


def resolve_spec(
    model: str,
    dtype: str | None = None,
    num_layers: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> ModelSpec:
    """A preset, a preset with geometry overrides (named "custom"), or a new named model.

    ValueError for an unknown model name that lacks any of the three geometry fields.
    """
    overrides = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    given = {field: value for field, value in overrides.items() if value is not None}
    if not given:
        return ModelSpec.preset(model, dtype)
    if len(given) == len(overrides) and model.lower() not in PRESETS:
        return ModelSpec(model, dtype=dtype or "bfloat16", **given)
    base = ModelSpec.preset(model, dtype)  # ValueError: unknown model, partial geometry
    return dataclasses.replace(base, name="custom", **given)


def _storage_row(spec: ModelSpec, storage: str, page_tokens: int, context_tokens: int) -> dict:
    """Per-token, per-page and per-sequence bytes of `spec` stored as `storage`."""
    quantized = storage != spec.dtype
    element_spec = spec.with_dtype(storage)
    scale_bytes = scale_bytes_per_page(spec) if quantized else 0
    page_bytes = element_spec.page_bytes(page_tokens) + scale_bytes
    num_pages = -(-context_tokens // page_tokens)
    return {
        "storage": storage,
        "quantized": quantized,
        "dtype_bytes": DTYPE_BYTES[storage],
        "bytes_per_token": element_spec.bytes_per_token,
        "scale_bytes_per_page": scale_bytes,
        "page_bytes": page_bytes,
        "bytes_per_sequence": num_pages * page_bytes,
    }


def _check_positive(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def size_report(
    spec: ModelSpec, context_tokens: int, vram_bytes: int, page_tokens: int = 256
) -> dict:
    """JSON-able sizing of `spec` at `context_tokens` in `vram_bytes`, per storage format.

    ``storage`` holds the model's dtype first, then fp8 and int8 (quantized, with scales).
    """
    _check_positive("context_tokens", context_tokens)
    _check_positive("vram_bytes", vram_bytes, minimum=0)
    _check_positive("page_tokens", page_tokens)
    storages = dict.fromkeys((spec.dtype, *QUANTIZED_DTYPES))
    rows = {s: _storage_row(spec, s, page_tokens, context_tokens) for s in storages}
    native_seq_bytes = rows[spec.dtype]["bytes_per_sequence"]
    for row in rows.values():
        row["sequences_fit"] = vram_bytes // row["bytes_per_sequence"]
        row["pages_fit"] = vram_bytes // row["page_bytes"]
        row["ratio_vs_model_dtype"] = row["bytes_per_sequence"] / native_seq_bytes
    native = rows[spec.dtype]
    return {
        "model": {
            "name": spec.name,
            "num_layers": spec.num_layers,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "dtype": spec.dtype,
        },
        "context_tokens": context_tokens,
        "page_tokens": page_tokens,
        "vram_bytes": vram_bytes,
        "pages_per_sequence": -(-context_tokens // page_tokens),
        "bytes_per_token": native["bytes_per_token"],
        "bytes_per_sequence": native["bytes_per_sequence"],
        "sequences_fit": native["sequences_fit"],
        "storage": rows,
    }
