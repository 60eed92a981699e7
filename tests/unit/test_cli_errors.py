"""The CLI's commands on the service say why they cannot reach Ray or raykv, and exit 1,
with no traceback (found by a probe: `raykv status`, `stop`, `pin`, `unpin` and `quota show`
with no Ray printed the hint, then a 40-line traceback repeating it)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import cluster
from cluster import api
from cluster.core.errors import ServiceNotRunning
from cluster.tools.cli import app

HINT = "raykv could not join the Ray cluster at 'auto'"
COMMANDS = [["status"], ["stop"], ["pin", "--text", "hi"], ["unpin", "--text", "hi"],
            ["warm", "--text", "hi", "--node", "n1"], ["quota", "show"],
            ["quota", "namespace", "acme"]]


def no_ray(*args, **kwargs):
    raise ConnectionError(HINT)


def not_running(*args, **kwargs):
    raise ServiceNotRunning("raykv is not running on this Ray cluster; call start() first")


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("fault", [no_ray, not_running], ids=["no Ray", "no raykv"])
def test_a_command_that_cannot_reach_the_service_says_why_and_exits_1(monkeypatch, command,
                                                                      fault):
    monkeypatch.setattr(api, "join_ray", fault)
    monkeypatch.setattr(cluster, "connect", fault)  # pin, unpin, warm
    for name in ("quotas", "add_namespace", "register_model", "stop", "status"):
        monkeypatch.setattr(api, name, fault)
        monkeypatch.setattr(cluster, name, fault, raising=False)
    result = CliRunner().invoke(app, command, env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    output = " ".join(result.output.split())
    assert ("could not join" in output or "not running" in output) and "Traceback" not in output
