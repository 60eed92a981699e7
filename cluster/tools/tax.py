"""`raykv tax` (and `raykv bench tax`): the per-token paging tax, measured next to its model.

It decodes tokens over a context with a fraction of its pages on raykv's disk tier, in the
modes of cluster.core.tax_model (all resident, read when needed, prefetched, fp8 and int8
pages). Rounds (harness.interleave: at least 3, the modes' order rotating) decode at least 32
tokens in every mode, and the tax is a token's time less the resident token's time in the
same round; each ratio is the median of its per-round values, with their spread. Each round
first probes the disk's own latency and bandwidth with plain O_DIRECT reads (fio runs once, as
a peer), and the model predicts that round's tax from them:

    tax per token = pages on disk x (latency + page read bytes / bandwidth)

The compute is real: an online-softmax attention of one query per (layer, head) over every page,
in float32 on one torch thread; the disk loads run off that thread, a batch at a time, their
reads and checksums spread over the disk tier's thread count.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from cluster.core import quant
from cluster.core.config import default_disk_dir
from cluster.core.geometry import PageGeometry
from cluster.core.paged_decode import (
    DECODE_STEPS,
    DiskPages,
    PagedContext,
    PageWindow,
    random_pages,
    relative_error,
    window_groups,
)
from cluster.core.spec import ModelSpec
from cluster.core.tax_model import MODES, RESIDENT, Mode, num_disk_pages, page_read_bytes
from cluster.core.tiers.aligned import make_private_dir
from cluster.core.tiers.disk import DiskArena
from cluster.tools import tax_report
from cluster.tools.bench import common, harness, peers, rawdisk
from cluster.tools.tax_report import QUICK, TaxSettings

FIO_FILE_BYTES = 128 << 20
# The paged output must match the resident one: exactly up to summation order for raw pages,
# within the codec's rounding for quantized ones (fp8 keeps 3 mantissa bits).
MAX_OUTPUT_ERROR = {"none": 1e-4, "int8": 0.05, "fp8": 0.1}


class Workload:
    """A context's pages (the disk ones written in every codec) and the decode of a token."""

    def __init__(self, settings: TaxSettings, root: str) -> None:
        spec = ModelSpec.preset(settings.model)
        self.geometry = PageGeometry.of(spec, settings.page_tokens)
        self.num_pages = settings.context_tokens // settings.page_tokens
        self.num_disk = num_disk_pages(self.num_pages, settings.disk_fraction)
        self.num_threads = settings.num_threads
        pages = random_pages(self.geometry, self.num_pages, seed=0)
        # a loader thread per half-window batch; each batch's reads fan out over the arena's
        # threads (the disk tier's count), as the pool's batched disk reads do
        loader = ThreadPoolExecutor(len(window_groups(settings.window_pages)),
                                    thread_name_prefix="raykv-tax-load")
        self.context = PagedContext(pages[self.num_disk:], pages[: self.num_disk],
                                    PageWindow(self.geometry, settings.window_pages), loader)
        self.disk: dict[str, DiskPages] = {}
        for codec in quant.CODECS:
            self.disk[codec] = self._write(os.path.join(root, codec), codec)

    def _write(self, path: str, codec: str) -> DiskPages:
        payload_bytes = quant.payload_bytes(self.geometry.shape, self.geometry.torch_dtype(),
                                            codec)
        arena = DiskArena(path, self.num_disk * page_read_bytes(payload_bytes), payload_bytes,
                          self.num_threads)
        if not arena.direct_io:
            arena.close()
            raise RuntimeError(f"O_DIRECT does not work in {path}: the page cache would hide "
                               f"the disk; pass --disk-dir on a real disk (not tmpfs)")
        disk = DiskPages(arena, self.geometry, codec)
        disk.write(self.context.originals)
        return disk

    def token(self, mode: Mode, query: torch.Tensor) -> torch.Tensor:
        disk = self.disk[mode.codec] if mode.codec else None
        return DECODE_STEPS[mode.step](self.context, query, disk)

    def queries(self, settings: TaxSettings) -> list[torch.Tensor]:
        layers, _, kv_heads, _, head_dim = self.geometry.shape
        generator = torch.Generator().manual_seed(1)
        shape = (layers, kv_heads, settings.query_heads_per_kv_head, head_dim)
        return [torch.randn(shape, generator=generator) for _ in range(settings.tokens_per_round)]

    def slab_path(self) -> str:
        """The raw pages' first slab file: every slot of it holds a written page."""
        return os.path.join(self.disk["none"].arena.dir_path, "slab-00000.bin")

    def close(self) -> None:
        self.context.loader.shutdown(wait=True)
        for disk in self.disk.values():
            disk.arena.close()


