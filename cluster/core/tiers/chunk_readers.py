"""Who may still map a released device chunk: its memory is freed only when nobody can.

A same-node client maps each device chunk it uses (VRAM: cudaIpcOpenMemHandle; the CPU
stand-in: a shm file). CUDA leaves a cudaFree of an exported allocation that an importer still
maps undefined (in practice the driver keeps the memory until the importer closes it), so a
released chunk is *retired*, not freed, until no live client can have it mapped; and a client
learns of the release with no call, through one small file per arena:

    /dev/shm/<arena>-readers   made by the node actor (0600), mapped by its clients
      header | magic | layout version | num_chunks | num_slots |          uint64 each
      grants | the grant id of each chunk the node holds, 0: none |        uint64 [num_chunks]
      slots  | pid | PID namespace | start time | caught-up version |    uint64 [num_slots, 4]

The node (NodeReaders, RetiredChunks) writes a chunk's grant, then the new layout version, on
every grant and release. A released chunk is retired with the version after its release and
freed once every live client's caught-up version reaches that version.

A client (ReaderSlot, one per DeviceMaps) is *caught up to v* when it has closed every mapping
of a grant released at or before v. It takes a slot before it maps anything, and opens a grant
only while the table lists it. A thread per process (every POLL_S) and each reply compare its
mappings with the table, drop those whose grant is no longer listed, and write the newest
version it is caught up to once their last views are gone. A slot whose owner is gone is
cleared once its mappings are closed.

Dead clients and PID namespaces: the node clears a slot whose process no longer exists (pid
gone, a zombie, or another process by its start time): a PID check, valid on this node only.
A client in another PID namespace (its pid means nothing here) cannot be checked: its slot is
trusted as live, and a chunk it keeps retired is freed anyway after `retired_max_s`
(RETIRED_CHUNK_MAX_S by default), with a warning; the same bound covers a live client that
stopped catching up (a stopped or wedged process).

The order of the words is what makes it safe: the node writes the grant before the version, and
a client reads the version before the grants (x86 keeps both orders), so a client that read
version v also sees every release up to v, and a client that saw a grant listed read a version
below its release.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from cluster.core.tiers.aligned import round_up
from cluster.core.tiers.shm import SharedFile

log = logging.getLogger("raykv.tiers")

MAGIC = 0x3173_7264_7276_6B72  # "rkvrdrs1", little-endian
HEADER_WORDS = 4  # magic, layout version, num_chunks, num_slots
SLOT_WORDS = 4
_PID, _NAMESPACE, _START, _CAUGHT_UP = range(SLOT_WORDS)
_VERSION = 1
MAX_READERS = 1024  # client slots per arena: a Serve replica or vLLM worker takes one per pool
POLL_S = 0.25  # how often a client looks for releases with no call
# How long a retired chunk waits for clients that do not catch up (another PID namespace, or a
# stopped process) before it is freed anyway, with a warning.
RETIRED_CHUNK_MAX_S = float(os.environ.get("RAYKV_RETIRED_CHUNK_MAX_S", "600"))


class _Table:
    """The words of a readers file, as numpy views of one mapping of it."""

    def __init__(self, mapping: mmap.mmap):
        words = np.frombuffer(mapping, dtype=np.uint64)
        if len(words) < HEADER_WORDS or int(words[0]) != MAGIC:
            raise ValueError("not a raykv readers file")
        self.header = words[:HEADER_WORDS]
        num_chunks, num_slots = int(self.header[2]), int(self.header[3])
        if len(words) < HEADER_WORDS + num_chunks + num_slots * SLOT_WORDS:
            raise ValueError("a readers file shorter than its header says")
        self.grants = words[HEADER_WORDS : HEADER_WORDS + num_chunks]
        slots = words[HEADER_WORDS + num_chunks :][: num_slots * SLOT_WORDS]
        self.slots = slots.reshape(num_slots, SLOT_WORDS)

    @property
    def version(self) -> int:
        return int(self.header[_VERSION])


@contextlib.contextmanager
def _flock(fd: int, blocking: bool = True) -> Iterator[bool]:
    """Hold the file's lock (taking and clearing slots); yields False where not blocking and
    another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        yield False
        return
    try:
        yield True
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def pid_namespace() -> int:
    """This process's PID namespace (the inode of /proc/self/ns/pid); 0 where unreadable."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) of a process; None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
        fields = text[text.rindex(b")") + 2 :].split()  # after "pid (comm) "
        return fields[0].decode(), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def is_alive(pid: int, start_ticks: int) -> bool:
    """Whether process `pid` of this PID namespace runs and is the one that started at
    `start_ticks` (0: not known), not a zombie nor a later process given the same pid."""
    if not 0 < pid < 1 << 31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    stat = _proc_stat(pid)
    if stat is None:
        return True
    state, started = stat
    return state not in ("Z", "X") and (not start_ticks or started == start_ticks)


# ---- the node's side -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reader:
    """A client's slot as the node reads it."""

    pid: int
    caught_up: int
    checked: bool  # False: another PID namespace, whose liveness the node cannot check


