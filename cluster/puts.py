"""Leased puts: a put with no call on its path (cluster/core/put_leases.py has the rules).

    put (caller's thread)                       committer (one thread per client)
    take(n) leased slots      no call           wake on a write (COMMIT_AFTER_S after it), a
    fenced copy into them,                      shortage, a lease near its end, a read of
      their locks kept                          this client's own writes (at once)
    wrote(keys, slots), wake  ------------->    node.put_leased(commit the writes, lease more)
    return                                      unlock the written slots; map and pre-fault the
                                                new ones (at a lower CPU priority: the puts'
                                                copies go first); note the committed pages
                                                (hints); wake readers

Writes made while a call is in flight go in the next one: a burst of puts costs one call per
round trip, none on the puts' path. A write's commit waits COMMIT_AFTER_S before it is sent:
sent at once, the call's Python (~0.5 to 0.9 ms here) took the interpreter lock from the put
that had just handed the write over, before that put returned; a moment later it runs
beside what the caller does next (the next put's copy releases the lock), and writes made
meanwhile join it. A put that finds too few leased slots (the first one, or
one larger than the lease) reserves and commits through the node as before (cluster/client.py),
and the committer leases more for the next.

Read-your-writes: a get, lookup or prefetch of this client first waits for its own writes'
commit (`settle`), so it sees them; other clients see them once the commit lands, within
one call's round trip of the put.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from cluster.calls import Steps, Wait, failed, run_sync
from cluster.core import cpu_sets
from cluster.core.geometry import HOST
from cluster.core.lease_pool import LeasePool
from cluster.core.put_leases import LeaseRequest
from cluster.touches import Gate, ungated
from cluster.view import CacheView

log = logging.getLogger("raykv.client")
RETRY_AFTER_S = (0.5, 30.0)  # after failed calls, before the next top-up: doubling, capped
# After an answer short of slots (the node readies chunks ahead after each call, in tens of
# ms): asked again after these, doubling, capped; a full answer starts over.
SHORT_RETRY_S = (0.05, 30.0)
MIN_LEASED_PAGES = 4
COMMIT_AFTER_S = 0.001  # a write's commit is sent this long after it (see above)


class LeasedPuts:
    """One client's slot lease and its committer thread."""

    def __init__(self, view: CacheView, lease_bytes: int, lease_s: float,
                 wait: Callable[[Steps, float], object] = run_sync, gate: Gate | None = None):
        """`wait` drives the committer's calls (run_sync; unit tests drive fakes); `gate`
        (ray_gate.background_call for a client of a live service; None: always open) keeps
        them out of ray.shutdown()'s way."""
        self.view = view
        self._wait = wait
        self._gate = gate or ungated
        page_bytes = view.geometry.slot_bytes
        max_pages = lease_bytes // page_bytes
        self.pool = LeasePool(min(MIN_LEASED_PAGES, max_pages), max_pages, lease_s / 4)
        self.tier: int | None = None  # None: the node's top tier; HOST once VRAM was unmapped
        self._cond = threading.Condition()
        self._written = 0  # pages handed to the committer, and those it has answered for
        self._answered = 0
        self._retry_at_s = 0.0
        self._retry_s = RETRY_AFTER_S[0]
        self._short_retry_s = SHORT_RETRY_S[0]  # after answers short of slots: doubling
        self._thread: threading.Thread | None = None
        self._wrote_s = 0.0  # when the first write not yet sent was handed over
        self._urgent = False  # a read of this client's own writes waits: commit them now
        # The last call's steps, in s (what bench tiers reports as the commit + top-up):
        # wake (first write handed over -> call sent), round_trip (sent -> answered; the
        # node's commit and top-up inside it), map (the new slots mapped: a descriptors call
        # when the node granted a chunk), answer (notes, lease accounting, readers woken).
        self.last_call_s: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        return self.pool.max_pages > 0

    def take(self, count: int) -> np.ndarray | None:
        """`count` leased slots (an int64 [count, 3] slot table), or None (reserve instead,
        and the committer tops the lease up now). Slots taken are topped up with their
        commit, after the copy: a call started now would contend with the copy for the GIL."""
        with self._cond:
            places = self.pool.take(count, time.monotonic())
            if places is None:
                self._wake()
        return places

    def wrote(self, keys: list, places: np.ndarray) -> None:
        """These keys were copied into these taken slots: commit them in the next call."""
        with self._cond:
            if not self.pool.num_written():
                self._wrote_s = time.perf_counter()
            self.pool.wrote(keys, places)
            self._written += len(keys)
            self._wake()

    def give_back(self, places: np.ndarray) -> None:
        """Taken slots that were not written after all (nothing reached them that counts)."""
        with self._cond:
            self.pool.give_back(places)

    def unsettled(self) -> bool:
        """Whether some write of this client still waits for its commit's answer."""
        with self._cond:
            return self._answered < self._written

    def fenced_off(self, places: np.ndarray) -> None:
        """A copy into the taken slots `places` was refused by their fence: the node took
        some of them back (revoked, or the whole lease lapsed). Those whose generation still
        holds are free again; of the rest, and of the lease's free slots, only the moved
        ones are dropped."""
        slabs = self.view.slabs
        with self._cond:
            self.pool.give_back(places)
            self.pool.keep_free(slabs.unchanged(self.pool.free))
            self._wake()

    def settle(self, timeout_s: float) -> bool:
        """Wait until every write so far has been answered for (committed or refused);
        False on timeout."""
        with self._cond:
            target = self._written
            if self._answered >= target:
                return True
            self._urgent = self.pool.num_written() > 0  # unsent writes: no COMMIT_AFTER_S
            self._wake()
            return self._cond.wait_for(lambda: self._answered >= target, timeout_s)

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="raykv-commit", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _wait_s(self) -> float | None:
        """How long the committer waits before its next call: 0 when one is due now (writes
        COMMIT_AFTER_S old, or awaited by a read; a lease to top up or renew, past any
        retry back-off), None when nothing will be due until a put or a read wakes it."""
        if self.pool.num_written():
            if self._urgent:
                return 0.0
            return max(self._wrote_s + COMMIT_AFTER_S - time.perf_counter(), 0.0)
        now_s = time.monotonic()
        if self.pool.needs_call(now_s):
            return max(self._retry_at_s - now_s, 0.0)
        return None

    def _run(self) -> None:
        cpu_sets.follow()
        while True:
            with self._cond:
                while (wait_s := self._wait_s()) != 0.0:
                    self._cond.wait(wait_s)
                self._urgent = False
                wake_s = time.perf_counter() - self._wrote_s if self.pool.num_written() else 0.0
                want = self.pool.top_up()  # before the writes are taken: they count
                written = self.pool.take_written()
                slots = tuple(map(tuple, written[1].tolist()))  # (tier, slot, generation)
                request = LeaseRequest(self.pool.lease_id, tuple(written[0]), slots,
                                       want, self.view.namespace, self.tier)
            self.last_call_s = {"wake": wake_s}
            try:
                with self._gate() as allowed:
                    if not allowed:  # Ray is gone or going: the writes are a miss
                        self._answer(request, written, None, time.monotonic())
                        return
                    if not self._call(request, written):
                        return  # this process left Ray: nothing to commit to any more
            except Exception:  # Ray torn down under the call: its pages are a miss
                log.exception("a leased-put call raised")
                self._answer(request, written, None, time.monotonic())

    def _call(self, request: LeaseRequest, written: tuple[list, np.ndarray]) -> bool:
        """One leased-put call and what its answer means here; False once Ray is gone."""
        view, sent_s, start_s = self.view, time.monotonic(), time.perf_counter()
        ref = view.home.put_leased(view.geometry, request)
        if ref is None:
            self._answer(request, written, None, sent_s)
            return False
        reply = self._wait(_one(ref), view.call_timeout_s)
        self.last_call_s["round_trip"] = time.perf_counter() - start_s
        if not failed(reply):
            self.last_call_s["node_commit"], self.last_call_s["node_top_up"] = reply[1].node_s
        if failed(reply):
            view.note_failures([reply])
            # Pages lost are worth a warning; a lease top-up that failed (no pages: a client
            # whose node is gone retries with back-off) only at debug, or it repeats for ever.
            log.log(logging.WARNING if request.keys else logging.DEBUG,
                    "a leased-put call failed (its %d pages are a miss): %s",
                    len(request.keys), reply)
        self._answer(request, written, None if failed(reply) else reply, sent_s)
        return True

    def _answer(self, request: LeaseRequest, written: tuple[list, np.ndarray], reply,
                sent_s: float) -> None:
        """Apply a call's answer (None: it failed, and its writes are a miss)."""
        start_s = time.perf_counter()
        # Answered for: the written slots are indexed (or refused), so their locks go; until
        # now they kept a node short of room from revoking them (put_leases.PutLeases.revoke).
        self.view.slabs.unlock_places(written[1])
        places = self._map(*reply) if reply is not None else None
        mapped_s = time.perf_counter()
        if reply is not None and any(reply[1].committed):
            done = np.asarray(reply[1].committed, dtype=bool)
            self.view.slabs.remember([k for k, ok in zip(written[0], done, strict=True) if ok],
                                     written[1][done])  # a later get reads them directly
        with self._cond:
            if reply is None:  # a dead node, or a late answer: the lease may be gone
                self._retry_at_s = time.monotonic() + self._retry_s
                self._retry_s = min(2 * self._retry_s, RETRY_AFTER_S[1])
                self.pool.lapsed()  # a fresh lease next (the old lapses)
            else:
                _, answer = reply
                self._retry_s = RETRY_AFTER_S[0]
                if len(answer.places) < request.want:  # the node is short: not again at once
                    self._retry_at_s = time.monotonic() + self._short_retry_s
                    self._short_retry_s = min(2 * self._short_retry_s, SHORT_RETRY_S[1])
                else:
                    self._short_retry_s = SHORT_RETRY_S[0]
                if places is None:  # not mappable here: that lease was given back
                    self.pool.lapsed()
                else:
                    self.pool.granted(answer.lease_id, places, sent_s, answer.lease_s,
                                      answer.revoked, request.want)
                self.view.counters["leased_pages"] += sum(answer.committed)
                self.view.counters["uncommitted_pages"] += (
                    len(answer.committed) - sum(answer.committed))
            self._answered += len(written[0])
            self.last_call_s["map"] = mapped_s - start_s
            self.last_call_s["answer"] = time.perf_counter() - mapped_s
            self._cond.notify_all()

    def _map(self, stamp, answer):
        """Map the newly leased slots (and fault their memory in here, off any put's path);
        their table, or None when they cannot all be mapped (a VRAM chunk on a GPU this
        process does not see: the lease goes back, and host slots are leased instead)."""
        slabs = self.view.slabs
        places = np.asarray(answer.places, dtype=np.int64).reshape(-1, 3)
        if not len(places):
            return places
        if self._wait(slabs.ensure(stamp), self.view.call_timeout_s):
            if slabs.fault_in(places) == len(places):
                return places
        self.view.home.end_put_lease(answer.lease_id)
        self.tier = HOST
        return None



def _one(ref) -> Steps:
    (reply,) = yield Wait([ref])
    return reply
