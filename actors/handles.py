"""The one place that calls `.remote()`: small wrappers around each actor's handle.

Callers get ObjectRefs back (actors await them; the sync client ray.get()s them), so unit tests
can swap a wrapper for a fake without Ray.
"""

from __future__ import annotations

import ray

from cluster.core.config import CacheConfig
from cluster.core.geometry import PageGeometry
from cluster.core.keys import PageKey, shard_of

DIRECTORY_NAME = "raykv-directory-{shard}"
NODE_NAME = "raykv-node-{node_id}"
CONTROLLER_NAME = "raykv-controller"


def split_by_shard(keys: list[PageKey], num_shards: int) -> list[list[int]]:
    """Positions of `keys` owned by each shard, in chain order."""
    positions: list[list[int]] = [[] for _ in range(num_shards)]
    for position, key in enumerate(keys):
        positions[shard_of(key, num_shards)].append(position)
    return positions


def merge_matches(num_keys: int, positions: list[list[int]], results: list[list]) -> list:
    """Merge per-shard prefix matches into the global longest prefix.

    A shard stops at its own first miss, so the global prefix ends at the earliest position
    that some shard did not return.
    """
    found: list = [None] * num_keys
    for shard_positions, shard_found in zip(positions, results, strict=True):
        for position, locations in zip(shard_positions, shard_found, strict=False):
            found[position] = locations
    prefix: list = []
    for locations in found:
        if not locations:
            break
        prefix.append(locations)
    return prefix


def expand_runs(runs: list[list]) -> list:
    """[[locations, n], ...] -> one locations entry per page."""
    return [locations for locations, count in runs for _ in range(count)]


class DirectoryHandle:
    """All directory shards, addressed by key."""

    def __init__(self, shards: list):
        self.shards = shards

    @staticmethod
    def lookup(config: CacheConfig) -> DirectoryHandle:
        shards = [ray.get_actor(DIRECTORY_NAME.format(shard=i), namespace=config.ray_namespace)
                  for i in range(config.num_directory_shards)]
        return DirectoryHandle(shards)

    def apply(self, shard: int, node_id: str, epoch: int, seq: int, changes: list):
        return self.shards[shard].apply.remote(node_id, epoch, seq, changes)

    def replace_node(self, shard: int, node_id: str, epoch: int, inventory: list, seq: int):
        return self.shards[shard].replace_node.remote(node_id, epoch, inventory, seq)

    def match_refs(self, keys: list[PageKey]) -> tuple[list[list[int]], list]:
        """One call per shard, in parallel, each with its keys as one blob."""
        positions = split_by_shard(keys, len(self.shards))
        refs = [shard.match.remote(b"".join(keys[p] for p in shard_positions))
                for shard, shard_positions in zip(self.shards, positions, strict=True)]
        return positions, refs

    def match(self, keys: list[PageKey]) -> list[tuple[tuple[str, int], ...]]:
        """Locations (best tier first) of every page of the longest prefix held anywhere."""
        if not keys:
            return []
        return self.collect(len(keys), *self.match_refs(keys))

    @staticmethod
    def collect(num_keys: int, positions: list[list[int]], refs: list) -> list:
        """Wait for `match_refs`' answers and merge them into one prefix."""
        answers = [expand_runs(runs) for runs in ray.get(refs)]
        if len(answers) == 1:
            return answers[0]
        return merge_matches(num_keys, positions, answers)

    def drop_node(self, node_id: str) -> list:
        return [shard.drop_node.remote(node_id) for shard in self.shards]

    def stats(self) -> list:
        return [shard.stats.remote() for shard in self.shards]

    def ping(self) -> list:
        return [shard.ping.remote() for shard in self.shards]


class NodeHandle:
    """One node-cache actor."""

    def __init__(self, actor, node_id: str, is_local: bool = False):
        self.actor = actor
        self.node_id = node_id
        self.is_local = is_local

    @staticmethod
    def lookup(node_id: str, config: CacheConfig, is_local: bool = False) -> NodeHandle | None:
        try:
            actor = ray.get_actor(NODE_NAME.format(node_id=node_id),
                                  namespace=config.ray_namespace)
        except ValueError:
            return None
        return NodeHandle(actor, node_id, is_local)

    def descriptors(self, geometry: PageGeometry):
        return self.actor.descriptors.remote(geometry)

    def reserve(self, geometry: PageGeometry, keys: list[PageKey]):
        return self.actor.reserve.remote(geometry, keys)

    def commit(self, geometry: PageGeometry, keys: list[PageKey]):
        return self.actor.commit.remote(geometry, keys)

    def abort(self, geometry: PageGeometry, keys: list[PageKey]):
        return self.actor.abort.remote(geometry, keys)

    def acquire(self, geometry: PageGeometry, keys: list[PageKey]):
        return self.actor.acquire.remote(geometry, keys)

    def release(self, lease_id: int):
        return self.actor.release.remote(lease_id)

    def put_pages(self, geometry: PageGeometry, keys: list[PageKey], pages: list):
        return self.actor.put_pages.remote(geometry, keys, pages)

    def export_pages(self, geometry: PageGeometry, keys: list[PageKey]):
        """A ref to the list of per-page refs of the longest prefix this node holds."""
        return self.actor.export_pages.remote(geometry, keys)

    def adopt(self, geometry: PageGeometry, keys: list[PageKey], refs: list):
        return self.actor.adopt.remote(geometry, keys, refs)

    def prefetch(self, geometry: PageGeometry, keys: list[PageKey], remote: dict | None = None):
        return self.actor.prefetch.remote(geometry, keys, remote)

    def stats(self):
        return self.actor.stats.remote()

    def ready(self):
        return self.actor.ready.remote()
