"""The operator API across simulated nodes: warming a prompt onto a node copies its pages
there (a reader on that node then finds them local), and a pin covers every node that
holds the prompt, until it is unpinned."""

from __future__ import annotations

import pytest
import ray
import torch

from actors.handles import NodeHandle
from cluster import CacheConfig, ModelSpec, connect, start
from cluster.core.config import MiB
from tests.cluster.conftest import node_id_of, wait_until
from tests.cluster.replica import replica_on
from tests.kv import kv_for

TINY = ModelSpec.preset("tiny-llama")
TOKENS = list(range(1000, 1048))  # three pages of 16 tokens


@pytest.fixture(scope="module")
def nodes(ray_cluster, disk_root):
    start(CacheConfig(page_tokens=16, device_bytes=0, host_bytes=8 * MiB, disk_bytes=0,
                      disk_dir=disk_root, rebalance=False))
    return {name: node_id_of(f"node_{name}") for name in ("a", "b", "c")}


def node_stats(node_id: str) -> dict:
    return ray.get(NodeHandle.lookup(node_id, CacheConfig()).stats(), timeout=30)


def test_warm_copies_a_prompt_onto_the_named_node_and_pins_cover_every_holder(nodes):
    client = connect(TINY)  # the driver is on the head, node c
    assert client.put(TOKENS, kv_for(TINY, 48, 7)) == 48
    keys = client.keys(TOKENS)
    wait_until(lambda: len(client.locate_keys(keys)) == 3, 10, "the directory to hear")
    assert node_stats(nodes["a"])["pages"]["host"] == 0
    assert client.warm(TOKENS, nodes["a"]) == 3
    assert node_stats(nodes["a"])["pages"]["host"] == 3
    assert client.warm(TOKENS, nodes["a"][:12]) == 3  # again, by a prefix: nothing to pull
    reader = replica_on(nodes["a"], TINY)
    num_tokens, kv = ray.get(reader.get.remote(TOKENS), timeout=60)
    assert num_tokens == 48 and torch.equal(kv, kv_for(TINY, 48, 7))
    counters = ray.get(reader.stats.remote(), timeout=30)["client"]
    assert counters["local_pages"] == 3 and counters["remote_pages"] == 0
    wait_until(lambda: {n for places in client.locate_keys(keys) for n, _ in places}
               == {nodes["a"], nodes["c"]}, 10, "the directory to hear of the copy")
    assert client.pin(TOKENS, ttl_s=60) == 3
    for name in ("a", "c"):
        assert node_stats(nodes[name])["pins"]["pinned_pages"] == 3
    assert node_stats(nodes["b"])["pins"]["pinned_pages"] == 0
    assert client.unpin(TOKENS) == 3
    assert all(node_stats(nodes[n])["pins"]["pinned_pages"] == 0 for n in ("a", "c"))
    with pytest.raises(ValueError, match="is not a raykv node"):
        client.warm(TOKENS, "no-such-node")
