"""A vLLM engine's own measurements for cost-based routing (no vLLM import): what its
RaykvConnector's loads took per source tier, and how fast the engine prefills.

    worker (loader thread)        scheduler (engine core)          Serve replica
    a load: its raykv reads  --KVConnectorStats-->  EngineMeter  --rates file-->  routing stats
            and its time          steps: schedule -> output           -> raykv's router

- **Loads.** A load's raykv get times its reads (the client's `view.transfers`: this node's
  disk acquire, the copy out of its slabs, reads from other nodes); the load as a whole also
  waits on the directory and scatters the pages into vLLM's blocks. `load_samples` turns one
  load into one sample per source it read from: the reads' own times, plus the rest of the
  load's time shared by bytes, so that a source's rate is what a load from it costs the engine.
  That rest is the sample's fixed part (the path's latency), the reads' time its bytes' part:
  a load of one page and one of thirty spend about the same outside their reads.
- **Prefill.** Every step is timed from the scheduler handing it out to its output coming
  back (`StepClock`; with async scheduling a step starts no earlier than the previous one
  ends). A step's time is a fixed part (the step's overhead) plus a part per token plus a
  part per attention pair of its requests' contexts; `PrefillFit` (prefill_fit.py) fits the
  three to the steps that prefill, and its two slopes are the prefill rate and the attention
  term the router prices a cut's recomputed tokens at.
- **Queue.** A finished request's share of the engine's busy time (the step seconds since the
  last request finished), an EWMA: `busy_s_per_request`, which the router multiplies by a
  replica's queue length.

`EngineMeter.published()` is in the form raykv's own engines publish (cluster/serving/
rates.py), so the router pools both alike. The engine core writes it to a file the replica
reads (`write_published`, `read_published`): the engine-core process is always its Serve
replica's child, on the same host.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cluster.serving.lookup_worth import LookupWorth
from cluster.serving.prefill_fit import PrefillFit, published_prefill
from policies.cost_routing import (
    DISK,
    HOST,
    PRIOR_PATHS,
    PathRate,
    RateEstimates,
    ewma,
    observe_transfer,
    prior_rates,
    published,
)

log = logging.getLogger("raykv.vllm")
MAX_PENDING_STEPS = 64  # steps scheduled and not yet done (a batch queue holds a few)
# A load cut at its deadline took longer than the deadline by an unknown amount: its bound is
# taken as this many times its time, as a retransmission timer doubles on a loss. Taken at
# its time, the next load of its size met a deadline a little later (the deadline follows
# the measured prefill rate) and was cut again: three in a row in 02fa445's bench vllm-serve,
# at 0.478, 0.483 and 0.496 s (the forced fetches of that slowed disk took 0.6 to 0.7 s).
CUT_BOUND_FACTOR = 2.0


def load_samples(transfers: Iterable[tuple[str, int, float]],
                 load_s: float) -> list[tuple[str, int, float, float]]:
    """One load's samples, (source, bytes, seconds, fixed seconds) per source it read from,
    from its raykv reads (`transfers`) and the load's whole time `load_s` (see the module
    doc): the fixed seconds are the source's share of the load's time outside its reads.
    Pages read up from this node's disk land in its host tier and are copied out from there:
    that copy is the disk's, not the host's. Nothing for a load that read nothing."""
    num_bytes: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for source, moved, took_s in transfers:
        num_bytes[source] = num_bytes.get(source, 0) + moved
        seconds[source] = seconds.get(source, 0.0) + took_s
    disk_b, host_b = num_bytes.get(DISK, 0), num_bytes.get(HOST, 0)
    if disk_b and host_b:
        promoted = min(disk_b, host_b)
        copy_s = seconds[HOST] * promoted / host_b
        seconds[DISK] += copy_s
        seconds[HOST] -= copy_s
        num_bytes[HOST] -= promoted
        if num_bytes[HOST] <= 0:
            del num_bytes[HOST], seconds[HOST]
    total_b = sum(num_bytes.values())
    if total_b <= 0:
        return []
    rest_s = max(0.0, load_s - sum(seconds.values()))
    return [(source, int(b), seconds[source] + rest_s * b / total_b, rest_s * b / total_b)
            for source, b in num_bytes.items()]


@dataclass(frozen=True, slots=True)
class Step:
    """A step as scheduled: its tokens, whether it prefills, when it was handed out, and its
    requests' attention pairs (prefill_fit.attention_pairs)."""

    num_tokens: int
    prefills: bool
    scheduled_s: float
    num_pairs: int = 0


