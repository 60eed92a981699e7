"""CacheView: what one client's operations need to reach the service."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from actors.handles import DirectoryHandle, NodeHandle, PeerCache
from cluster.core.geometry import PageGeometry
from cluster.slabs import LocalSlabs


@dataclass(slots=True)
class CacheView:
    """One model's pages as a client sees them: its node, the directory and the peers.

    `home` is the node actor this client writes through: its own node's when there is one
    (`slabs` then maps its shared memory), else a remote one (pages travel as Ray objects).
    """

    geometry: PageGeometry
    home: NodeHandle
    directory: DirectoryHandle
    peers: PeerCache
    slabs: LocalSlabs | None = None
    namespace: str = ""
    fetch_s: float = 0.0  # the last get's time fetching remote pages (0: none fetched)
    counters: dict[str, int] = field(default_factory=lambda: {
        "put_tokens": 0, "get_tokens": 0, "lookups": 0, "local_pages": 0, "remote_pages": 0,
        "failed_calls": 0, "torn_reads": 0})

    @property
    def local(self) -> NodeHandle | None:
        return self.home if self.slabs is not None else None

    @property
    def page_tokens(self) -> int:
        return self.geometry.shape[3]

    def empty(self, num_tokens: int) -> torch.Tensor:
        shape = list(self.geometry.shape)
        shape[3] = num_tokens
        return torch.empty(shape, dtype=self.geometry.torch_dtype())

    def note_failures(self, results: list) -> None:
        self.counters["failed_calls"] += sum(isinstance(r, BaseException) for r in results)
