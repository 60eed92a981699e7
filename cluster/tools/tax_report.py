"""`raykv tax`'s settings and its result: the JSON (through the bench harness), its rich
tables, its PNG and the progress bar. No torch: the command line imports this module."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from cluster.core.config import CacheConfig
from cluster.core.spec import ModelSpec
from cluster.core.tax_model import (
    GOALS,
    MODES,
    RESIDENT,
    DiskCost,
    defined,
    hidden_fraction,
    num_disk_pages,
    page_read_bytes,
    predicted_tax_s,
    round_taxes_s,
    tax_round_ratios,
)
from cluster.tools.bench import common, harness

# Prefetch overlaps a token's reads with its compute: time it over enough tokens that one
# token's scheduling luck does not decide a round.
MIN_TOKENS_PER_ROUND = 32


@dataclass(frozen=True, slots=True)
class TaxSettings:
    """What one `raykv tax` run decodes, and how long it measures."""

    model: str = "small-llama"
    context_tokens: int = 65536
    disk_fraction: float = 0.25
    page_tokens: int = 256
    disk_dir: str | None = None  # None: a temp dir beside raykv's default disk dir
    num_rounds: int = 5
    tokens_per_round: int = MIN_TOKENS_PER_ROUND
    window_pages: int = 8
    query_heads_per_kv_head: int = 4  # as small-llama and Llama-3.1-8B have
    num_threads: int = CacheConfig().disk_threads
    fio_peer: bool = True

    def __post_init__(self) -> None:
        """ValueError for settings that cannot run, before any file is written."""
        ModelSpec.preset(self.model)
        for name in ("page_tokens", "window_pages", "query_heads_per_kv_head", "num_threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_rounds < harness.MIN_ROUNDS:
            raise ValueError(f"num_rounds must be at least {harness.MIN_ROUNDS}, got "
                             f"{self.num_rounds}")
        if self.tokens_per_round < MIN_TOKENS_PER_ROUND:
            raise ValueError(f"tokens_per_round must be at least {MIN_TOKENS_PER_ROUND}, got "
                             f"{self.tokens_per_round}")
        num_disk_pages(self.context_tokens // self.page_tokens, self.disk_fraction)


DEFAULT = TaxSettings()
QUICK = {"context_tokens": 16384, "num_rounds": 3, "fio_peer": False}

NOTES = [
    "workload: each round decodes tokens_per_round tokens (at least 32) in every mode, one "
    "mode after another in an order that rotates each round (harness.interleave); a mode's "
    "figure for a round is its mean seconds per token over those tokens",
    "stall = the time the decoding thread waited for disk pages; the rest of the tax is time "
    "the paged modes' compute took longer than the resident one's (on a busy machine: the "
    "decoding thread losing its core each time it waits)",
    "tax = a token's time less the all-resident token's time in the same round; per mode the "
    "median over rounds",
    "model = pages on disk x (latency + page read bytes / bandwidth); latency: median 4096-byte "
    "O_DIRECT read at queue depth 1; bandwidth: 4 MiB O_DIRECT reads over the disk-tier "
    "threads; both plain preadv on the raw pages' slab file, probed at the start of each round "
    "(disk figures: medians over rounds)",
    "page read bytes: DiskArena's header block + payload rounded up to 4096",
    "compute: online-softmax attention of one query per (layer, query head) over every page, "
    "float32, one torch thread; the loads run off that thread, a batch of pages at a time "
    "(sync: the window; prefetch: each half of it, two batches in flight), each batch one "
    "DiskArena.read_pages whose reads and checksums spread over the disk tier's thread count, "
    "then one whole-batch decode for fp8 and int8; loads and compute share the machine's "
    "cores",
    "ratios, and measured/model per mode: medians of ratios taken within each round (spread: "
    "every round's value); a round whose raw-page tax came out <= 0 has no ratio to it, and a "
    "ratio no round defines is not exercised",
    "token_spread: (p75 - p25) / median of a mode's token times over the rounds; a busy "
    "machine shows here first",
    "loads-beside: a diagnostic, not a way to decode: the resident decode (every page "
    "from memory) while the raw disk pages are loaded as prefetch loads them and thrown away; "
    "its tax is what the loads cost a decode that never waits for them, and "
    "tax_interference_share (no goal) is that tax over prefetch's, per round: near 1, what "
    "prefetch leaves of the tax is the loads running beside the decode, not waiting",
]


@dataclass(frozen=True, slots=True)
class Measurements:
    """What one run measured, besides the workload it built."""

    rounds: dict  # tax.measure_rounds
    fio_bytes_per_s: float | None
    output_errors: dict[str, float]  # per mode, against the resident output


def progress():
    """A transient rich progress bar for the run's phases and rounds."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                    TimeElapsedColumn(), transient=True)


