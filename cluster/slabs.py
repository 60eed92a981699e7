"""A client's mappings of its node's shared-memory slabs, remapped when the node actor
restarts (a new epoch means new slabs)."""

from __future__ import annotations

import threading

import torch

from actors.handles import NodeHandle
from cluster.calls import Steps, Wait, failed
from cluster.core.geometry import PageGeometry
from cluster.core.tiers.memory import ArenaMapping


class LocalSlabs:
    """Views of this node's slots, for one page geometry."""

    def __init__(self, node: NodeHandle, geometry: PageGeometry):
        self.node = node
        self.geometry = geometry
        self.epoch: int | None = None
        self._mappings: list[ArenaMapping] = []
        self._lock = threading.Lock()

    def ensure(self, epoch: int) -> Steps[bool]:
        """Map the node's slabs of `epoch` unless already mapped; False if that failed."""
        if self.epoch == epoch:
            return True
        (reply,) = yield Wait([self.node.descriptors(self.geometry)])
        if failed(reply):
            return False
        current, descriptors = reply
        with self._lock:
            if self.epoch != current:
                self._mappings = [ArenaMapping(d) for d in descriptors]
                self.epoch = current
        return self.epoch == epoch

    def page(self, tier: int, slot: int) -> torch.Tensor:
        """The page in a slot, typed and shaped (a view into shared memory)."""
        raw = self._mappings[tier].view(slot)[: self.geometry.page_bytes]
        return raw.view(self.geometry.torch_dtype()).view(self.geometry.shape)

    def generation(self, tier: int, slot: int) -> int:
        return self._mappings[tier].generation(slot)