def check_outputs(workload: Workload, query: torch.Tensor) -> dict[str, float]:
    """Each mode's output against the resident one's; RuntimeError past MAX_OUTPUT_ERROR (a
    wrong page would make every figure meaningless)."""
    expected = workload.token(RESIDENT, query)
    errors = {}
    for mode in MODES[1:]:
        errors[mode.name] = relative_error(workload.token(mode, query), expected)
        if errors[mode.name] > MAX_OUTPUT_ERROR[mode.codec]:
            raise RuntimeError(f"mode {mode.name}: attention output differs from the resident "
                               f"one by {errors[mode.name]:.3g} (rms, relative)")
    return errors


def probe_disk(workload: Workload, settings: TaxSettings) -> tuple[float, float]:
    """(latency_s, bandwidth_bytes_per_s) of plain O_DIRECT reads of the raw pages' slab file,
    which holds written pages only."""
    path = workload.slab_path()
    region_bytes = min(workload.num_disk * workload.disk["none"].arena.slot_bytes,
                       os.path.getsize(path))
    return (rawdisk.read_latency_s(path, region_bytes),
            rawdisk.read_bandwidth_bytes_per_s(path, region_bytes, settings.num_threads))


def fio_read_bytes_per_s(settings: TaxSettings, root: str) -> float | None:
    """fio's O_DIRECT random-read bandwidth at the probe's block size, as a peer (None: off)."""
    if not settings.fio_peer or not peers.fio_path():
        return None
    return 1e9 * peers.fio_gbps(root, "read", rawdisk.BANDWIDTH_BLOCK_BYTES,
                                settings.num_threads, FIO_FILE_BYTES)


def measure_rounds(workload: Workload, settings: TaxSettings, advance) -> dict:
    """Per round: the disk's latency and bandwidth, then, for every mode (in an order that
    rotates each round), seconds per token and seconds per token spent waiting for pages.

    {"latency_s": [...], "bandwidth_bytes_per_s": [...], "token_s": {mode: [...]},
     "stall_s": {mode: [...]}}, one entry per round in each list.
    """
    queries, stall = workload.queries(settings), workload.context.stall
    rounds: dict = {"latency_s": [], "bandwidth_bytes_per_s": [],
                    "stall_s": {mode.name: [] for mode in MODES}}

    def probe(round_index: int, order: list[str]) -> None:
        if round_index:
            advance()
        latency_s, bandwidth = probe_disk(workload, settings)
        rounds["latency_s"].append(latency_s)
        rounds["bandwidth_bytes_per_s"].append(bandwidth)

    def decode(mode: Mode):
        def per_token_s(round_index: int) -> float:
            stall_s, start_s = stall.total_s, time.perf_counter()
            for query in queries:
                workload.token(mode, query)
            elapsed_s = time.perf_counter() - start_s
            rounds["stall_s"][mode.name].append((stall.total_s - stall_s) / len(queries))
            return elapsed_s / len(queries)
        return per_token_s

    rounds["token_s"] = harness.interleave({mode.name: decode(mode) for mode in MODES},
                                           settings.num_rounds, on_round=probe)
    advance()
    return rounds


def _work_dir(disk_dir: str | None) -> str:
    """A fresh private directory for the run's slabs, under disk_dir or beside raykv's
    default disk dir (a real disk); the caller removes it."""
    if disk_dir is None:
        parent = make_private_dir(os.path.dirname(default_disk_dir()))
    else:
        parent = disk_dir
        os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix="raykv-tax-", dir=parent)


def measure(settings: TaxSettings) -> harness.Report:
    """Build the workload, measure fio and the rounds; the run's Report, not yet finished."""
    report = tax_report.new_report(settings)
    root = _work_dir(settings.disk_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core computes; the loads have the other
    workload = None
    try:
        with tax_report.progress() as bar:
            task = bar.add_task("paging tax: writing the disk pages",
                                total=3 + settings.num_rounds)
            workload = Workload(settings, root)
            bar.update(task, advance=1, description="paging tax: fio, as a peer")
            fio = fio_read_bytes_per_s(settings, root)
            bar.update(task, advance=1, description="paging tax: checking every mode's output")
            errors = check_outputs(workload, workload.queries(settings)[0])
            bar.update(task, advance=1, description="paging tax: rounds (disk probes, then "
                                                    "tokens in every mode)")
            rounds = measure_rounds(workload, settings, lambda: bar.advance(task))
        tax_report.fill_report(report, workload, tax_report.Measurements(rounds, fio, errors))
        return report
    finally:
        torch.set_num_threads(threads)
        if workload is not None:
            workload.close()
        shutil.rmtree(root, ignore_errors=True)


def run_tax(settings: TaxSettings, json_path: str | None, png_path: str | None) -> dict:
    """Measure, print the tables, write the PNG and the JSON; returns the result."""
    report = measure(settings)
    common.print_tables(tax_report.tables(report.result))
    if png_path:
        tax_report.write_png(report.result, png_path)
    return report.finish(json_path)


def run(json_path: str | None, quick: bool) -> dict:
    """`raykv bench tax`: the default run (smaller with quick), its PNG beside the JSON."""
    settings = TaxSettings(**QUICK) if quick else TaxSettings()
    png_path = str(Path(json_path).with_suffix(".png")) if json_path else None
    return run_tax(settings, json_path, png_path)
