"""`raykv tax` end to end, small: a tiny model, a few pages, three rounds of 32 tokens, no fio
(seconds)."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from cluster.core.tax_model import GOALS, MODES
from cluster.tools.cli import app
from cluster.tools.tax_report import MIN_TOKENS_PER_ROUND, TaxSettings
from tests.unit._pages import make_disk_dir, remove_dir


@pytest.fixture
def disk_dir():
    path = make_disk_dir()
    yield path
    remove_dir(path)


def test_raykv_tax_runs_and_writes_its_table_json_and_png(disk_dir, tmp_path):
    json_path, png_path = tmp_path / "tax.json", tmp_path / "tax.png"
    result = CliRunner().invoke(app, [
        "tax", "--model", "tiny-llama", "--context-tokens", "2048", "--page-tokens", "256",
        "--disk-fraction", "0.25", "--rounds", "3", "--no-fio", "--disk-dir", disk_dir,
        "--json", str(json_path), "--png", str(png_path)])
    assert result.exit_code == 0, result.output
    assert "paging tax: tiny-llama" in result.output and "tax_fp8_vs_none" in result.output
    report = json.loads(json_path.read_text())
    assert set(report["ratios"]) == set(GOALS) | {"tax_interference_share"}  # no goal
    assert set(report["met"]) == set(GOALS)
    assert report["config"]["tokens_per_round"] == MIN_TOKENS_PER_ROUND
    for name, value in report["ratios"].items():  # a median of per-round ratios, or null
        spread = report["spread"].get(name)
        assert (value is None) == (name in report["not_exercised"]) == (spread is None)
        assert value is None or spread["min"] <= value <= spread["max"]
    assert report["config"]["num_pages"] == 8 and report["config"]["num_disk_pages"] == 2
    assert set(report["modes"]) == {mode.name for mode in MODES}
    rounds = report["rounds"]
    assert len(rounds["latency_s"]) == len(rounds["bandwidth_bytes_per_s"]) == 3
    for key in ("token_s", "stall_s"):
        assert all(len(rounds[key][mode]) == 3 for mode in report["modes"])
    assert rounds["stall_s"]["resident"] == [0.0] * 3 and rounds["stall_s"]["none"][0] > 0
    assert report["disk"]["latency_us"] > 0 and report["disk"]["bandwidth_gbps"] > 0
    assert report["disk"]["fio_randread_gbps"] is None
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(disk_dir) == []  # the run's slabs are gone


@pytest.mark.parametrize("args", [["--disk-fraction", "0"], ["--model", "gpt-9"],
                                  ["--context-tokens", "100"], ["--rounds", "2"]])
def test_raykv_tax_refuses_settings_that_cannot_run(args):
    result = CliRunner().invoke(app, ["tax", *args])
    assert result.exit_code == 2


def test_raykv_tax_help_names_its_options():
    result = CliRunner().invoke(app, ["tax", "--help"])
    assert result.exit_code == 0
    for option in ("--model", "--context-tokens", "--disk-fraction", "--page-tokens",
                   "--disk-dir", "--json", "--png"):
        assert option in result.output


def test_settings_validate_before_any_file_is_written():
    with pytest.raises(ValueError, match="window_pages"):
        TaxSettings(window_pages=0)
    with pytest.raises(ValueError, match="tokens_per_round"):
        TaxSettings(tokens_per_round=MIN_TOKENS_PER_ROUND - 1)
    assert TaxSettings().model == "small-llama"
