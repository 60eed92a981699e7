"""Where a node's data plane listens, as advertised through Ray (NodeCacheActor.dataplane)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.core.geometry import PageGeometry
from cluster.core.keys import PageKey


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One node actor's page server: its transport, address and incarnation (epoch)."""

    transport: str
    host: str
    port: int
    epoch: int = 0

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port


@dataclass(frozen=True, slots=True)
class PageRead:
    """Pages to read from one owner into `dests`: per page, the writable buffers that its
    bytes fill in order (one for a contiguous slot; one per row for a page of a KV tensor)."""

    endpoint: Endpoint
    geometry: PageGeometry
    keys: tuple[PageKey, ...]
    dests: tuple[tuple[memoryview, ...], ...]


def tensor_buffers(tensor: torch.Tensor) -> tuple[memoryview, ...] | None:
    """The contiguous runs of a CPU tensor, in element order, as writable buffers; None for a
    tensor they cannot describe (on a GPU, or whose leading dims do not flatten).

    A page of a KV tensor [L, 2, H, T, D] sliced along T is L*2*H runs of T*D elements; a
    receive fills them straight from the socket (one copy, no staging).
    """
    if tensor.is_cuda or tensor.numel() == 0:
        return None
    row_elements = 1
    for size, stride in zip(reversed(tensor.shape), reversed(tensor.stride()), strict=True):
        if size != 1 and stride != row_elements:
            break
        row_elements *= size
    try:
        rows = tensor.view(-1, row_elements).view(torch.uint8).numpy()
    except RuntimeError:  # the leading dims do not flatten to one stride
        return None
    return tuple(memoryview(row) for row in rows)