def _round_costs(rounds: dict) -> list[DiskCost]:
    return [DiskCost(latency_s, bandwidth) for latency_s, bandwidth
            in zip(rounds["latency_s"], rounds["bandwidth_bytes_per_s"], strict=True)]


def _spread(values: list[float]) -> float:
    """(p75 - p25) / median: how much the rounds disagree (0 on a quiet machine)."""
    if len(values) < 2:
        return 0.0
    p25, _, p75 = statistics.quantiles(values, n=4, method="inclusive")
    return (p75 - p25) / statistics.median(values)


def _median_defined(values) -> float | None:
    kept = defined(values)
    return statistics.median(kept) if kept else None


def _mode_figures(workload, rounds: dict, taxes_s: dict) -> dict:
    """Per mode: token time and, for paged modes, the tax, the time spent waiting for pages
    (stall), the model, and tax and stall against the model (medians over rounds, each ratio
    taken within a round); for prefetch, the fraction of the tax hidden."""
    costs = _round_costs(rounds)
    figures = {}
    for mode in MODES:
        times_s = rounds["token_s"][mode.name]
        row = {"token_ms": statistics.median(times_s) * 1e3, "token_spread": _spread(times_s)}
        if mode.codec is not None:
            read_bytes = page_read_bytes(workload.disk[mode.codec].payload_bytes)
            model_s = [predicted_tax_s(workload.num_disk, read_bytes, cost) for cost in costs]
            stall_s = rounds["stall_s"][mode.name]
            row.update(disk_bytes_per_token=workload.num_disk * read_bytes,
                       tax_us_per_token=statistics.median(taxes_s[mode.name]) * 1e6,
                       stall_us_per_token=statistics.median(stall_s) * 1e6,
                       model_us_per_token=statistics.median(model_s) * 1e6,
                       measured_vs_model=common.median_ratio(taxes_s[mode.name], model_s),
                       stall_vs_model=common.median_ratio(stall_s, model_s))
            if mode.step == "prefetch":
                row["hidden"] = _median_defined(
                    hidden_fraction(p, s) for p, s
                    in zip(taxes_s[mode.name], taxes_s[mode.codec], strict=True))
        figures[mode.name] = row
    return figures


def new_report(settings: TaxSettings) -> harness.Report:
    """The run's Report, made as it starts (the load average is read now)."""
    return harness.Report("tax", "us_per_token", dataclasses.asdict(settings), GOALS, NOTES)


