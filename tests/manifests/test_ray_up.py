"""The `ray up` YAML passes Ray's own config preparation and validation
(ray.autoscaler._private.util.prepare_config / validate_config) with the network shut off, so
nothing reaches a cloud, and validates against the shared copy of Ray's cluster schema."""

from __future__ import annotations

import copy
import fnmatch
import json
import socket

import jsonschema
import pytest

from tests.manifests._manifests import SCHEMAS, ray_up, venv_names


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("validating the ray up YAML tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_ray_prepares_and_validates_it_offline(no_network):
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(ray_up()))
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"
    assert prepared["available_node_types"]["head"]["max_workers"] == 0


def test_ray_rejects_a_broken_copy(no_network):
    from ray.autoscaler._private.util import prepare_config, validate_config

    broken = copy.deepcopy(ray_up())
    broken["available_node_types"]["gpu_kv"]["min_wokers"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


def test_it_matches_the_shared_cluster_schema():
    path = SCHEMAS / "ray-cluster-schema.json"
    if not path.is_file():
        pytest.skip(f"{path} not found (the shared schemas folder); NOT validated against it")
    jsonschema.validate(ray_up(), json.loads(path.read_text()))


def test_the_sync_leaves_out_every_venv():
    """file_mounts copies the repository to every node: rsync_exclude (rsync's --exclude: a
    pattern without a slash matches a file or folder name anywhere) leaves out the local venvs,
    make test's .venv-vllm (4.5 GB) among them."""
    patterns = ray_up()["rsync_exclude"]
    names = venv_names()
    assert {".venv", ".venv-vllm"} <= names
    for name in names:
        assert any("/" not in p and fnmatch.fnmatchcase(name, p) for p in patterns), name
    assert not any(fnmatch.fnmatchcase(name, p) for p in patterns
                   for name in ("cluster", "manifests", "pyproject.toml", "venv.md"))
