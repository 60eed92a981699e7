"""The paging tax: the per-token latency that KV pages on disk add to decoding.

A decode step attends to the whole context, so every page that lives on disk is read once per
token. DESIGN.md predicts the cost of those reads as

    tax per token = pages touched x (latency + page read bytes / bandwidth)

where a page read moves what DiskArena reads for one page: its header block and its payload
rounded up to 4096 (O_DIRECT). The measured tax is a token's time with pages on disk less its
time with every page in memory, the same compute in both.

The modes a token is decoded in, and the ratios that judge the result:

    resident         every page in memory: the compute alone
    none             disk pages raw (the page's dtype), read when needed
    none+prefetch    the same reads issued ahead, overlapping the attention to resident pages
    fp8, int8        quantized disk pages (about 1/4 of float32's bytes), read when needed
    fp8+prefetch     both cuts together

Pure: no Ray, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.core.tiers.aligned import round_up
from cluster.core.tiers.disk import HEADER_BYTES


@dataclass(frozen=True, slots=True)
class Mode:
    """How a token is decoded: the disk pages' codec (None: every page in memory) and the
    decode step (paged_decode.DECODE_STEPS: resident, sync, prefetch, or beside: a
    diagnostic that loads the disk pages as prefetch does but attends to every page from
    memory)."""

    name: str
    codec: str | None
    step: str


RESIDENT = Mode("resident", None, "resident")
MODES: tuple[Mode, ...] = (
    RESIDENT,
    Mode("none", "none", "sync"),
    Mode("none+prefetch", "none", "prefetch"),
    Mode("fp8", "fp8", "sync"),
    Mode("int8", "int8", "sync"),
    Mode("fp8+prefetch", "fp8", "prefetch"),
    Mode("loads-beside", "none", "beside"),
)
MODES_BY_NAME: dict[str, Mode] = {mode.name: mode for mode in MODES}

GOALS: dict[str, dict[str, float]] = {
    "tax_measured_vs_model": {"min": 0.67, "max": 1.5},
    "tax_hidden_by_prefetch": {"min": 0.8},
    "tax_fp8_vs_none": {"max": 0.6},
}


@dataclass(frozen=True, slots=True)
class DiskCost:
    """What one read costs on this disk: a fixed latency plus bytes at a bandwidth."""

    latency_s: float  # one small read at queue depth 1
    bandwidth_bytes_per_s: float  # large reads, batched across threads

    def read_s(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


def page_read_bytes(payload_bytes: int) -> int:
    """Bytes DiskArena reads for one page whose payload is `payload_bytes`."""
    if payload_bytes <= 0:
        raise ValueError(f"payload_bytes must be > 0, got {payload_bytes}")
    return HEADER_BYTES + round_up(payload_bytes)


def num_disk_pages(num_pages: int, disk_fraction: float) -> int:
    """How many of a context's `num_pages` pages live on disk (at least one)."""
    if num_pages <= 0:
        raise ValueError(f"the context must hold at least one full page, got {num_pages}")
    if not 0.0 < disk_fraction <= 1.0:
        raise ValueError(f"disk_fraction must be in (0, 1], got {disk_fraction}")
    return max(1, round(num_pages * disk_fraction))


def predicted_tax_s(num_pages_touched: int, read_bytes: int, cost: DiskCost) -> float:
    """pages touched x (latency + page read bytes / bandwidth), in seconds per token."""
    if num_pages_touched < 0 or read_bytes <= 0:
        raise ValueError(f"need num_pages_touched >= 0 and read_bytes > 0, got "
                         f"{num_pages_touched} and {read_bytes}")
    return num_pages_touched * cost.read_s(read_bytes)


def round_taxes_s(token_s: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per mode, per round: the token time less the resident token time of the same round.

    Rounds interleave the modes, so a noisy neighbour slows a round's modes alike.
    """
    resident_s = token_s[RESIDENT.name]
    return {name: [t - r for t, r in zip(times_s, resident_s, strict=True)]
            for name, times_s in token_s.items() if name != RESIDENT.name}


def hidden_fraction(tax_prefetch_s: float, tax_sync_s: float) -> float:
    """The fraction of the read-when-needed tax that prefetch hides (above 1: within noise of
    all of it, the prefetched run came out faster than the resident one)."""
    if tax_sync_s <= 0:
        return math.nan  # no tax to hide: the run measured nothing
    return 1.0 - tax_prefetch_s / tax_sync_s


def defined(values) -> list[float]:
    """The values that are not NaN (a round without a tax to compare has no ratio)."""
    return [value for value in values if not math.isnan(value)]


def tax_round_ratios(taxes_s: dict[str, list[float]],
                     predicted_none_s: list[float]) -> dict[str, list[float]]:
    """The three ratios of the goals, and tax_interference_share (no goal: the tax of the
    loads beside a decode that never waits for them, over prefetch's tax), one per round,
    from per-round taxes (round_taxes_s) and the model's prediction for raw pages in each
    round (from that round's disk probes).

    Each is taken within one round, so that a round in which a neighbour slowed the machine or
    the disk compares like with like; a ratio is the median of these. A round whose raw-page
    tax came out at or below zero (noise larger than the tax) has no ratio to it: NaN.
    """
    none_s = taxes_s["none"]
    return {
        "tax_measured_vs_model": [n / p for n, p in zip(none_s, predicted_none_s, strict=True)],
        "tax_hidden_by_prefetch": [hidden_fraction(p, n) for p, n
                                   in zip(taxes_s["none+prefetch"], none_s, strict=True)],
        "tax_fp8_vs_none": [f / n if n > 0 else math.nan
                            for f, n in zip(taxes_s["fp8"], none_s, strict=True)],
        "tax_interference_share": [b / p if p > 0 else math.nan for b, p
                                   in zip(taxes_s["loads-beside"], taxes_s["none+prefetch"],
                                          strict=True)],
    }
