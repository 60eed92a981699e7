"""The public client API on a local Ray: round trips, prefixes, bad input, namespaces."""

from __future__ import annotations

import pytest
import ray
import torch

from cluster import ModelSpec, connect
from tests.kv import kv_for
from tests.waiting import wait_until

TINY = ModelSpec.preset("tiny-llama")




@pytest.fixture(scope="module")
def started(service):
    service()


@pytest.fixture
def client(started):
    return connect(TINY)


def test_put_get_round_trip_is_exact(client):
    tokens = list(range(100))
    kv = kv_for(TINY, 100)
    assert client.put(tokens, kv) == 96  # only full pages of 16
    assert client.lookup(tokens) == 96
    num_tokens, got = client.get(tokens)
    assert num_tokens == 96
    assert got.dtype == kv.dtype and got.shape == (2, 2, 2, 96, 16)
    assert torch.equal(got, kv[:, :, :, :96])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_round_trip_keeps_dtype(client, dtype):
    spec = ModelSpec("tiny-" + dtype, 2, 2, 16, dtype)
    other = connect(spec)
    tokens = list(range(500, 564))
    kv = kv_for(spec, 64, seed=3)
    assert other.put(tokens, kv) == 64
    num_tokens, got = other.get(tokens)
    assert num_tokens == 64 and got.dtype == kv.dtype
    assert torch.equal(got.view(torch.int16), kv.view(torch.int16))


def test_longer_prompt_reuses_prefix(client):
    base = list(range(1000, 1048))
    client.put(base, kv_for(TINY, 48, seed=1))
    longer = base + [7] * 40
    assert client.lookup(longer) == 48
    num_tokens, got = client.get(longer)
    assert num_tokens == 48
    assert torch.equal(got, kv_for(TINY, 48, seed=1))
    changed = [base[0] + 1] + base[1:]
    assert client.lookup(changed) == 0


def test_get_fills_out_in_place(client):
    tokens = list(range(2000, 2032))
    kv = kv_for(TINY, 32, seed=2)
    client.put(tokens, kv)
    out = torch.zeros(2, 2, 2, 64, 16)
    num_tokens, got = client.get(tokens + [1] * 32, out=out)
    assert num_tokens == 32
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out[:, :, :, :32], kv)
    assert torch.count_nonzero(out[:, :, :, 32:]) == 0


def test_miss_is_not_an_error(client):
    assert client.get(list(range(9000, 9064))) == (0, None)
    assert client.get([1, 2, 3]) == (0, None)  # no full page


def node_pages(client) -> int:
    return sum(client.stats()["node"]["pages"].values())


@pytest.mark.parametrize("bad", [
    ("wrong dtype", lambda t: kv_for(TINY, 32).double(), TypeError, "dtype"),
    ("wrong shape", lambda t: torch.zeros(3, 2, 2, 32, 16), ValueError, "shape"),
    ("mismatched length", lambda t: kv_for(TINY, 31), ValueError, "tokens"),
    ("not a tensor", lambda t: [[0.0]], TypeError, "torch.Tensor"),
])
def test_bad_kv_is_refused_and_nothing_stored(client, bad):
    _, make_kv, error, word = bad
    tokens = list(range(3000, 3032))
    before = node_pages(client)
    with pytest.raises(error, match=word):
        client.put(tokens, make_kv(tokens))
    assert client.lookup(tokens) == 0
    assert node_pages(client) == before


@pytest.mark.parametrize("tokens,error", [
    ([0.5] * 32, TypeError),
    (["a"] * 32, TypeError),
    ([True] * 32, TypeError),
    ([-1] * 32, ValueError),
    ([[1, 2]] * 16, ValueError),
])
def test_bad_tokens_are_refused(client, tokens, error):
    with pytest.raises(error):
        client.put(tokens, kv_for(TINY, 32))
    with pytest.raises(error):
        client.lookup(tokens)


def test_a_second_start_with_another_config_is_refused(started):
    from cluster import CacheConfig, start
    from cluster.api import running_config

    with pytest.raises(ValueError, match="different CacheConfig"):
        start(CacheConfig(page_tokens=32, disk_dir="/tmp/elsewhere"))
    assert running_config().page_tokens == 16
    assert start(running_config())["nodes"]  # the same config again: idempotent


def test_unknown_namespace_and_model(client):
    with pytest.raises(ValueError, match="namespace"):
        connect(TINY, namespace="nobody")
    with pytest.raises(ValueError, match="unknown model"):
        ModelSpec.preset("gpt-17")
    with pytest.raises(TypeError):
        connect("tiny-llama")


def test_namespaces_and_models_do_not_share_pages(service, started):
    service(namespaces=("default", "tenant-b"))
    mine, theirs = connect(TINY), connect(TINY, namespace="tenant-b")
    tokens = list(range(4000, 4032))
    mine.put(tokens, kv_for(TINY, 32))
    assert mine.lookup(tokens) == 32
    assert theirs.lookup(tokens) == 0
    other_model = connect(ModelSpec("tiny-other", 2, 2, 16, "float32"))
    assert other_model.lookup(tokens) == 0
    service()  # back to the module's default service


def test_out_of_shape_out_is_refused(client):
    tokens = list(range(5000, 5032))
    with pytest.raises(ValueError, match="room"):
        client.get(tokens, out=torch.zeros(2, 2, 2, 16, 16))


def test_stats_report_tiers_and_directory(client):
    client.put(list(range(6000, 6032)), kv_for(TINY, 32))
    stats = client.stats()
    assert set(stats["node"]["pages"]) == {"device", "host", "disk"}
    # The commit does not wait for the directory: it hears of the pages just after.
    wait_until(lambda: client.stats()["directory"][0]["num_keys"] >= 1, 10, "the event flush")
    assert stats["client"]["put_tokens"] > 0
    assert ray.is_initialized()


def test_the_node_actor_sees_the_node_gpus_and_serves_pages_on_its_address(client):
    stats = client.stats()["node"]
    assert stats["gpus"] == ["0", "1"]  # the node's 2 GPUs (labels here: no CUDA, no VRAM)
    endpoint = ray.get(client.local.dataplane())
    assert endpoint.transport == "tcp" and endpoint.host == ray.util.get_node_ip_address()
    assert stats["dataplane"]["endpoint"] == f"{endpoint.host}:{endpoint.port}"
