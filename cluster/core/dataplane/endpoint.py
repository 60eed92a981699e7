"""Where a node's data plane listens, as advertised through Ray (NodeCacheActor.dataplane)."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.core.dataplane.auth import Authority
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


Buffers = tuple[memoryview, ...]


@dataclass(frozen=True, slots=True)
class PageRead:
    """Pages to read from one owner into `dests`: dests[i] gives page i's writable buffers,
    which its bytes fill in order (one for a contiguous slot; one per row for a page of a KV
    tensor). Any indexable works: TensorPages makes each page's buffers only when the reader
    comes to it, so building them overlaps the bytes already arriving. `authority` is what
    the reader proves to the owner (auth.py): the peer key and its namespace's request key
    (None: the reader holds no credential, and the read is a miss without a connection)."""

    endpoint: Endpoint
    geometry: PageGeometry
    keys: tuple[PageKey, ...]
    dests: Sequence[Buffers]
    authority: Authority | None


class TensorPages(Sequence):
    """Page i of a read is `slices[i]` of a CPU tensor (all describable by tensor_buffers).

    Engines read into the same preallocated tensor again and again, so the buffers of its
    pages are kept with it (_BufferCache) rather than made anew: thousands of them per
    prompt cost milliseconds of Python."""

    def __init__(self, tensor: torch.Tensor, slices: list[torch.Tensor],
                 cache: _TensorBuffers | None = None):
        self._tensor = tensor
        self._cache = _buffer_cache.of(tensor) if cache is None else cache
        self._slices = slices

    def __len__(self) -> int:
        return len(self._slices)

    def __getitem__(self, index):
        if isinstance(index, slice):  # still lazy: a lane of a read takes a run of pages
            return TensorPages(self._tensor, self._slices[index], self._cache)
        return self._cache.buffers(self._slices[index])


class _TensorBuffers:
    """One tensor's storage as bytes and the buffers of the slices asked for so far."""

    def __init__(self, tensor: torch.Tensor):
        self.storage = storage_bytes(tensor)
        self.signature = _signature(tensor)
        self.by_slice: dict[tuple, Buffers] = {}

    def buffers(self, piece: torch.Tensor) -> Buffers:
        key = _signature(piece)
        found = self.by_slice.get(key)
        if found is None:
            found = tensor_buffers(piece, self.storage)
            assert found is not None, "TensorPages needs slices tensor_buffers can describe"
            if len(self.by_slice) < MAX_CACHED_SLICES:
                self.by_slice[key] = found
        return found


class _BufferCache:
    """The last few tensors read into, weakly held: an entry goes with its tensor."""

    def __init__(self, max_tensors: int):
        self.max_tensors = max_tensors
        self._entries: OrderedDict[int, tuple[weakref.ref, _TensorBuffers]] = OrderedDict()
        self._lock = threading.Lock()

    def of(self, tensor: torch.Tensor) -> _TensorBuffers:
        with self._lock:
            entry = self._entries.get(id(tensor))
            if entry is not None and entry[0]() is tensor \
                    and entry[1].signature == _signature(tensor):
                self._entries.move_to_end(id(tensor))
                return entry[1]
            made = _TensorBuffers(tensor)
            key = id(tensor)
            self._entries[key] = (weakref.ref(tensor, lambda _: self._drop(key)), made)
            while len(self._entries) > self.max_tensors:
                self._entries.popitem(last=False)
            return made

    def _drop(self, key: int) -> None:
        with self._lock:
            self._entries.pop(key, None)


def _signature(tensor: torch.Tensor) -> tuple:
    return (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


MAX_CACHED_SLICES = 4096
_buffer_cache = _BufferCache(max_tensors=4)


def storage_bytes(tensor: torch.Tensor) -> memoryview:
    """The whole storage under a CPU tensor, as writable bytes (the view keeps it alive)."""
    flat = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return memoryview(flat.numpy())


def tensor_buffers(tensor: torch.Tensor,
                   storage: memoryview | None = None) -> tuple[memoryview, ...] | None:
    """The contiguous runs of a CPU tensor, in element order, as writable buffers; None for a
    tensor they cannot describe (on a GPU, or whose leading dims do not flatten).

    A page of a KV tensor [L, 2, H, T, D] sliced along T is L*2*H runs of T*D elements; a
    receive fills them straight from the socket (one copy, no staging). `storage` is
    storage_bytes(tensor), when the caller describes many slices of one tensor.
    """
    if tensor.is_cuda or tensor.numel() == 0:
        return None
    row_elements = 1
    for size, stride in zip(reversed(tensor.shape), reversed(tensor.stride()), strict=True):
        if size != 1 and stride != row_elements:
            break
        row_elements *= size
    try:
        rows = tensor.view(-1, row_elements)
    except RuntimeError:  # the leading dims do not flatten to one stride
        return None
    storage = storage_bytes(tensor) if storage is None else storage
    element_bytes = tensor.element_size()
    start = rows.storage_offset() * element_bytes
    step, size = rows.stride(0) * element_bytes, row_elements * element_bytes
    if rows.shape[0] == 1:
        return (storage[start : start + size],)
    # Slicing one memoryview is the cheapest way to make thousands of buffers in Python.
    return tuple(storage[offset : offset + size]
                 for offset in range(start, start + rows.shape[0] * step, step))
