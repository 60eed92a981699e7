"""A same-node client in its own process, for tests/unit/test_retired_chunks.py: it maps a
device arena (the CPU stand-in), keeps a view of one slot, and otherwise makes no call; it
only answers the test over a pipe."""

from __future__ import annotations


def hold_a_view(descriptor, slot: int, poll_s: float, conn) -> None:
    """Map the arena, view `slot`, send its first byte; then on "let go" drop the view (the
    mapping stays, and is never updated), on "exit" end."""
    import cluster.core.tiers.chunk_readers as chunk_readers
    from cluster.core.tiers.memory import ArenaMapping

    chunk_readers.POLL_S = poll_s
    mapping = ArenaMapping(descriptor)
    view = mapping.view(slot)
    conn.send(None if view is None else int(view[0]))
    while True:
        command = conn.recv()
        if command == "let go":
            view = None
            conn.send(mapping.device.mapped_chunks)
        elif command == "exit":
            return
