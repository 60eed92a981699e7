"""Every command that writes a result (`raykv bench NAME`, `raykv sim`, `raykv tax`, `raykv
demo`) checks its --json and --plot/--png paths before any work: a missing parent folder is
made as the work starts, a directory or an unwritable place is a one-line error with exit 2
(found by an audit: each failed only after the whole run, with a traceback, and the result
was lost). The work here is a stand-in that records its call. No Ray."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

import cluster.tools.demo
import cluster.tools.tax
from cluster.tools import cli, sim

CALLS: list[tuple] = []
UNWRITABLE = "/sys/raykv-unwritable/x.json"  # sysfs refuses new files, even to root


def run(json_path, quick, **extra) -> dict:
    """The stand-in for a benchmark module's run: records the call."""
    CALLS.append((json_path, extra))
    return {"ratios": {}}


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch, tmp_path):
    CALLS.clear()
    monkeypatch.chdir(tmp_path)  # `raykv tax`'s default --png is out/tax.png, here
    for name in cli.BENCHMARKS:
        monkeypatch.setitem(cli.BENCHMARKS, name, __name__)
    monkeypatch.setattr(sim, "run", lambda *args: CALLS.append(args) or {"ratios": {}})
    monkeypatch.setattr(cluster.tools.tax, "run_tax", lambda *args: CALLS.append(args))
    monkeypatch.setattr(cluster.tools.demo, "run_demo", lambda *args: CALLS.append(args))
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}\n')
    return trace


def commands() -> list[list[str]]:
    return [["bench", name] for name in cli.BENCHMARKS] + [["sim", "--trace", "trace.jsonl"],
                                                           ["tax"]]


PLOTTED = [(["bench", "serve"], "--plot"), (["bench", "burst"], "--plot"),
           (["sim", "--trace", "trace.jsonl"], "--plot"), (["tax"], "--png"), (["demo"], "--png")]


def invoke(args: list[str]):
    result = CliRunner().invoke(cli.app, args, env={"COLUMNS": "300"})
    return result, " ".join(result.output.split())


def assert_refused_before_work(result, output: str, words: list[str]) -> None:
    assert result.exit_code == 2, output
    assert result.exception is None or isinstance(result.exception, SystemExit), output
    assert "Traceback" not in output
    for word in words:
        assert word in output, output
    assert CALLS == []


@pytest.mark.parametrize("command", commands(), ids=" ".join)
def test_a_missing_parent_folder_is_made_before_the_work(tmp_path, command):
    result, output = invoke([*command, "--json", "out/bench/x.json"])
    assert result.exit_code == 0, output
    assert (tmp_path / "out" / "bench").is_dir() and len(CALLS) == 1
    assert not (tmp_path / "out" / "bench" / "x.json").exists()  # only the stand-in ran


@pytest.mark.parametrize("command", commands(), ids=" ".join)
def test_a_json_path_that_is_a_directory_is_refused_before_the_work(tmp_path, command):
    (tmp_path / "out").mkdir()
    result, output = invoke([*command, "--json", "out"])
    assert_refused_before_work(result, output, ["--json", "is a directory"])


@pytest.mark.parametrize("command", commands(), ids=" ".join)
def test_a_json_path_under_a_file_is_refused_before_the_work(tmp_path, command):
    (tmp_path / "out").write_text("a file")
    result, output = invoke([*command, "--json", "out/x.json"])
    assert_refused_before_work(result, output, ["--json", "out"])


@pytest.mark.skipif(not os.path.isdir("/sys"), reason="needs a read-only /sys")
@pytest.mark.parametrize("command", commands(), ids=" ".join)
def test_an_unwritable_json_path_is_refused_before_the_work(command):
    result, output = invoke([*command, "--json", UNWRITABLE])
    assert_refused_before_work(result, output, ["--json", "/sys"])


@pytest.mark.parametrize(("command", "option"), PLOTTED, ids=lambda c: " ".join(c)
                         if isinstance(c, list) else c)
def test_a_plot_path_is_checked_and_its_folder_made_as_well(tmp_path, command, option):
    (tmp_path / "adir").mkdir()
    result, output = invoke([*command, option, "adir"])
    assert_refused_before_work(result, output, [option, "is a directory"])
    result, output = invoke([*command, option, "plots/x.png"])
    assert result.exit_code == 0, output
    assert (tmp_path / "plots").is_dir() and len(CALLS) == 1


@pytest.mark.parametrize("command", [["tax", "--rounds", "2"], ["sim", "--trace", "trace.jsonl",
                                                                 "--part", "nope"]], ids=" ".join)
def test_a_command_refused_for_another_reason_makes_no_folder(tmp_path, command):
    result, output = invoke([*command, "--json", "out/x.json"])
    assert result.exit_code == 2 and CALLS == [], output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.jsonl"]