class StepClock:
    """Each step's time, from the scheduler handing it out to its output coming back, in
    order (vLLM finishes steps in the order it schedules them). With async scheduling the
    next step is handed out while one runs: a step's time starts no earlier than the
    previous step's end."""

    def __init__(self) -> None:
        self._pending: deque[Step] = deque(maxlen=MAX_PENDING_STEPS)
        self._last_done_s: float | None = None

    def scheduled(self, step: Step) -> None:
        self._pending.append(step)

    def done(self, now_s: float) -> tuple[Step, float] | None:
        """The oldest pending step, now done, and its seconds (None: none pending)."""
        if not self._pending:
            return None
        step = self._pending.popleft()
        began_s = step.scheduled_s if self._last_done_s is None \
            else max(step.scheduled_s, self._last_done_s)
        self._last_done_s = now_s
        return step, max(0.0, now_s - began_s)


class EngineMeter:
    """One vLLM engine's rates (module doc); `page_tokens` and `page_bytes` are its raykv
    pages'."""

    def __init__(self, page_tokens: int, page_bytes: int) -> None:
        self.page_tokens, self.page_bytes = page_tokens, page_bytes
        self.rates: RateEstimates = prior_rates()
        self.prefill = PrefillFit()
        self.clock = StepClock()
        self.busy_s_per_request = 0.0
        self.num_finished = 0
        # Loads made in the step (step_budget.py); before any, this node's host copy prior.
        self.in_step = PathRate(PRIOR_PATHS[HOST][0])
        self._busy_s = 0.0  # step seconds since the last request finished
        self.lookups = LookupWorth()  # what raykv's lookups were worth to this engine

    def loaded(self, samples: Iterable[tuple]) -> None:
        """The worker's load samples (load_samples), as its KVConnectorStats brought them
        ((source, bytes, seconds, fixed seconds); a worker of a release before the fixed part
        sends none: its latency is then taken as it stands)."""
        for source, num_bytes, seconds, *fixed in samples:
            if source in self.rates.paths:
                self.rates = observe_transfer(self.rates, source, int(num_bytes), seconds,
                                              fixed[0] if fixed else None)

    def step_done(self, now_s: float) -> float | None:
        """The oldest scheduled step's output is back: time it. Its seconds when it ran
        tokens (None: no step pending, or an empty one)."""
        done = self.clock.done(now_s)
        if done is None:
            return None
        step, seconds = done
        if step.prefills:
            self.prefill.add(step.num_tokens, seconds, step.num_pairs)
        if not step.num_tokens:
            return None
        self._busy_s += seconds
        return seconds

    def recompute_s(self, num_tokens: int) -> float:
        """What prefilling `num_tokens` adds to a step, at the fitted prefill rate (0 before
        any prefill was timed)."""
        return self.measured_recompute_s(num_tokens) or 0.0

    def measured_recompute_s(self, num_tokens: int) -> float | None:
        """recompute_s, None before any prefill was timed. The tokens' part only: its
        callers (deadlines, whether a lookup is worth its delay) do not know the context the
        tokens would be computed at, and the attention term only lengthens a recompute."""
        per_token_s = self.prefill.per_token_s()
        return None if per_token_s is None else max(0, num_tokens) * per_token_s

    def loaded_in_step(self, samples: Iterable[tuple[int, float, bool]]) -> None:
        """The (bytes, seconds, cut) of the worker's loads made in the step: a load cut at
        its deadline is a bound (PathRate.at_least, at CUT_BOUND_FACTOR times its time), the
        others samples."""
        for num_bytes, seconds, cut in samples:
            self.in_step = self.in_step.at_least(num_bytes, CUT_BOUND_FACTOR * seconds) \
                if cut else self.in_step.observed(num_bytes, seconds)

    def load_s(self, num_tokens: int) -> float:
        """What a load of `num_tokens` (whole pages) made in the step should take: at the rate
        the loads made in the step measured (EWMA, each load's fixed part shared by its
        bytes), before any at this node's host copy prior. Background loads are no guide:
        their time includes waiting for the engine's own busy thread (one Python process, one
        GIL), and a load of 19 pages that took 215 to 390 ms in the loader thread took 6 to 9
        ms in the step (docs/benchmarks.md, vllm: loads in the step). A load past its
        estimate is cut at its deadline (step_budget.sync_deadline_s: its recompute time, at
        least one step), and counts as a bound: the estimate rises to at least twice its time."""
        if num_tokens <= 0:
            return 0.0
        num_bytes = -(-num_tokens // self.page_tokens) * self.page_bytes
        return self.in_step.seconds(num_bytes)

    def finished(self) -> None:
        """A request finished: the busy time since the last one is its share."""
        sample, self._busy_s = self._busy_s, 0.0
        self.busy_s_per_request = ewma(self.busy_s_per_request, sample, self.num_finished)
        self.num_finished += 1

    def published(self) -> dict:
        """What the replica publishes to routers (rates.RateMeter.published's form), with the
        prefill fit's step overhead beside it."""
        out = published(self.rates, "")
        out.update(published_prefill(self.prefill))
        out.update(page_tokens=self.page_tokens, page_bytes=self.page_bytes,
                   busy_s_per_request=self.busy_s_per_request, **self.lookups.published())
        return out


class RatesFile:
    """Writes a meter's published rates to `path` (write_published) at most once every
    `period_s`, and always after the last change: a change within `period_s` of the last
    write is written once the period is over (a timer), so the steps before an engine goes
    idle are published too. `clock` is the steps' clock (monotonic seconds)."""

    def __init__(self, meter: EngineMeter, path: str, period_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.meter, self.path, self.period_s, self.clock = meter, path, period_s, clock
        self._written_s: float | None = None
        self._due: threading.Timer | None = None  # a write put off, pending

    def changed(self) -> None:
        if self._due is not None:
            return
        wait_s = 0.0 if self._written_s is None \
            else self._written_s + self.period_s - self.clock()
        if wait_s <= 0:
            self.write()
        else:
            self._due = threading.Timer(wait_s, self.write)
            self._due.daemon = True
            self._due.start()

    def write(self) -> None:
        """Write now (from the engine's thread, or the timer's: a write racing a step may
        mix that step's update into some figures; the next write is whole)."""
        self._written_s, self._due = self.clock(), None
        try:
            write_published(self.path, self.meter.published())
        except OSError as error:  # the router goes on with what it had, or its priors
            log.warning("raykv could not write its rates to %s: %s", self.path, error)

    def close(self) -> None:
        if self._due is not None:
            self._due.cancel()


def rates_path(engine_id: str) -> str:
    """Where the engine with this id writes its published rates (a private temp dir)."""
    directory = os.path.join(tempfile.gettempdir(), f"raykv-{os.getuid()}", "engine-rates")
    return os.path.join(directory, f"{engine_id}.json")


def rates_files_since(since_wall_s: float) -> list[str]:
    """The rates files engines wrote since `since_wall_s` (wall-clock seconds), in name
    order: those of the engines started since then, on this host."""
    directory = os.path.dirname(rates_path("any"))
    if not os.path.isdir(directory):
        return []
    paths = [os.path.join(directory, name) for name in sorted(os.listdir(directory))
             if name.endswith(".json")]
    return [path for path in paths if os.path.getmtime(path) >= since_wall_s]


def write_published(path: str, rates: dict) -> None:
    """Replace the file at `path` with `rates` at once (a reader never sees half of it)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "w") as file:
        json.dump(rates, file)
    os.replace(partial, path)


def remove_published(path: str) -> None:
    """Remove an engine's rates file when its replica goes (one per replica start would
    otherwise pile up in the temp dir); a file already gone is fine."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def read_published(path: str) -> dict:
    """The rates the engine last wrote ({} before it wrote any, or if unreadable)."""
    try:
        with open(path) as file:
            return json.load(file)
    except (OSError, ValueError):
        return {}
