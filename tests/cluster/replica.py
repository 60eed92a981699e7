"""A client living on a chosen node, as a Serve replica would."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster import connect
from cluster.core.spec import ModelSpec


@ray.remote(num_cpus=0, max_restarts=0)
class Replica:
    def __init__(self, spec: ModelSpec):
        self.client = connect(spec)

    def put(self, tokens, kv) -> int:
        return self.client.put(tokens, kv)

    def get(self, tokens):
        num_tokens, kv = self.client.get(tokens)
        return num_tokens, (kv.clone() if kv is not None else None)

    def lookup(self, tokens) -> int:
        return self.client.lookup(tokens)

    def prefetch(self, tokens) -> int:
        return self.client.prefetch(tokens)

    def stats(self) -> dict:
        return self.client.stats()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def located(self, tokens) -> list:
        return self.client.locate_keys(self.client.keys(tokens))


def replica_on(node_id: str, spec: ModelSpec):
    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return Replica.options(scheduling_strategy=strategy).remote(spec)