class NodeReaders:
    """The node's side of an arena's readers file: it publishes the layout and reads the
    clients' slots."""

    def __init__(self, name: str, num_chunks: int, num_slots: int = MAX_READERS):
        num_words = HEADER_WORDS + num_chunks + num_slots * SLOT_WORDS
        self.file = SharedFile(name, round_up(num_words * 8), populate=False)
        self.path = self.file.path
        header = np.frombuffer(self.file.mmap, dtype=np.uint64)[:HEADER_WORDS]
        header[:] = (MAGIC, 0, num_chunks, num_slots)
        self.table = _Table(self.file.mmap)
        self.namespace = pid_namespace()
        self._fd = os.open(self.path, os.O_RDWR)

    def publish(self, version: int, chunk: int, grant: int) -> None:
        """Chunk `chunk` now holds `grant` (0: none), as of layout `version`."""
        self.table.grants[chunk] = grant  # first: a client that reads the version sees it
        self.table.header[_VERSION] = version

    def withdraw_all(self, version: int) -> None:
        """No chunk is held any more (the arena closes)."""
        self.table.grants[:] = 0
        self.table.header[_VERSION] = version

    def live_readers(self) -> list[Reader]:
        """Every taken slot but those of dead processes, which are cleared."""
        readers, dead = [], []
        for index in np.flatnonzero(self.table.slots[:, _PID]).tolist():
            pid, namespace, start, caught_up = (int(word) for word in self.table.slots[index])
            checked = self.namespace != 0 and namespace == self.namespace
            if checked and not is_alive(pid, start):
                dead.append((index, pid))
            else:
                readers.append(Reader(pid, caught_up, checked))
        self._clear(dead)
        return readers

    def _clear(self, dead: list[tuple[int, int]]) -> None:
        if not dead:
            return
        with _flock(self._fd, blocking=False) as locked:
            if not locked:  # a client is taking a slot: the next reap clears these
                return
            for index, pid in dead:
                if int(self.table.slots[index, _PID]) == pid:
                    self.table.slots[index] = 0
                    log.debug("cleared the readers slot of process %d, gone", pid)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.file.close()


@dataclass(slots=True, eq=False)
class _Retired:
    held: object
    nbytes: int
    version: int  # the layout version right after its release
    since_s: float


