"""`raykv bench summary`: the one summary table of docs/benchmarks.md, made from the JSON files
in docs/bench/, so that the table is true to them by construction.

Each row is one ratio of one run: its value, the spread of its rounds (min..max) where it was
paired, its goal, whether it was met, and the run's date, commit and load average (start -> end).
A run that recorded no commit predates the harness (and the rules): it is marked stale.
"""

from __future__ import annotations

import json
from pathlib import Path

from cluster.tools.bench.harness import goal_text
from cluster.tools.outputs import write_text_atomic

BEGIN = "<!-- summary:begin (raykv bench summary docs/bench; do not edit by hand) -->"
END = "<!-- summary:end -->"
HEADER = ("| benchmark | ratio | value | rounds (min..max) | goal | met | run (UTC) | commit "
          "| load start -> end |\n|---|---|---|---|---|---|---|---|---|")


def _number(value) -> str:
    if value is None:
        return "not exercised"
    if float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 0.01 and value != 0 else f"{value:.3f}"


def _met(result: dict, name: str) -> str:
    met = result.get("met", {}).get(name)
    return "" if met is None else ("yes" if met else "**no**")


def _run_cells(result: dict) -> list[str]:
    machine = result.get("machine", {})
    date = str(machine.get("date", "?"))[5:16]
    commit = machine.get("commit") or "stale (before the harness)"
    start, end = machine.get("loadavg_start"), machine.get("loadavg_end")
    load = f"{start[0]:.1f} -> {end[0]:.1f}" if start and end else "?"
    return [date, commit, load]


def rows_of(name: str, result: dict) -> list[str]:
    """The table rows of one result file (named `name`)."""
    rows = []
    spreads = result.get("spread", {})
    for ratio, value in result.get("ratios", {}).items():
        spread = spreads.get(ratio)
        cells = [name, f"`{ratio}`", _number(value),
                 f"{spread['min']:.3f}..{spread['max']:.3f}" if spread else "",
                 goal_text(result.get("goals", {}).get(ratio)), _met(result, ratio),
                 *_run_cells(result)]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


class SummaryError(ValueError):
    """A folder or file the summary cannot be made from or written into; the message names it."""


def table(bench_dir: Path) -> str:
    """The markdown table of every *.json in bench_dir (sorted by file name); SummaryError for
    a missing folder, one without JSON files, or a file that is not a benchmark result."""
    if not bench_dir.is_dir():
        raise SummaryError(f"{bench_dir}: no folder of that name (run from the repository "
                           "root, or name the folder)")
    paths = sorted(bench_dir.glob("*.json"))
    if not paths:
        raise SummaryError(f"{bench_dir}: no JSON results in the folder")
    rows = [HEADER]
    for path in paths:
        rows.extend(_file_rows(path))
    return "\n".join(rows)


def _file_rows(path: Path) -> list[str]:
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise SummaryError(f"{path}: cannot read it ({_why(error)})") from None
    except json.JSONDecodeError as error:
        raise SummaryError(f"{path}: not JSON ({error})") from None
    if not isinstance(result, dict) or not isinstance(result.get("ratios", {}), dict):
        raise SummaryError(f"{path}: not a benchmark result (a JSON object with a \"ratios\" "
                           "object)")
    try:
        return rows_of(path.stem, result)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as error:
        raise SummaryError(f"{path}: not a benchmark result ({type(error).__name__}: "
                           f"{error})") from None


def block(bench_dir: Path) -> str:
    """The summary block (markers included) made from bench_dir."""
    return f"{BEGIN}\n{table(bench_dir)}\n{END}"


def rewrite(doc_path: Path, bench_dir: Path) -> bool:
    """Replace the summary block in doc_path with one made from bench_dir, the file replaced
    whole; True if it changed. SummaryError for a doc that cannot be read or has no block."""
    text = _read_doc(doc_path)
    head, _, rest = text.partition(BEGIN)
    _, found, tail = rest.partition(END)
    if not found:
        raise SummaryError(f"{doc_path}: no summary block ({BEGIN!r} ... {END!r})")
    new_text = head + block(bench_dir) + tail
    changed = new_text != text
    if changed:
        write_text_atomic(doc_path, new_text)
    return changed


def _read_doc(doc_path: Path) -> str:
    try:
        return doc_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise SummaryError(f"{doc_path}: cannot read it ({_why(error)})") from None


def _why(error: OSError | UnicodeDecodeError) -> str:
    return getattr(error, "strerror", None) or str(error)


def current(doc_path: Path) -> str:
    """The summary block now in doc_path."""
    text = doc_path.read_text()
    start = text.index(BEGIN)
    return text[start: text.index(END, start) + len(END)]
