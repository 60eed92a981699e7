"""Transports: how pages cross between processes. Pluggable by name (CacheConfig.transport).

    serve(source, listen, timeout_s, epoch) -> a server (endpoint, stats(), close())
    read(reads, timeout_s) -> per read, leading pages that arrived intact (None: it failed)
    close()                -> close this process's connections

TCP runs everywhere, and on this kind of machine it moved pages faster than every other
candidate measured (docs/dataplane.md). NIXL (nixl_transport.py) keeps TCP's page servers as
the control path and moves the bytes with a NIXL write: RDMA (GPUDirect for VRAM pages) where
UCX finds it; where NIXL is absent or fails, the same pages go over TCP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from cluster.core.dataplane.connections import close_shared_pool, shared_pool
from cluster.core.dataplane.endpoint import PageRead
from cluster.core.dataplane.nixl_transport import NixlTransport
from cluster.core.dataplane.reader import read_pages
from cluster.core.dataplane.server import Listen, PageServer, PageSource


class Transport(Protocol):
    name: str

    def serve(self, source: PageSource, listen: Listen, timeout_s: float,
              epoch: int) -> PageServer:
        """Start serving `source` where `listen` says, to readers that prove its guard's
        peer key (every request's tag checked by the guard: auth.py)."""

    def read(self, reads: list[PageRead], timeout_s: float) -> list[int | None]:
        """Fill each read's destinations; per read, the leading pages that arrived intact,
        or None when the owner could not be read (unreachable, died, stalled)."""

    def close(self) -> None:
        """Close this process's client connections."""


class TcpTransport:
    """Threaded page servers and pooled, reused client connections (one pool per process)."""

    name = "tcp"

    def serve(self, source: PageSource, listen: Listen, timeout_s: float,
              epoch: int) -> PageServer:
        return PageServer(source, listen, timeout_s, epoch)

    def read(self, reads: list[PageRead], timeout_s: float) -> list[int | None]:
        return read_pages(shared_pool(), reads, timeout_s)

    def close(self) -> None:
        close_shared_pool()


TRANSPORTS: dict[str, Callable[[], Transport]] = {"tcp": TcpTransport,
                                                   "nixl": NixlTransport}


def make_transport(name: str) -> Transport:
    """The transport of that name; ValueError naming the known ones."""
    factory = TRANSPORTS.get(name)
    if factory is None:
        raise ValueError(f"unknown transport {name!r}; known: {sorted(TRANSPORTS)}")
    return factory()