def fill_report(report: harness.Report, workload, measured: Measurements) -> None:
    """Figures, the rounds and the ratios (each the median of per-round ratios, or not
    exercised when no round had a raw-page tax to compare) into the run's Report."""
    rounds, fio_bytes_per_s = measured.rounds, measured.fio_bytes_per_s
    taxes_s = round_taxes_s(rounds["token_s"])
    none_read_bytes = page_read_bytes(workload.disk["none"].payload_bytes)
    predicted_none_s = [predicted_tax_s(workload.num_disk, none_read_bytes, cost)
                        for cost in _round_costs(rounds)]
    report["config"].update(page_shape=list(workload.geometry.shape),
                            page_dtype=workload.geometry.dtype,
                            page_bytes=workload.geometry.page_bytes,
                            num_pages=workload.num_pages, num_disk_pages=workload.num_disk)
    report["disk"] = {
        "latency_us": statistics.median(rounds["latency_s"]) * 1e6,
        "bandwidth_gbps": statistics.median(rounds["bandwidth_bytes_per_s"]) / 1e9,
        "fio_randread_gbps": fio_bytes_per_s / 1e9 if fio_bytes_per_s else None,
        "page_read_bytes": {codec: page_read_bytes(pages.payload_bytes)
                            for codec, pages in workload.disk.items()}}
    report["modes"] = _mode_figures(workload, rounds, taxes_s)
    report["rounds"] = {**rounds, "tax_s": taxes_s}
    report["output_rel_error"] = measured.output_errors
    for name, per_round in tax_round_ratios(taxes_s, predicted_none_s).items():
        kept = defined(per_round)
        if report.require(name, bool(kept), "no round's raw-page tax came out above zero: "
                                            "the disk reads cost nothing measurable"):
            report.ratio(name, statistics.median(kept), kept)


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def tables(result: dict) -> list:
    """The disk's figures and one row per mode (the JSON has more)."""
    disk, config = result["disk"], result["config"]
    num_disk = config["num_disk_pages"]
    read_mib = {codec: num_disk * num_bytes / 2**20
                for codec, num_bytes in disk["page_read_bytes"].items()}
    disk_table = common.table(
        "disk (plain O_DIRECT, this run; medians of per-round probes)", ["figure", "value"],
        [["latency, 4 KiB read (us)", f"{disk['latency_us']:.1f}"],
         ["bandwidth, 4 MiB reads (GB/s)", f"{disk['bandwidth_gbps']:.2f}"],
         ["fio randread, 4 MiB (GB/s)", _fmt(disk["fio_randread_gbps"], ".2f")],
         *[[f"read per token, {codec} pages (MiB)", f"{mib:.1f}"]
           for codec, mib in read_mib.items()]])
    title = (f"paging tax: {config['model']}, {config['context_tokens']:,} tokens = "
             f"{config['num_pages']} pages of {config['page_tokens']}, {num_disk} on disk")
    rows = []
    for name, row in result["modes"].items():
        rows.append([name, f"{row['token_ms']:.1f}", _fmt(row.get("tax_us_per_token"), ",.0f"),
                     _fmt(row.get("stall_us_per_token"), ",.0f"),
                     _fmt(row.get("model_us_per_token"), ",.0f"),
                     _fmt(row.get("measured_vs_model"), ".2f"), _fmt(row.get("hidden"), ".2f")])
    mode_table = common.table(title, ["mode", "token ms", "tax us", "stall us", "model us",
                                      "tax/model", "hidden"], rows)
    return [disk_table, mode_table]


def write_png(result: dict, png_path: str) -> None:
    """Left: measured tax against the model per mode. Right: a token's time, compute + tax."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paged = [name for name in result["modes"] if name != RESIDENT.name]
    modes = result["modes"]
    positions = range(len(paged))
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.bar([p - 0.2 for p in positions], [modes[n]["tax_us_per_token"] / 1e3 for n in paged],
             0.4, label="measured")
    left.bar([p + 0.2 for p in positions], [modes[n]["model_us_per_token"] / 1e3 for n in paged],
             0.4, label="model (reads not hidden)")
    left.set(xticks=list(positions), ylabel="paging tax (ms per token)",
             title="tax: measured vs latency + bytes / bandwidth")
    left.set_xticklabels(paged, rotation=20)
    left.legend()
    compute_ms = modes[RESIDENT.name]["token_ms"]
    right.bar(list(positions), [compute_ms] * len(paged), label="all resident (compute)")
    right.bar(list(positions), [max(modes[n]["tax_us_per_token"], 0) / 1e3 for n in paged],
              bottom=[compute_ms] * len(paged), label="paging tax")
    right.set(xticks=list(positions), ylabel="ms per token", title="a token's time")
    right.set_xticklabels(paged, rotation=20)
    right.legend()
    config = result["config"]
    figure.suptitle(f"{config['model']}: {config['num_disk_pages']} of {config['num_pages']} "
                    f"pages on disk")
    figure.tight_layout()
    figure.savefig(png_path, dpi=110)
    plt.close(figure)
