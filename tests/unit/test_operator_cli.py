"""`raykv pin`, `unpin`, `warm` and `quota namespace --priority`: what they refuse before
reaching any service, and how a prompt is given (no Ray)."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from cluster.serving import tokenizer
from cluster.tools.cli import app
from cluster.tools.operator_cli import prompt_tokens


def words(output: str) -> str:
    return " ".join(output.replace("│", " ").split())


def test_a_prompt_is_given_one_way(tmp_path):
    assert prompt_tokens("hi", None, None) == tokenizer.encode("hi")
    system = prompt_tokens(None, "be brief", None)
    chat = tokenizer.encode(tokenizer.apply_chat_template(
        [tokenizer.Message("system", "be brief"), tokenizer.Message("user", "hello")]))
    assert chat[: len(system)] == system  # every chat opening with it shares these pages
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps([5, 6, 7]))
    assert prompt_tokens(None, None, path) == [5, 6, 7]
    for bad in ('{"a": 1}', "[1, -2]", "[1.5]", "not json"):
        path.write_text(bad)
        with pytest.raises(typer.BadParameter):
            prompt_tokens(None, None, path)


@pytest.mark.parametrize("command", [["pin", "--ttl", "5"], ["unpin"], ["warm", "--node", "x"]])
def test_two_ways_or_none_is_refused(command):
    both = CliRunner().invoke(app, [*command, "--text", "a", "--system", "b"])
    assert both.exit_code == 2 and "give the prompt one way" in words(both.output)
    none = CliRunner().invoke(app, command)
    assert none.exit_code == 2


def test_an_unknown_priority_is_refused():
    bad = CliRunner().invoke(app, ["quota", "namespace", "vip", "--priority", "urgent"])
    assert bad.exit_code == 2
    assert "priority must be one of low, normal, high" in words(bad.output)
