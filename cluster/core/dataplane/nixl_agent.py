"""This process's NIXL agent (UCX underneath), loaded only if NIXL installs and starts here.

    shared_agent()  -> NixlAgent | None     one per process, made in the background; None
                                            until then, and when NIXL is absent or its backend
                                            will not start (then TCP carries the pages)
    agent.push(offer, pages, deadline_s)    write pinned pages into a reader's staging buffer
    agent.staging   StagingPool             registered host buffers this process reads into

Only the owner moves bytes (a NIXL WRITE into the reader's buffer): the owner registers the
pages it pinned for one request, writes them, and deregisters them before it unpins. It never
hands out a descriptor or a remote key of its own memory, so a reader can get only the bytes
its authenticated, namespace-checked request was given (docs/dataplane.md, "NIXL").
UCX picks the wire: RDMA (GPUDirect for VRAM pages where the NIC and driver allow it), shared
memory between processes of one host, or TCP.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger("raykv.dataplane")
BACKEND = "UCX"
STAGING_BYTES = 16 << 20  # one staging buffer; a larger read goes in several rounds
MAX_STAGING_BUFFERS = 8  # per process; past it a read goes over TCP
QUARANTINE_S = 300.0  # a staging buffer whose exchange broke is not reused before this
MAX_REMOTE_AGENTS = 256  # readers whose metadata an owner keeps loaded
POLL_FIRST_S, POLL_MAX_S = 20e-6, 1e-3
# The packages that carry NIXL's Python API: the meta package (it picks the CUDA build that
# matches torch), then the builds themselves (a CPU-only install has just one of them).
NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


class NixlError(RuntimeError):
    """A NIXL transfer that failed or did not finish in time (the pages then go over TCP)."""


def load_api():
    """NIXL's Python API module; ImportError naming what was tried when none imports."""
    errors = []
    for name in NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as error:  # absent, or its native libraries do not load here
            errors.append(f"{name}: {error}")
            continue
        logging.getLogger("nixl").setLevel(logging.WARNING)  # it logs every agent at INFO
        return module
    raise ImportError("NIXL is not installed (pip install nixl-cu12): " + "; ".join(errors))


@dataclass(frozen=True, slots=True)
class Offer:
    """Where a reader wants pages written: its agent's metadata (connection info and this
    buffer's registration only) and the buffer (address, length) in its memory."""

    metadata: bytes
    address: int
    length_bytes: int


class Staging:
    """A registered host buffer that owners write pages into; the reader copies them out."""

    def __init__(self, agent: NixlAgent, length_bytes: int):
        self.tensor = torch.zeros(length_bytes, dtype=torch.uint8)  # zeroed: touched
        self.view = memoryview(self.tensor.numpy())
        self._agent = agent
        region = [(self.tensor.data_ptr(), length_bytes, 0, "")]
        self._registration = agent.api.register_memory(region, "DRAM", [BACKEND])
        metadata = agent.api.get_partial_agent_metadata(self._registration, True, [BACKEND])
        self.offer = Offer(metadata, self.tensor.data_ptr(), length_bytes)

    def close(self) -> None:
        self._agent.api.deregister_memory(self._registration, [BACKEND])


class StagingPool:
    """Staging buffers, each used by one exchange at a time; made on demand up to a bound."""

    def __init__(self, agent: NixlAgent):
        self._agent = agent
        self._free: list[Staging] = []
        self._quarantined: list[tuple[float, Staging]] = []
        self._count = 0
        self._lock = threading.Lock()

    def take(self, min_bytes: int) -> Staging | None:
        """A free buffer of at least min_bytes, or a new one; None past the bound."""
        with self._lock:
            self._reclaim()
            for index, staging in enumerate(self._free):
                if staging.offer.length_bytes >= min_bytes:
                    return self._free.pop(index)
            if self._count >= MAX_STAGING_BUFFERS:
                return None
            self._count += 1
        try:
            return Staging(self._agent, max(STAGING_BYTES, min_bytes))
        except Exception:
            with self._lock:
                self._count -= 1
            raise

    def give(self, staging: Staging) -> None:
        with self._lock:
            self._free.append(staging)

    def quarantine(self, staging: Staging) -> None:
        """Hold this buffer back: a write into it may still land (its exchange broke). It
        stays allocated and registered, and comes back after QUARANTINE_S, far past any
        owner's deadline for a write (half its call timeout), after which it cancels it."""
        with self._lock:
            self._quarantined.append((time.monotonic() + QUARANTINE_S, staging))
        self._agent.counters["quarantined_buffers"] += 1

    def _reclaim(self) -> None:
        now_s = time.monotonic()
        self._free += [staging for until_s, staging in self._quarantined if until_s <= now_s]
        self._quarantined = [(until_s, staging) for until_s, staging in self._quarantined
                             if until_s > now_s]

    def close(self) -> None:
        """Deregister the free buffers (those in use are dropped when given back later)."""
        with self._lock:
            free, self._free = self._free, []
            self._count -= len(free)
        for staging in free:
            staging.close()