class RetiredChunks:
    """Released chunks whose memory waits until no live client can still map them."""

    def __init__(self, readers: NodeReaders, max_s: float = RETIRED_CHUNK_MAX_S):
        self.readers = readers
        self.max_s = max_s
        self._lock = threading.Lock()
        self._waiting: list[_Retired] = []
        self.retired_bytes = 0

    def add(self, held: object, nbytes: int, version: int, now_s: float) -> None:
        with self._lock:
            self._waiting.append(_Retired(held, nbytes, version, now_s))
            self.retired_bytes += nbytes

    def due(self, now_s: float) -> list:
        """Take out, to be freed, the retired chunks every live client has caught up past,
        and those that waited max_s (logged)."""
        with self._lock:
            waiting = list(self._waiting)
        if not waiting:
            return []
        readers = self.readers.live_readers()
        due = [one for one in waiting if self._may_free(one, readers, now_s)]
        with self._lock:
            for one in due:
                self._waiting.remove(one)
                self.retired_bytes -= one.nbytes
        return [one.held for one in due]

    def _may_free(self, retired: _Retired, readers: list[Reader], now_s: float) -> bool:
        behind = [reader for reader in readers if reader.caught_up < retired.version]
        if not behind:
            return True
        waited_s = now_s - retired.since_s
        if waited_s < self.max_s:
            return False
        unchecked = sum(not reader.checked for reader in behind)
        log.warning("a released device chunk (%d bytes) waited %.0f s for %d client(s) to "
                    "close their mappings (pids %s; %d in another PID namespace, not checkable);"
                    " freeing it anyway (retired_chunk_max_s)", retired.nbytes, waited_s,
                    len(behind), [reader.pid for reader in behind][:8], unchecked)
        return True

    def take_all(self) -> list:
        """Every retired chunk, to be freed now (the arena closes)."""
        with self._lock:
            taken, self._waiting, self.retired_bytes = self._waiting, [], 0
        return [one.held for one in taken]


# ---- a client's side -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Listing:
    """The table as a client read it: the layout version, then each chunk's grant."""

    version: int
    grants: np.ndarray

    def lists(self, chunk: int, grant: int) -> bool:
        return 0 <= chunk < len(self.grants) and int(self.grants[chunk]) == grant


@dataclass(slots=True, eq=False)
class _Opened:
    """A mapping this client opened, and the newest version at which the node listed it."""

    chunk: int
    grant: int
    is_open: Callable[[], bool]
    listed_at: int


def open_while_alive(resource: object) -> Callable[[], bool]:
    """An is_open for a mapping that closes when `resource` is collected (a shm mapping)."""
    ref = weakref.ref(resource)
    return lambda: ref() is not None


