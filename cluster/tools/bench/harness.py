"""The benchmark rules, kept in one place so that every benchmark keeps them by construction.

    rounds      `interleave` runs every contender once per round, the order rotating by one each
                round, for at least MIN_ROUNDS rounds.
    pairing     `Report.paired` sets a ratio to the median of the per-round ratios of two
                contenders' figures and records its spread (min, max, every round's value).
    can fail    `Report.not_exercised` (or `Report.require`) marks a ratio whose condition was
                never exercised: its value is null, its goal unmet, and `raykv bench` exits 2.
    load        the load average is read when the Report is made and again in `finish`.
    JSON        `finish` writes {"benchmark", "unit", "config", "machine", figures..., "ratios",
                "goals", "met", "spread", "not_exercised", "notes"} and prints the ratio table;
                the file is replaced whole (a temporary file, then a rename) or not at all.

A ratio whose goal is a minimum reads "raykv is at least this good"; a maximum, "at most this
slow". Names are the issue's contract: keep them.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata

from cluster.tools.outputs import write_text_atomic

MIN_ROUNDS = 3
PACKAGES = ("ray", "torch", "numpy", "blake3", "xxhash", "redis")


# ---- the machine and the tables ------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    """The git commit the run's code came from, "+dirty" when the work tree has changes: a
    figure is only quotable for the code it ran on."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True).stdout
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head.strip() + ("+dirty" if dirty.strip() else "")