class NixlAgent:
    """One NIXL agent: pushes pages to readers (owner side) and owns the staging buffers
    owners push into (reader side)."""

    def __init__(self, api_module=None):
        module = load_api() if api_module is None else api_module
        # No progress thread: NIXL's polls without pause (a core per process, idle or not).
        # An owner progresses while it waits for its write, a reader while it waits for the
        # reply (progress()); UCX needs both ends to, over TCP and to connect.
        config = module.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[BACKEND],
            sync_mode=module.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
        self.name = f"raykv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.api = module.nixl_agent(self.name, config)
        if BACKEND not in self.api.backends:
            raise NixlError(f"NIXL's {BACKEND} backend did not start")
        self.staging = StagingPool(self)
        self._remotes: OrderedDict[bytes, None] = OrderedDict()
        self._remotes_lock = threading.Lock()
        self.counters = {"pushes": 0, "pushed_bytes": 0, "push_failures": 0,
                         "tcp_fallback_pages": 0, "quarantined_buffers": 0}

    def push(self, offer: Offer, pages: list[torch.Tensor], deadline_s: float) -> None:
        """Write pages[i] to offer.address + i * page bytes and wait until it is done;
        NixlError (or the backend's own error) when it fails or passes the deadline. Pages in
        host memory and in VRAM (a prefix across tiers) go as one write per memory type."""
        page_bytes = pages[0].numel()
        if len(pages) * page_bytes > offer.length_bytes:
            raise NixlError(f"{len(pages)} pages do not fit a {offer.length_bytes}-byte buffer")
        remote = self._remote(offer.metadata)
        registered, handles = [], []
        try:
            for mem_type, indices in _by_mem_type(pages).items():
                group = [pages[i] for i in indices]
                registered.append(self.api.register_memory(_regions(group), mem_type,
                                                            [BACKEND]))
                local = self.api.get_xfer_descs(_descriptors(group), mem_type)
                targets = [(offer.address + i * page_bytes, page_bytes, 0) for i in indices]
                handle = self.api.initialize_xfer("WRITE", local, self.api.get_xfer_descs(
                    targets, "DRAM"), remote, b"", [BACKEND])
                handles.append((handle, self.api.transfer(handle)))
            for handle, state in handles:
                self._wait(handle, state, deadline_s)
            self.counters["pushes"] += 1
            self.counters["pushed_bytes"] += len(pages) * page_bytes
        except Exception:
            self.counters["push_failures"] += 1
            raise
        finally:
            for handle, _ in handles:
                _release(handle)
            for registration in registered:
                self.api.deregister_memory(registration, [BACKEND])

    def progress(self) -> None:
        """Let UCX move what waits on this end (a connection being set up, TCP's bytes)."""
        self.api.get_new_notifs()

    def _remote(self, metadata: bytes) -> str:
        """Load a reader's metadata (again: it grows with its staging buffers); its name."""
        with self._remotes_lock:
            name = self.api.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            self._remotes[name] = None
            self._remotes.move_to_end(name)
            stale = []
            while len(self._remotes) > MAX_REMOTE_AGENTS:
                stale.append(self._remotes.popitem(last=False)[0])
        for old in stale:
            try:
                self.api.remove_remote_agent(old)
            except Exception as error:  # already gone: nothing to drop
                log.debug("NIXL: dropping reader %s: %s", old, error)
        return name

    def _wait(self, handle, state: str, deadline_s: float) -> None:
        pause_s = POLL_FIRST_S
        while state == "PROC":
            if time.monotonic() > deadline_s:
                raise NixlError("NIXL write past its deadline")
            time.sleep(pause_s)
            pause_s = min(pause_s * 2, POLL_MAX_S)
            state = self.api.check_xfer_state(handle)
        if state != "DONE":
            raise NixlError(f"NIXL write ended in state {state}")

    def close(self) -> None:
        self.staging.close()


