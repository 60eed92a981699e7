"""docs/benchmarks.md's summary table is made from docs/bench/*.json and must match them."""

import json
from pathlib import Path

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
    doc = tmp_path / "doc.md"
    doc.write_text(f"head\n{summary.BEGIN}\nold\n{summary.END}\ntail\n")
    assert summary.rewrite(doc, tmp_path / "bench") is True
    assert doc.read_text() == f"head\n{summary.block(tmp_path / 'bench')}\ntail\n"
    assert summary.rewrite(doc, tmp_path / "bench") is False
