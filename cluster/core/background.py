"""Threads for work done ahead of need: memory chunks readied by the node (allocated and zeroed
by the kernel as they are faulted in) and faulted in by a client's mapping before the puts
that will copy into them.

That work is ~15x the copy it prepares (a fresh 64 MiB chunk: ~40 ms to fault in at the node
and ~16 ms more in a client's mapping, against ~4 ms to copy a put's pages in, on this 2-core
machine) and runs while the next puts copy. At the same CPU priority it takes a core from a
put's copy threads and the put slows by a third; at a lower one (Linux's nice is per thread)
it runs in the gaps between copies and yields to them. It still runs: an idle core, or the
share a lower priority gets under load (about a tenth at BACKGROUND_NICE against a busy core).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

BACKGROUND_NICE = 10


def lower_priority(nice: int = BACKGROUND_NICE) -> None:
    """Lower the calling thread's CPU priority to `nice` (never raise it: a process started
    nicer stays so); silently a no-op where that is not allowed or not per thread."""
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (AttributeError, OSError):  # not Linux, or refused: normal priority
        pass


def background_executor(name: str) -> ThreadPoolExecutor:
    """One thread at BACKGROUND_NICE, for work ahead of need."""
    return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=lower_priority)


_named: dict[str, ThreadPoolExecutor] = {}
_named_lock = threading.Lock()


def background_thread(name: str) -> ThreadPoolExecutor:
    """This process's one background_executor called `name`, made on first use (a kind of
    work ahead of need keeps to one thread, whoever asks for it)."""
    with _named_lock:
        if name not in _named:
            _named[name] = background_executor(name)
        return _named[name]