def machine_info() -> dict:
    """Cores, memory, platform, package versions and the load average now."""
    return {"nproc": os.cpu_count(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "platform": platform.platform(), "python": platform.python_version(),
            "packages": {name: _version(name) for name in PACKAGES},
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "commit": _commit(),
            "loadavg_start": list(os.getloadavg())}


def table(title: str, header: list[str], rows: Iterable[list[str]]):
    """A rich table: the first column names the row, the others are right-aligned figures."""
    from rich.table import Table

    result = Table(title=title)
    result.add_column(header[0])
    for name in header[1:]:
        result.add_column(name, justify="right")
    for row in rows:
        result.add_row(*row)
    return result


def print_tables(tables: Iterable) -> None:
    from rich.console import Console

    console = Console()
    for each in tables:
        console.print(each)


class NotEnoughRounds(ValueError):
    """Fewer than MIN_ROUNDS rounds: a median of pairs needs at least three."""


def rotation(names: Sequence[str], round_index: int) -> list[str]:
    """The order of round `round_index`: names rotated left by round_index."""
    shift = round_index % len(names)
    return [*names[shift:], *names[:shift]]


def interleave(contenders: dict[str, Callable[[int], float]], num_rounds: int,
               on_round: Callable[[int, list[str]], None] | None = None,
               min_rounds: int = MIN_ROUNDS) -> dict[str, list[float]]:
    """Run every contender once per round in rotating order; name -> its per-round figures.

    contenders[name](round_index) returns that round's figure (seconds, bytes/s, ...).
    on_round(round_index, order) is called before each round (a progress bar's step).
    """
    if num_rounds < min_rounds:
        raise NotEnoughRounds(f"{num_rounds} rounds; at least {min_rounds} are needed")
    names = list(contenders)
    figures: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(num_rounds):
        order = rotation(names, round_index)
        if on_round:
            on_round(round_index, order)
        for name in order:
            figures[name].append(float(contenders[name](round_index)))
    return figures


def per_round_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    return [n / d for n, d in zip(numerators, denominators, strict=True)]


def spread_of(values: Sequence[float]) -> dict:
    """{"min", "max", "rounds"}: how far the rounds behind a median lie apart."""
    return {"min": min(values), "max": max(values), "rounds": list(values)}


def goals_met(ratios: dict[str, float | None],
              goals: dict[str, dict[str, float]]) -> dict[str, bool]:
    """name -> whether ratios[name] lies within goals[name]'s "min" and "max" (each optional);
    a ratio that is None (not exercised) or NaN never meets its goal."""
    met = {}
    for name, goal in goals.items():
        value = ratios.get(name)
        if value is None or math.isnan(value):
            met[name] = False
            continue
        met[name] = bool(goal.get("min", -math.inf) <= value <= goal.get("max", math.inf))
    return met


def goal_text(goal: dict[str, float] | None) -> str:
    if not goal:
        return ""
    return " ".join(f"{'<=' if bound == 'max' else '>='} {value:g}"
                    for bound, value in goal.items())


class Report:
    """One benchmark's result, filled while it runs and written by `finish`.

    report = Report("tiers", "GB/s", config, GOALS, NOTES)
    figures = interleave({"raykv": ..., "memcpy": ...}, 3)
    report.paired("host_get_vs_memcpy", figures["raykv"], figures["memcpy"])
    report.finish(json_path)
    """

    def __init__(self, benchmark: str, unit: str, config: dict,
                 goals: dict[str, dict[str, float]], notes: Iterable[str] | str = ()) -> None:
        self.result: dict = {"benchmark": benchmark, "unit": unit, "config": config,
                             "machine": machine_info(), "ratios": {}, "goals": dict(goals),
                             "spread": {}, "not_exercised": {},
                             "notes": [notes] if isinstance(notes, str) else list(notes)}

    def __setitem__(self, key: str, value) -> None:
        self.result[key] = value

    def __getitem__(self, key: str):
        return self.result[key]

    @property
    def ratios(self) -> dict:
        return self.result["ratios"]

    def ratio(self, name: str, value: float, per_round: Sequence[float] | None = None) -> float:
        """Set a ratio; with per_round, value should be their median and the spread is kept."""
        self.ratios[name] = float(value)
        if per_round:
            self.result["spread"][name] = spread_of(per_round)
        return float(value)

    def paired(self, name: str, numerators: Sequence[float],
               denominators: Sequence[float]) -> float:
        """The median of the per-round ratios numerators[i] / denominators[i], with its spread.
        Pass rates (bytes/s) as raykv / baseline, or seconds as raykv / baseline for a
        goal that is a maximum."""
        if len(numerators) < MIN_ROUNDS:
            raise NotEnoughRounds(f"{name}: {len(numerators)} rounds")
        per_round = per_round_ratios(numerators, denominators)
        return self.ratio(name, statistics.median(per_round), per_round)

    def not_exercised(self, name: str, why: str) -> None:
        """The ratio's condition never happened in this run: null, unmet, and the run fails."""
        self.ratios[name] = None
        self.result["not_exercised"][name] = why

    def require(self, name: str, exercised: bool, why: str) -> bool:
        """not_exercised(name, why) unless `exercised`; returns `exercised`."""
        if not exercised:
            self.not_exercised(name, why)
        return exercised

    def note(self, text: str) -> None:
        self.result["notes"].append(text)

    def finish(self, json_path: str | None) -> dict:
        """Add "met" and the closing load average, print the ratios, write the JSON."""
        return finish(self.result, json_path)


def finish(result: dict, json_path: str | None) -> dict:
    """Add "met" and loadavg_end to a result dict, print its ratio table, write the JSON."""
    import json

    result.setdefault("spread", {})
    result.setdefault("not_exercised", {})
    result["met"] = goals_met(result["ratios"], result["goals"])
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    print_tables([ratio_table(result)])
    if json_path:  # serialised first (a NaN raises here), then written whole
        text = json.dumps(result, indent=2, allow_nan=False, default=_json_default)
        write_text_atomic(json_path, text)
    return result


def _json_default(value):
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")


def ratio_table(result: dict):
    rows = []
    for name, value in result["ratios"].items():
        met = result.get("met", {}).get(name)
        spread = result.get("spread", {}).get(name)
        shown = "not exercised" if value is None else f"{value:.3f}"
        rows.append([name, shown,
                     f"{spread['min']:.3f}..{spread['max']:.3f}" if spread else "",
                     goal_text(result["goals"].get(name)),
                     "" if met is None else ("[green]yes[/]" if met else "[red]NO[/]")])
    basis = result.get("ratio_basis")
    return table(f"ratios{f' ({basis})' if basis else ''}",
                 ["ratio", "value", "rounds", "goal", "met"], rows)


def failed(result: dict) -> dict[str, str]:
    """The ratios the run never exercised (name -> why): the benchmark failed."""
    return dict(result.get("not_exercised") or {})
