"""`raykv sim` refuses a bad trace or limit with a one-line error and exit 2, before it simulates
anything (found by an audit: a missing file, a directory, a line that is not JSON or has no
hash_ids were tracebacks; an empty file and --limit 0 a ZeroDivisionError; a negative limit
read nothing). No Ray."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cluster.tools import sim
from cluster.tools.cli import app

GOOD_LINE = json.dumps({"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]})
BAD_TRACES = {  # name -> (the file's text, or None for no file; words the error must say)
    "missing": (None, ["does not exist"]),
    "not JSON": (f"{GOOD_LINE}\n\nhello world\n", ["line 3", "not JSON"]),
    "no hash_ids": (f"{GOOD_LINE}\n" + json.dumps({"timestamp": 0, "input_length": 9}),
                    ["line 2", "hash_ids"]),
    "not an object": ("[1, 2]\n", ["line 1", "not a block-trace request"]),
    "empty": ("\n\n", ["no requests"]),
    "no input tokens": (json.dumps({"timestamp": 0, "input_length": 0, "hash_ids": []}),
                        ["no input tokens"]),
}


def invoke(args: list[str]):
    result = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    return result, " ".join(result.output.split())


def assert_refused(result, output: str, words: list[str]) -> None:
    assert result.exit_code == 2, output
    assert result.exception is None or isinstance(result.exception, SystemExit), output
    assert "Traceback" not in output and "Error" in output
    for word in words:
        assert word in output, output


@pytest.mark.parametrize("name", BAD_TRACES)
def test_a_bad_trace_is_a_one_line_error_naming_what_is_wrong(tmp_path, name):
    text, words = BAD_TRACES[name]
    trace = tmp_path / "trace.jsonl"
    if text is not None:
        trace.write_text(text)
    result, output = invoke(["sim", "--trace", str(trace), "--part", "eviction"])
    assert_refused(result, output, ["--trace", *words])
    assert list(tmp_path.iterdir()) == ([] if text is None else [trace])


def test_a_directory_is_no_trace(tmp_path):
    result, output = invoke(["sim", "--trace", str(tmp_path)])
    assert_refused(result, output, ["--trace", "is a directory"])


def test_start_s_past_the_trace_end_leaves_no_requests(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(GOOD_LINE + "\n")
    result, output = invoke(["sim", "--trace", str(trace), "--start-s", "5"])
    assert_refused(result, output, ["--trace", "no requests from 5"])


@pytest.mark.parametrize("limit", ["0", "-3"])
def test_a_limit_below_one_is_refused_before_the_trace_is_read(tmp_path, monkeypatch, limit):
    calls = []
    monkeypatch.setattr(sim, "run", lambda *args, **kwargs: calls.append(args))
    trace = tmp_path / "trace.jsonl"
    trace.write_text(GOOD_LINE + "\n")
    result, output = invoke(["sim", "--trace", str(trace), "--limit", limit])
    assert_refused(result, output, ["--limit", "1"])
    assert calls == []
    with pytest.raises(ValueError, match="at least 1"):
        sim.Bounds(limit=int(limit))
