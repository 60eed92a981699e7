"""Which CPUs raykv's own threads run on, in a process whose host pinned its thread to compute
cores.

vLLM's CPU build binds each worker's main thread to its OpenMP cores (vllm/utils/
ompmultiprocessing.py, VLLM_CPU_OMP_THREADS_BIND): by default all cores but those it reserves,
one for the engine's scheduler and, with a KV connector configured, one more "for the
connector". Linux threads inherit their creator's CPU mask, so every thread the connector
started in that worker ran on the compute cores: its loader and saver, the client's committer,
touch sender and copy threads, and Ray's own (started at ray.init from a thread of the same
mask). On a 2-core machine with vLLM's default reservation every engine's worker is bound to
core 0, and raykv's saves (their copies, hashes and calls) took their time from the forward
of every engine there while core 1 sat mostly idle (docs/benchmarks.md, vllm-serve).

So a process that knows its compute cores (`spare_cpus`: what its parent may use and the
calling thread may not) names the rest with `run_threads_on`; from then on each raykv thread
moves there as it starts (`follow`, the first thing a raykv thread or pool worker does), and
`widened()` puts the calling thread there for a block, so that threads a library starts
inside it (Ray's, at ray.init) inherit them. Nothing changes where no CPUs were named: a GPU
worker, or any process that vLLM did not bind.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

log = logging.getLogger("raykv")
_named: frozenset[int] | None = None  # run_threads_on's CPUs; None: leave threads where they are


def spare_cpus(parent_cpus: set[int] | None = None,
               thread_cpus: set[int] | None = None) -> frozenset[int]:
    """The CPUs this process's parent may run on and the calling thread may not (empty when
    the calling thread is not pinned to fewer). Defaults: the parent's and the calling
    thread's masks (an unreadable parent: nothing spare)."""
    if thread_cpus is None:
        thread_cpus = os.sched_getaffinity(0)
    if parent_cpus is None:
        try:
            parent_cpus = os.sched_getaffinity(os.getppid())
        except OSError:
            return frozenset()
    return frozenset(parent_cpus) - frozenset(thread_cpus)


def run_threads_on(cpus: frozenset[int] | set[int]) -> None:
    """Every raykv thread that starts from now on (in this process) runs on `cpus`; empty:
    threads stay where they start."""
    global _named
    _named = frozenset(cpus) or None
    if _named:
        log.info("raykv threads run on CPUs %s", sorted(_named))


def named_cpus() -> frozenset[int] | None:
    """The CPUs run_threads_on named, or None."""
    return _named


def follow() -> None:
    """Move the calling thread to the named CPUs, if any (a raykv thread's first step)."""
    if _named:
        _set(_named)


def thread_pool(num_threads: int, name: str) -> ThreadPoolExecutor:
    """A pool of raykv threads (named `name`_N): each follows the named CPUs as it starts."""
    return ThreadPoolExecutor(num_threads, thread_name_prefix=name, initializer=follow)


@contextmanager
def widened() -> Iterator[None]:
    """The calling thread on the named CPUs inside the block (threads started inside it
    inherit them), and back on its own after."""
    if not _named:
        yield
        return
    own = os.sched_getaffinity(0)
    _set(_named)
    try:
        yield
    finally:
        _set(own)


def _set(cpus: frozenset[int] | set[int]) -> None:
    try:
        os.sched_setaffinity(0, cpus)  # 0: the calling thread (a Linux thread's own mask)
    except OSError as error:  # a CPU taken away since: stay where we are
        log.warning("could not move a raykv thread to CPUs %s: %s", sorted(cpus), error)
