"""DirectoryShard: a thin async Ray shell around one DirectoryIndex shard.

Named `raykv-directory-<i>` in the `raykv` namespace, detached, restarted forever. It applies
node event batches, answers longest-prefix matches in one call, and (issue: cluster) persists
to Redis and purges dead nodes.
"""

from __future__ import annotations

import ray

from cluster.config import CacheConfig
from cluster.directory_index import DirectoryIndex
from cluster.keys import PageKey


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class DirectoryShard:
    """One shard of the global page directory."""

    def __init__(self, config_json: str, shard: int):
        self.config_json = config_json
        self.config = CacheConfig.model_validate_json(config_json)
        self.shard = shard
        self.index = DirectoryIndex()

    async def get_config(self) -> str:
        return self.config_json

    async def apply(self, node_id: str, epoch: int, seq: int,
                    changes: list[tuple[PageKey, int | None]]) -> bool:
        return self.index.apply(node_id, epoch, seq, changes)

    async def replace_node(self, node_id: str, epoch: int,
                           inventory: list[tuple[PageKey, int]], seq: int) -> None:
        self.index.replace_node(node_id, epoch, inventory, seq)

    async def match(self, keys: list[PageKey]) -> list[list[tuple[str, int]]]:
        return self.index.match(keys)

    async def drop_node(self, node_id: str) -> int:
        return self.index.drop_node(node_id)

    async def stats(self) -> dict:
        return {"shard": self.shard, **self.index.stats()}

    async def ping(self) -> int:
        return self.shard
