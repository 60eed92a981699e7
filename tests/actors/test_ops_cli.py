"""`raykv start`, `raykv status` and `raykv stop` on a running Ray (the CLI in-process)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cluster import ModelSpec, connect
from cluster.api import running_config
from cluster.tools.cli import app
from tests.kv import kv_for


def test_start_status_stop(service, disk_root):
    from cluster import stop

    stop()
    runner = CliRunner()
    started = runner.invoke(app, ["start", "--host-bytes", "2MiB", "--device-bytes", "0",
                                  "--disk-bytes", "4MiB", "--disk-dir", disk_root,
                                  "--page-tokens", "16", "--namespaces", "default,team-x"])
    assert started.exit_code == 0, started.output
    assert "raykv running on 1 node" in started.output
    assert running_config().namespaces == ("default", "team-x")
    client = connect(ModelSpec.preset("tiny-llama"), "team-x")
    tokens = list(range(64))
    assert client.put(tokens, kv_for(ModelSpec.preset("tiny-llama"), 64)) == 64
    assert client.get(tokens)[0] == 64
    shown = runner.invoke(app, ["status"])
    assert shown.exit_code == 0, shown.output
    for text in ("raykv nodes", "tiers", "team-x", "tiny-llama", "2.0 MiB",
                 "routing: fetch paths"):
        assert text in shown.output, (text, shown.output)
    report = json.loads(runner.invoke(app, ["status", "--json"]).output)
    node = report["nodes"][0]
    assert node["pages"]["host"] == 4 and node["hit_ratio"] == 1.0
    assert report["tiers"]["host"]["held_bytes"] > 0
    assert report["registry"]["namespaces"]["team-x"]["held_bytes"] == 4 * 8192
    assert report["registry"]["models"]["tiny-llama"]["held_bytes"] > 0
    # no Serve app, so no engine replica has measured anything: the router's priors
    assert report["routing_rates"]["replicas"] == {}
    assert report["routing_rates"]["pooled"]["paths"]["host"]["num_samples"] == 0
    again = runner.invoke(app, ["start", "--host-bytes", "3MiB", "--disk-dir", disk_root])
    assert again.exit_code != 0 and "different CacheConfig" in str(again.exception)
    assert runner.invoke(app, ["stop"]).exit_code == 0
    bad = runner.invoke(app, ["start", "--host-bytes", "lots"])
    assert bad.exit_code == 2
    service()
