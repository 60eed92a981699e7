"""A page's entry in its pool's index: where it is and what may happen to it."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class State(enum.IntEnum):
    PENDING = 0  # reserved by a put; invisible until committed
    READY = 1
    MOVING = 2  # between tiers; treated as pinned


@dataclass(slots=True)
class Entry:
    tier: int
    slot: int
    state: State
    codec: int = 0
    pins: int = 0
    owner: int = 0  # the reservation a PENDING page belongs to
    namespace: str = ""  # whose page it is, for namespace quotas ("" when not known)
    checksum: int | None = None  # its payload's, once taken (checksums_ahead.py)
