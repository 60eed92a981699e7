"""How long `start()` waits for each of its steps (RAYKV_START_TIMEOUT_S), and what a step
that does not answer in time says, in the API and from `raykv start`. Ray's own
GetTimeoutError stands in for a step that never answers: no Ray here."""

from __future__ import annotations

import pytest
import ray
from typer.testing import CliRunner

import cluster
from cluster import api
from cluster.tools import ops_cli
from cluster.tools.cli import app


def test_each_step_waits_120_s_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.delenv(api.START_TIMEOUT_ENV, raising=False)
    assert api.start_timeout_s() == 120.0
    monkeypatch.setenv(api.START_TIMEOUT_ENV, " 300 ")
    assert api.start_timeout_s() == 300.0
    monkeypatch.setenv(api.START_TIMEOUT_ENV, "")
    assert api.start_timeout_s() == 120.0


@pytest.mark.parametrize("value", ["soon", "0", "-5", "inf", "nan"])
def test_a_timeout_that_is_not_a_positive_number_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(api.START_TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=api.START_TIMEOUT_ENV):
        api.start_timeout_s()


def test_a_step_that_answers_in_time_gives_its_answer(monkeypatch):
    monkeypatch.setenv(api.START_TIMEOUT_ENV, "7.5")
    waited = []

    def get(ref, timeout):
        waited.append(timeout)
        return {"members": ref}

    monkeypatch.setattr(api.ray, "get", get)
    assert api._start_step("node-a", "the controller", api.start_timeout_s()) == {
        "members": "node-a"}
    assert waited == [7.5]


def test_a_step_that_does_not_answer_names_itself_and_the_setting(monkeypatch):
    monkeypatch.setenv(api.START_TIMEOUT_ENV, "2")

    def get(ref, timeout):
        raise ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")

    monkeypatch.setattr(api.ray, "get", get)
    with pytest.raises(TimeoutError) as raised:
        api._start_step(object(), "the directory's shards", api.start_timeout_s())
    message = str(raised.value)
    assert "the directory's shards did not answer within 2 s" in message
    assert api.START_TIMEOUT_ENV in message and "start again" in message
    assert not isinstance(raised.value, ray.exceptions.RayError)


def test_raykv_start_prints_a_timeout_and_exits_1_with_no_traceback(monkeypatch):
    def start(config):
        raise TimeoutError("raykv start: the controller did not answer within 2 s. Set "
                           "RAYKV_START_TIMEOUT_S")

    monkeypatch.setattr(ops_cli, "_attach", lambda address: None)
    monkeypatch.setattr(cluster, "start", start)
    result = CliRunner().invoke(app, ["start"], env={"COLUMNS": "200"})
    assert result.exit_code == 1
    assert "did not answer within 2 s" in " ".join(result.output.split())
    assert result.exception is None or isinstance(result.exception, SystemExit)
    help_text = CliRunner().invoke(app, ["start", "--help"], env={"COLUMNS": "200"}).output
    assert "RAYKV_START_TIMEOUT_S" in " ".join(help_text.split())


def test_a_bad_timeout_is_refused_before_anything_starts(monkeypatch):
    touched = []
    monkeypatch.setenv(api.START_TIMEOUT_ENV, "soon")
    monkeypatch.setattr(api, "_ensure_ray", touched.append)
    monkeypatch.setattr(api, "spawn_directory", touched.append)
    with pytest.raises(ValueError, match=api.START_TIMEOUT_ENV):
        api.start(api.CacheConfig())
    assert touched == []
    monkeypatch.setattr(ops_cli, "_attach", touched.append)
    result = CliRunner().invoke(app, ["start"], env={"COLUMNS": "200",
                                                     api.START_TIMEOUT_ENV: "-1"})
    assert result.exit_code == 2 and api.START_TIMEOUT_ENV in " ".join(result.output.split())
    assert touched == []


@pytest.mark.parametrize("config", [{"page_tokens": 16}, "page_tokens=16", 16])
def test_a_config_that_is_not_a_cache_config_is_a_type_error_before_anything_starts(
        monkeypatch, config):
    touched = []
    monkeypatch.setattr(api, "_ensure_ray", touched.append)
    with pytest.raises(TypeError, match="config must be a CacheConfig"):
        api.start(config)
    assert touched == []
