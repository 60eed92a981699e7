"""The ways pages cross in the data plane's unit tests: plain TCP, and NIXL with UCX over
shared memory (UCX_TLS=shm,tcp: the writes by CMA, UCX's control messages over TCP; `shm`
alone does not start, NIXL needs a transport with peer-failure handling) or over TCP alone.

Each NIXL wire has two agents of its own, an owner's and a reader's, made once per module
under its UCX_TLS and kept on loopback (UCX_NET_DEVICES=lo)."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

from cluster.core.dataplane.connections import ConnectionPool
from cluster.core.dataplane.reader import read_pages
from cluster.core.dataplane.server import Listen, PageServer

WIRES = ("tcp", "nixl-shm", "nixl-tcp")
UCX_TLS = {"nixl-shm": "shm,tcp", "nixl-tcp": "tcp"}
_agents: dict[str, tuple] = {}


@contextmanager
def ucx_env(tls: str):
    """UCX reads its settings when an agent starts its backend: set them around it only."""
    saved = {name: os.environ.get(name) for name in ("UCX_TLS", "UCX_NET_DEVICES")}
    os.environ.update(UCX_TLS=tls, UCX_NET_DEVICES="lo")
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def nixl_agents(wire: str) -> tuple:
    """(owner agent, reader agent) of a NIXL wire; skips when NIXL is not installed (it is a
    dev dependency: installed, a NIXL that does not start is a failure, not a skip)."""
    from cluster.core.dataplane.nixl_agent import NixlAgent, load_api

    try:
        load_api()
    except ImportError as error:
        pytest.skip(f"NIXL is not installed: {error}")
    if wire not in _agents:
        with ucx_env(UCX_TLS[wire]):
            _agents[wire] = (NixlAgent(), NixlAgent())
    return _agents[wire]


class Wire:
    """serve(source) and read(pool, reads) over one of WIRES."""

    def __init__(self, name: str):
        self.name = name
        self.owner = self.reader = None
        if name != "tcp":
            self.owner, self.reader = nixl_agents(name)

    @property
    def endpoint_kind(self) -> str:
        return "tcp" if self.owner is None else "nixl"

    def serve(self, source, listen: Listen, timeout_s: float) -> PageServer:
        if self.owner is None:
            return PageServer(source, listen, timeout_s)
        from cluster.core.dataplane.nixl_transport import NixlPageServer

        return NixlPageServer(source, listen, timeout_s, 0, self.owner)

    def read(self, pool: ConnectionPool, reads, timeout_s: float) -> list[int | None]:
        if self.reader is None:
            return read_pages(pool, reads, timeout_s)
        from cluster.core.dataplane.nixl_transport import read_nixl

        return read_nixl(pool, self.reader, reads, timeout_s)


class WireTransport:
    """A Transport over a Wire with a connection pool of its own (for pull_pages)."""

    def __init__(self, wire: Wire):
        self.wire = wire
        self.pool = ConnectionPool()

    def read(self, reads, timeout_s):
        return self.wire.read(self.pool, reads, timeout_s)

    def close(self):
        self.pool.close()