def _by_mem_type(pages: list[torch.Tensor]) -> dict[str, list[int]]:
    """Page indices by NIXL memory type: DRAM for host memory, VRAM for a GPU's."""
    groups: dict[str, list[int]] = {}
    for index, page in enumerate(pages):
        groups.setdefault("VRAM" if page.is_cuda else "DRAM", []).append(index)
    return groups


def _device(page: torch.Tensor) -> int:
    return (page.device.index or 0) if page.is_cuda else 0


def _descriptors(pages: list[torch.Tensor]) -> np.ndarray:
    return np.array([(page.data_ptr(), page.numel(), _device(page)) for page in pages],
                    dtype=np.uint64)


def _regions(pages: list[torch.Tensor]) -> list[tuple[int, int, int, str]]:
    """The pages' memory as few regions as possible: adjacent slots merge into one."""
    spans = sorted((page.data_ptr(), page.numel(), _device(page)) for page in pages)
    merged: list[list[int]] = []
    for start, length, device in spans:
        last = merged[-1] if merged else None
        if last is not None and last[2] == device and last[0] + last[1] >= start:
            last[1] = max(last[1], start + length - last[0])
        else:
            merged.append([start, length, device])
    return [(start, length, device, "") for start, length, device in merged]


def _release(handle) -> None:
    if handle is None:
        return
    try:
        handle.release()
    except Exception as error:  # NIXL keeps it in its leak list and retries at teardown
        log.warning("NIXL: releasing a transfer handle failed: %s", error)


PROBE_TIMEOUT_S = 60.0
PROBE = ("from cluster.core.dataplane.nixl_agent import NixlAgent; NixlAgent(); "
         "print('NIXL-OK', flush=True)")


def probe() -> str | None:
    """Start an agent in a child process first: None when it starts, else why not. A NIXL
    whose UCX backend fails to start crashes its process at exit (SIGSEGV in NIXL 1.5.1's
    teardown), so a process makes its own agent only once a child has made one."""
    import subprocess
    import sys

    path = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [path, *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"the NIXL probe did not run: {error}"
    if "NIXL-OK" in done.stdout:
        return None
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return (lines[-1] if lines else f"the NIXL probe exited with {done.returncode}")[-500:]


_shared: NixlAgent | None = None
_shared_error: str | None = None
_shared_lock = threading.Lock()
_started = threading.Event()
_ready = threading.Event()


def start_agent() -> None:
    """Make this process's agent in the background (probe first); idempotent."""
    with _shared_lock:
        if _started.is_set():
            return
        _started.set()
    threading.Thread(target=_make_agent, name="raykv-nixl-start", daemon=True).start()


def _make_agent() -> None:
    global _shared, _shared_error
    try:
        load_api()
        reason = probe()
        if reason is not None:
            raise NixlError(reason)
        agent = NixlAgent()
    except Exception as error:  # absent package, no UCX transport, a broken install
        _shared_error = f"{type(error).__name__}: {error}"
        log.warning("NIXL unavailable here, pages go over TCP: %s", _shared_error)
    else:
        _shared = agent
    finally:
        _ready.set()


def shared_agent(wait_s: float = 0.0) -> NixlAgent | None:
    """This process's agent: None while it is being made (waiting up to wait_s for it) and
    when NIXL cannot run here (logged once; then TCP carries every page)."""
    start_agent()
    _ready.wait(wait_s)
    return _shared


def unavailable_reason() -> str | None:
    """Why shared_agent() is None, once it was tried."""
    return _shared_error
