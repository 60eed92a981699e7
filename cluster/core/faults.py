"""Test-only fault injection for a node: slow or full disk, lost and reordered event batches.

Off by default, and free when off: the disk arena and the node actor hold `None` and test
it before each I/O or flush. `raykv bench faults` and tests/cluster/test_fault_injection.py
turn faults on through the node actor's `inject_fault(kind, **params)`:

    slow_disk      delay_s=0.02        every disk read and write sleeps first (in the I/O thread)
    full_disk      errno=ENOSPC        every disk write fails with that errno
    event_batches  drop_fraction=0.3   batches to the directory lost: half time out (resent),
                   reorder=True        half vanish after the node believed them delivered
                   seed=0              (repaired by acked_upto and the digest: a resync);
                                       each flush's batches go out newest first
    clear                              every fault off
"""

from __future__ import annotations

import errno as errno_codes
import os
import random
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class DiskFaults:
    """Injected into a DiskArena: latency before each page I/O, or an errno on each write."""

    delay_s: float = 0.0
    write_errno: int = 0

    def before_io(self, writing: bool) -> None:
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        if writing and self.write_errno:
            raise OSError(self.write_errno, f"{os.strerror(self.write_errno)} (injected)")


@dataclass(slots=True)
class EventFaults:
    """Lost and reordered event batches on their way to the directory."""

    drop_fraction: float = 0.0
    reorder: bool = False
    rng: random.Random = field(default_factory=random.Random)
    counters: dict[str, int] = field(default_factory=lambda: {
        "timed_out": 0, "vanished": 0, "reordered_flushes": 0})

    def mangle(self, outgoing: list) -> tuple[list, list, list]:
        """(sent, timed_out, vanished): the batches to send (newest first when reordering),
        those lost with the node hearing a timeout, those lost after it believed them
        delivered."""
        sent, timed_out, vanished = [], [], []
        for item in outgoing:
            if self.rng.random() >= self.drop_fraction:
                sent.append(item)
            elif self.rng.random() < 0.5:
                timed_out.append(item)
            else:
                vanished.append(item)
        if self.reorder and len(sent) > 1:
            sent.reverse()
            self.counters["reordered_flushes"] += 1
        self.counters["timed_out"] += len(timed_out)
        self.counters["vanished"] += len(vanished)
        return sent, timed_out, vanished


@dataclass(slots=True)
class NodeFaults:
    """The faults a node runs with now (None: that fault is off)."""

    disk: DiskFaults | None = None
    events: EventFaults | None = None

    def describe(self) -> dict:
        events = self.events
        return {"disk": None if self.disk is None else {"delay_s": self.disk.delay_s,
                                                        "write_errno": self.disk.write_errno},
                "events": None if events is None else {"drop_fraction": events.drop_fraction,
                                                       "reorder": events.reorder,
                                                       **events.counters}}


def _slow_disk(faults: NodeFaults, delay_s: float = 0.02) -> None:
    if not 0 < delay_s <= 10:
        raise ValueError(f"delay_s must be in (0, 10], got {delay_s}")
    write_errno = faults.disk.write_errno if faults.disk else 0
    faults.disk = DiskFaults(float(delay_s), write_errno)


def _full_disk(faults: NodeFaults, errno: int = errno_codes.ENOSPC) -> None:
    if errno not in (errno_codes.ENOSPC, errno_codes.EFBIG, errno_codes.EIO):
        raise ValueError(f"errno must be ENOSPC, EFBIG or EIO, got {errno}")
    delay_s = faults.disk.delay_s if faults.disk else 0.0
    faults.disk = DiskFaults(delay_s, int(errno))


def _event_batches(faults: NodeFaults, drop_fraction: float = 0.3, reorder: bool = True,
                   seed: int = 0) -> None:
    if not 0 <= drop_fraction < 1:
        raise ValueError(f"drop_fraction must be in [0, 1), got {drop_fraction}")
    faults.events = EventFaults(float(drop_fraction), bool(reorder), random.Random(seed))


def _clear(faults: NodeFaults) -> None:
    faults.disk = None
    faults.events = None


FAULT_KINDS = {"slow_disk": _slow_disk, "full_disk": _full_disk,
               "event_batches": _event_batches, "clear": _clear}


def apply_fault(faults: NodeFaults, kind: str, params: dict) -> NodeFaults:
    """Turn a fault on (or everything off with "clear"); ValueError for an unknown kind or
    a bad parameter, TypeError for an unknown parameter."""
    action = FAULT_KINDS.get(kind)
    if action is None:
        raise ValueError(f"unknown fault {kind!r}; known: {sorted(FAULT_KINDS)}")
    action(faults, **params)
    return faults
