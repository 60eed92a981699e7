"""docs/benchmarks.md's summary table is made from docs/bench/*.json and must match them."""

import json
from pathlib import Path

import pytest

from cluster.tools.bench import summary

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_summary_table_is_true_to_the_json_files():
    assert summary.current(ROOT / "docs/benchmarks.md") == summary.block(ROOT / "docs/bench"), (
        "run: raykv bench summary docs/bench --doc docs/benchmarks.md")


def test_a_row_shows_value_spread_goal_met_and_the_run(tmp_path):
    result = {"ratios": {"a": 0.85, "b": None}, "goals": {"a": {"min": 0.9}, "b": {"max": 1}},
              "met": {"a": False, "b": False},
              "spread": {"a": {"min": 0.8, "max": 0.95, "rounds": [0.8, 0.85, 0.95]}},
              "machine": {"date": "2026-12-01 18:00:00 +0000", "commit": "abc1234",
                          "loadavg_start": [1.04, 0, 0], "loadavg_end": [2.0, 0, 0]}}
    (tmp_path / "t.json").write_text(json.dumps(result))
    rows = summary.table(tmp_path).splitlines()
    assert rows[2] == ("| t | `a` | 0.850 | 0.800..0.950 | >= 0.9 | **no** | 12-01 18:00 | "
                       "abc1234 | 1.0 -> 2.0 |")
    assert "not exercised" in rows[3] and "<= 1" in rows[3]


def test_rewrite_replaces_only_the_block(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "t.json").write_text('{"ratios": {"a": 1.0}}')
    doc = tmp_path / "doc.md"
    doc.write_text(f"head\n{summary.BEGIN}\nold\n{summary.END}\ntail\n")
    assert summary.rewrite(doc, tmp_path / "bench") is True
    assert doc.read_text() == f"head\n{summary.block(tmp_path / 'bench')}\ntail\n"
    assert summary.rewrite(doc, tmp_path / "bench") is False


def summary_cli(args: list[str]):
    from typer.testing import CliRunner

    from cluster.tools.cli import app

    result = CliRunner().invoke(app, ["bench", "summary", *args], env={"COLUMNS": "300"})
    return result, " ".join(result.output.split())


def assert_one_line_error(result, output: str, words: list[str]) -> None:
    assert result.exit_code != 0, output
    assert result.exception is None or isinstance(result.exception, SystemExit), output
    assert "Traceback" not in output and len(result.output.strip().splitlines()) == 1, output
    for word in words:
        assert word in output, output


BAD_FOLDERS = {  # found by an audit: an empty table and exit 0, or a traceback
    "missing": (None, ["no folder"]),
    "no JSON": ({}, ["no JSON"]),
    "bad JSON": ({"a.json": "{oops"}, ["a.json", "not JSON"]),
    "a list": ({"a.json": "[true]"}, ["a.json", "not a benchmark result"]),
    "ratios a list": ({"a.json": '{"ratios": [1]}'}, ["a.json", "not a benchmark result"]),
    "a bad spread": ({"a.json": '{"ratios": {"r": 1}, "spread": {"r": 3}}'},
                     ["a.json", "not a benchmark result"]),
}


@pytest.mark.parametrize("name", BAD_FOLDERS)
def test_a_folder_without_good_results_is_a_one_line_error(tmp_path, name):
    files, words = BAD_FOLDERS[name]
    folder = tmp_path / "bench"
    if files is not None:
        folder.mkdir()
        for file_name, text in files.items():
            (folder / file_name).write_text(text)
    result, output = summary_cli([str(folder)])
    assert_one_line_error(result, output, [str(folder), *words])


def test_the_default_folder_from_another_directory_is_an_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result, output = summary_cli([])
    assert_one_line_error(result, output, ["docs/bench", "no folder"])


@pytest.mark.parametrize("doc_text", [None, "no block here\n"], ids=["missing", "no markers"])
def test_a_doc_that_is_missing_or_has_no_block_is_a_one_line_error(tmp_path, doc_text):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "t.json").write_text('{"ratios": {"a": 1.0}}')
    doc = tmp_path / "doc.md"
    if doc_text is not None:
        doc.write_text(doc_text)
    result, output = summary_cli([str(tmp_path / "bench"), "--doc", str(doc)])
    assert_one_line_error(result, output, [str(doc)])
    assert doc_text is None or doc.read_text() == doc_text