class ReaderSlot:
    """A client's slot in an arena's readers file. `follow(on_listing)` hands it to this
    process's poller, which calls `on_listing(listing)` (the owner drops its mappings of
    grants no longer listed) and then catches the slot up, every POLL_S, with no call."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_RDWR)
        try:
            self.table = _Table(mmap.mmap(self._fd, os.fstat(self._fd).st_size))
            self.index = self._take_slot()
        except BaseException:
            os.close(self._fd)
            raise
        self.lock = threading.Lock()  # the owner's too: its mappings change under it
        self._owner: weakref.WeakMethod | None = None
        self._opened: list[_Opened] = []
        self._seen = self.caught_up = int(self.table.slots[self.index, _CAUGHT_UP])
        self.closed = False
        self.poll_failures = 0

    @classmethod
    def open(cls, path: str | None) -> ReaderSlot | None:
        """A slot in the readers file at `path`; None where it cannot be had (no file, a
        full table): the caller then maps nothing, and its reads miss."""
        if path is None:
            return None
        try:
            return cls(path)
        except (OSError, ValueError) as error:
            log.warning("no slot in the device tier's readers file %s (its chunks are not "
                        "mapped here, their pages miss): %s", path, error)
            return None

    def _take_slot(self) -> int:
        with _flock(self._fd):
            index = self._free_slot()
            stat = _proc_stat(os.getpid())
            row = self.table.slots[index]
            row[_NAMESPACE], row[_START] = pid_namespace(), stat[1] if stat else 0
            row[_CAUGHT_UP] = self.table.version  # nothing mapped yet: caught up to now
            row[_PID] = os.getpid()  # last: the slot is taken
            return index

    def _free_slot(self) -> int:
        """A slot never taken or given back, else one of a dead process of this PID
        namespace (the node clears those only while chunks are retired)."""
        free = np.flatnonzero(self.table.slots[:, _PID] == 0)
        if len(free):
            return int(free[0])
        namespace = pid_namespace()
        for index, (pid, their_namespace, start, _) in enumerate(self.table.slots.tolist()):
            if namespace and their_namespace == namespace and not is_alive(pid, start):
                return index
        raise ValueError(f"all {len(self.table.slots)} client slots are taken")

    def follow(self, on_listing: Callable) -> None:
        """Have this process's poller catch the slot up; `on_listing` is a bound method of
        the owner (held weakly: an owner gone leaves the slot until its mappings close)."""
        self._owner = weakref.WeakMethod(on_listing)
        _poller.watch(self)

    def listing(self) -> Listing:
        """Read the table (under `lock`): the version first, then the grants."""
        version = self.table.version
        self._seen = version
        return Listing(version, self.table.grants.copy())

    def track(self, chunk: int, grant: int, is_open: Callable[[], bool]) -> None:
        """Note a mapping opened (under `lock`) after the latest listing listed its grant."""
        self._opened.append(_Opened(chunk, grant, is_open, self._seen))

    def catch_up(self, listing: Listing) -> int:
        """Write (under `lock`) the newest version this client is caught up to: the
        listing's, or just below the release of a grant it still maps."""
        self._opened = [one for one in self._opened if one.is_open()]
        caught_up = listing.version
        for one in self._opened:
            if listing.lists(one.chunk, one.grant):
                one.listed_at = listing.version
            else:  # released since it was listed at listed_at: not caught up past that
                caught_up = min(caught_up, one.listed_at)
        if not self.closed:
            self.table.slots[self.index, _CAUGHT_UP] = caught_up
        self.caught_up = caught_up
        return caught_up

    def poll(self) -> bool:
        """What the poller does: drop what the node no longer lists, catch up; False once
        the slot is done (its owner gone, its mappings closed) and cleared."""
        with self.lock:
            if self.closed:
                return False
            on_listing = self._owner() if self._owner is not None else None
            if (on_listing is not None and self.table.version == self._seen
                    and self.caught_up == self._seen):
                return True  # nothing released since, nothing waiting to close
            listing = self.listing()
            if on_listing is not None:
                on_listing(listing)
            self.catch_up(listing)
            if on_listing is None and not self._opened:
                self.close()
                return False
        return True

    def close(self) -> None:
        """Give the slot back (its owner and mappings are gone)."""
        if self.closed:
            return
        self.closed = True
        try:
            with _flock(self._fd):
                if int(self.table.slots[self.index, _PID]) == os.getpid():
                    self.table.slots[self.index] = 0
        finally:
            os.close(self._fd)


class _Poller:
    """One thread per process that polls its slots every POLL_S; it ends when none is left
    and starts again with the next (and after a fork, where the thread is gone)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._slots: set[ReaderSlot] = set()
        self._thread: threading.Thread | None = None

    def watch(self, slot: ReaderSlot) -> None:
        with self._lock:
            self._slots.add(slot)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="raykv-chunk-readers",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            with self._lock:
                slots = list(self._slots)
                if not slots:
                    self._thread = None
                    return
            for slot in slots:
                if not _poll_safely(slot):
                    with self._lock:
                        self._slots.discard(slot)


def _poll_safely(slot: ReaderSlot) -> bool:
    try:
        return slot.poll()
    except Exception as error:  # never the thread's end: the slot just stays behind (safe)
        slot.poll_failures += 1
        (log.warning if slot.poll_failures == 1 else log.debug)(
            "catching up a device tier's readers slot failed (%d so far): %s",
            slot.poll_failures, error)
        return True


_poller = _Poller()
