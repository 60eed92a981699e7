"""RaykvLoadStats: the worker's load samples on vLLM's KV-connector stats path.

vLLM carries a connector's KVConnectorStats from each worker, with the step's output, to the
scheduler's connector (`update_connector_output`) and on to its stat loggers, which log
`reduce()` with the engine's throughput. The samples are engine_rates.load_samples':
(source, bytes, seconds, fixed seconds) per source a load read from; and, apart, (bytes,
seconds) of each load made in the step (step_budget.py), and whether it was cut at its
deadline: the scheduler side's estimate for the next ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

LOADS = "loads"
IN_STEP = "in_step"


@dataclass
class RaykvLoadStats(KVConnectorStats):
    """{"loads": [[source, bytes, seconds, fixed seconds], ...], "in_step": [[bytes, seconds,
    cut], ...]}: plain lists, so it crosses processes."""

    def __post_init__(self) -> None:
        self.data.setdefault(LOADS, [])
        self.data.setdefault(IN_STEP, [])

    @property
    def samples(self) -> list[tuple]:
        """(source, bytes, seconds, fixed seconds) each; a sample without its fixed part (a
        worker of an earlier release) is (source, bytes, seconds)."""
        return [(str(s), int(b), float(t), *(float(f) for f in fixed))
                for s, b, t, *fixed in self.data[LOADS]]

    @property
    def in_step(self) -> list[tuple[int, float, bool]]:
        """The loads made in the step: (bytes, seconds, cut at the deadline) each."""
        return [(int(b), float(t), bool(c)) for b, t, c in self.data[IN_STEP]]

    def reset(self) -> None:
        self.data = {LOADS: [], IN_STEP: []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if isinstance(other, RaykvLoadStats):
            self.data[LOADS].extend(other.data[LOADS])
            self.data[IN_STEP].extend(other.data[IN_STEP])
        return self

    def reduce(self) -> dict[str, int | float]:
        """Per source: loads, and MB/s over them (bytes / seconds, summed)."""
        out: dict[str, int | float] = {}
        totals: dict[str, list[float]] = {}
        for source, num_bytes, seconds, *_ in self.samples:
            total = totals.setdefault(source, [0, 0.0, 0.0])
            total[0] += 1
            total[1] += num_bytes
            total[2] += seconds
        for source, (count, num_bytes, seconds) in sorted(totals.items()):
            out[f"raykv {source} loads"] = int(count)
            out[f"raykv {source} MB/s"] = round(num_bytes / seconds / 1e6, 1) if seconds else 0.0
        if self.data[IN_STEP]:
            out["raykv loads in the step"] = len(self.data[IN_STEP])
        return out

    def is_empty(self) -> bool:
        return not self.data[LOADS] and not self.data[IN_STEP]


@dataclass
class RaykvWorkerOff(KVConnectorWorkerMetadata):
    """Worker -> scheduler side, once: this worker turned the connector off (its caches are
    not what raykv's pages hold: why_off). The scheduler side then stops asking raykv, which
    would only delay requests for hits no worker could load."""

    why_off: str

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return self  # any worker off turns the engine's connector off
