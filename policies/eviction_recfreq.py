"""Recency with a bonus for reuse (policy "recfreq"): the queue that putdepth, raykv's
default (policies/eviction_putdepth.py), builds on."""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import islice, repeat
from operator import itemgetter

from policies.eviction_base import IsPinned, Key, PerKeyBatches, _check_capacity, _check_num_pages

Entry = tuple  # RecencyFrequencyPolicy: (priority, -call, key, uses, clock at the last use)
_KEY = itemgetter(2)  # an Entry's key

HORIZON_FACTOR = 2.0  # RecencyFrequencyPolicy: a reuse's bonus, in median reuse distances
MEDIAN_STEP = 0.01  # RecencyFrequencyPolicy: the running median's step, relative to it
GHOST_FACTOR = 4  # RecencyFrequencyPolicy: removed keys whose uses it remembers
MAX_USES = 16  # RecencyFrequencyPolicy: uses past this earn no more bonus
_LOG2_USES = [0.0] + [math.log2(uses) for uses in range(1, MAX_USES + 1)]


class RecencyFrequencyPolicy(PerKeyBatches):
    """Recency with a bonus for reuse: evict the key whose last use, pushed into the future by
    a bonus that grows with its number of uses, is oldest (in the manner of LRFU and GDSF).

        clock      +1 per new key: time counted in insertions
        priority   clock at the last use + horizon x log2(min(uses, MAX_USES)), never
                   lowered while held: a use that would not raise it (uses past MAX_USES at
                   the same tick, or a horizon shrunk since) keeps the key's priority and call
        victims    smallest priority first; on a tie the key ranked later goes first
        horizon    HORIZON_FACTOR x the median first-reuse distance: the clock's advance
                   between a key's first and second use (seen on access, or when a removed
                   key is put back), a running median; fixed for the accesses of one tick
        ghost      the uses and last use of the last GHOST_FACTOR x capacity removed keys: a
                   key put back keeps counting, as S3-FIFO's ghost queue remembers

    On a prefix cache most pages are written by one prompt and never read again; a page read
    by a second request (a conversation that went on, a shared system prompt) is likelier to
    be read again, and more so with each use. Such a page outlives a page used once by
    `horizon` insertions (twice that at four uses). The horizon follows the workload's own
    reuse distance rather than the cache's size: a bonus in multiples of the capacity that
    saves a small cache from one-time pages keeps stale pages too long in a large one. Only
    first reuses count: a shared prefix read by every request would pull the median to ~0.

    Pages are read root first, so a page's parent has at least its uses and, at each read of
    the page, a priority at least its own (ties go to the later call, the page's); a read
    never lowers a priority, so reading the parent alone later (when the horizon shrank, or
    at the use cap) keeps it after the page: of a prefix read again, the leaves leave before
    their ancestors. The new pages of one put leave root first, as under LRU.

    The queue: each key's live entry `(priority, -call, key, uses, clock at the last use)`,
    compared by its first two items (calls are unique, so the order is total), held in one
    of two places with lazy deletion:

        fifo   entries of no bonus (a first use: priority = the clock, which every insert
               advances), appended in increasing order: most pages of a host or disk tier,
               demoted there once and never read again. O(1) in, O(1) out.
        heap   every other entry: O(log n).

    victims() pops the smaller of the two heads: O(num_pages) plus the heap's logs and the
    pinned keys it skips; it changes no key's priority. A stale entry (its key used again or
    removed) is told by identity: `_rank` holds each key's live entry. The entries victims()
    popped wait aside until its next call, which puts back those still live (at the fifo's
    head when they rank before it, else into the heap): a victim that was removed
    meanwhile (the usual case) costs nothing more. When stale entries outnumber live ones
    (plus 64), both places are compacted.
    """

    horizon_factor = HORIZON_FACTOR

    def __init__(self, capacity_pages: int) -> None:
        _check_capacity(capacity_pages)
        self.reuse_distance = float(capacity_pages)  # a running median, until it has data
        self.horizon = self.horizon_factor * self.reuse_distance
        self.ghost_capacity_pages = max(1, int(GHOST_FACTOR * capacity_pages))
        self._clock = 0
        self._calls = 0
        self._rank: dict[Key, Entry] = {}  # key -> its live entry
        self._ghost: OrderedDict[Key, Entry] = OrderedDict()  # removed keys' last entries
        self._fifo: deque[Entry] = deque()  # first uses, in increasing order
        self._heap: list[Entry] = []  # the other entries
        self._parked: list[Entry] = []  # popped by victims(), in order, off both

    def _reused(self, last_use: int) -> None:
        """Move the running median of reuse distances one step towards this one."""
        distance = self._clock - last_use
        step = max(1.0, MEDIAN_STEP * self.reuse_distance)
        self.reuse_distance += step if distance > self.reuse_distance else -step
        self.reuse_distance = max(1.0, self.reuse_distance)

    def _touch(self, key: Key, held: Entry) -> None:
        """Rank key, whose live entry is `held`, for one more use: priority = clock + horizon
        x log2(uses), or held's priority and call where that is no higher (see on_access)."""
        clock, uses = self._clock, held[3] + 1
        self._calls = calls = self._calls + 1
        priority = clock + self.horizon * _LOG2_USES[uses if uses < MAX_USES else MAX_USES]
        if priority <= held[0]:  # past MAX_USES at held's tick, or a horizon shrunk since
            priority, calls = held[0], -held[1]
        # A second use or later earns a bonus: the heap (the fifo holds first uses only).
        entry = self._rank[key] = (priority, -calls, key, uses, clock)
        heapq.heappush(self._heap, entry)
        if len(self._heap) + len(self._fifo) > 2 * len(self._rank) + 64:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale entries of both places (the parked live ones go to the heap)."""
        rank = self._rank
        self._fifo = deque(e for e in self._fifo if rank.get(e[2]) is e)
        heap = [e for e in self._heap if rank.get(e[2]) is e]
        heap.extend(e for e in self._parked if rank.get(e[2]) is e)
        heapq.heapify(heap)
        self._heap = heap
        self._parked = []

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        self.on_insert_many((key,), parent)

    def on_insert_many(self, keys: Sequence[Key], parent: Key | None = None,
                       chained: bool = False) -> None:
        """on_insert for each of `keys`, in order (see PerKeyBatches), in one loop with
        _touch inline: a tier's run of new pages costs no call per page. A key held already
        is read again (on_access), as on_insert does."""
        rank, log2_uses = self._rank, _LOG2_USES
        keys = keys if isinstance(keys, list | tuple) else list(keys)
        # The run's lookups in the big tables come first, in C (`map`), so that their cache
        # misses overlap: the ghost's pops (a held key is never in the ghost, so popping every
        # key of the run is the same), and whether each is held, when the run repeats no key
        # (else asked as the loop reaches it).
        pasts = list(map(self._ghost.pop, keys, repeat(None)))
        held = (list(map(rank.__contains__, keys)) if len(set(keys)) == len(keys)
                else (key in rank for key in keys))
        fifo, heap, push = self._fifo, self._heap, heapq.heappush
        clock, calls, factor = self._clock, self._calls, self.horizon_factor
        discount_of = self._insert_discount if self._discounted else None
        # A new tick's horizon: it moves at inserts only, so that the pages of a prefix read
        # at one tick rank by their uses and call order alone (leaves first).
        horizon = factor * self.reuse_distance
        root = None  # a discounted policy's last new page without a parent, not yet begun
        for key, past, is_held in zip(keys, pasts, held, strict=True):
            if is_held:  # rare: off the loop, which stays inline for the new keys
                clock, calls, horizon = self._access_in_run(key, clock, calls, root)
                root, fifo, heap = None, self._fifo, self._heap
            else:
                clock += 1
                if past is None:
                    uses = 1
                elif (uses := past[3] + 1) == 2:  # a first reuse
                    self._clock = clock
                    self._reused(past[4])
                    horizon = factor * self.reuse_distance
                self.horizon = horizon
                calls += 1
                log2 = log2_uses[uses if uses < MAX_USES else MAX_USES]
                if discount_of is None:
                    bonus = horizon * log2
                elif parent is None:  # a put's first page: see _access_in_run
                    bonus = horizon * log2
                    root = (key, clock)
                else:
                    if root is not None:
                        self._begin_put(*root)
                        root = None
                    bonus = horizon * (log2 - discount_of(key, parent, clock))
                priority = clock + bonus
                entry = rank[key] = (priority, -calls, key, uses, clock)
                if bonus == 0.0 and (not fifo or fifo[-1][0] < priority):
                    fifo.append(entry)
                else:
                    push(heap, entry)
            parent = key if chained else None
        if root is not None:
            self._begin_put(*root)
        self._clock, self._calls = clock, calls
        # Each new key adds one entry and one live key, so if this holds at all, it holds
        # after the first: compacting once at the end drops the same stale entries.
        if len(heap) + len(fifo) > 2 * len(rank) + 64:
            self._compact()

    def _access_in_run(self, key: Key, clock: int, calls: int, root: tuple | None
                       ) -> tuple[int, int, float]:
        """on_insert_many's key held already: read again (on_access) at the run's `clock` and
        `calls`; returns them after, and the horizon of the new tick.

        `root` is a discounted policy's put not yet begun: (its first page, its clock). A put's
        first page takes no discount (depth 1, ranked from its own clock); its put begins
        before the next discount, read (here) or return, so that a run of moved pages (no
        parents) costs no call per page."""
        if root is not None:
            self._begin_put(*root)
        self._clock, self._calls = clock, calls
        self.on_access(key)
        return self._clock, self._calls, self.horizon_factor * self.reuse_distance

    _discounted = False  # whether _insert_discount takes anything off (PutDepthPolicy)

    def _insert_discount(self, key: Key, parent: Key, clock: int) -> float:
        """Horizons taken off the bonus of a new page with a parent, inserted at `clock`
        (none here; see PutDepthPolicy). A page without one is never discounted."""
        return 0.0

    def _begin_put(self, key: Key, clock: int) -> None:
        """A discounted policy's put begins at `key`, inserted at `clock` without a parent."""

    def on_access(self, key: Key) -> None:
        held = self._rank.get(key)
        if held is not None:
            if held[3] == 1:
                self._reused(held[4])
            self._touch(key, held)

    def on_remove(self, key: Key) -> None:
        self.on_remove_many((key,))

    def on_remove_many(self, keys: Iterable[Key]) -> None:
        """on_remove for each of `keys`: each held one's entry goes to the ghost, which keeps
        the last ghost_capacity_pages (a key held is never in the ghost: on_insert took it
        out, so each lands at the new end and trimming once after all is the same)."""
        keys = keys if isinstance(keys, list | tuple) else list(keys)
        ghost = self._ghost
        # In C (`map`, `update`): the lookups' cache misses overlap.
        held = list(map(self._rank.pop, keys, repeat(None)))
        ghost.update([(k, e) for k, e in zip(keys, held, strict=True) if e is not None])
        excess = len(ghost) - self.ghost_capacity_pages
        if excess > 0:  # the oldest go, popped in C
            deque(map(ghost.pop, list(islice(ghost, excess))), maxlen=0)

    def victims(self, num_pages: int, is_pinned: IsPinned) -> list[Key]:
        """Smallest priorities first, skipping pinned keys; no key is removed."""
        _check_num_pages(num_pages)
        heap, fifo, rank, pop = self._heap, self._fifo, self._rank, heapq.heappop
        # The last call's entries still live go back: at the fifo's head when they come
        # before it (they came out in order, before everything that stayed; a newer entry
        # may rank lower), else into the heap.
        parked = self._parked  # their keys' live entries looked up in C: misses overlap
        live = [e for e, held in zip(parked, map(rank.get, map(_KEY, parked)), strict=True)
                if held is e]
        if live:
            if not fifo or live[-1] < fifo[0]:
                fifo.extendleft(reversed(live))
            else:
                for entry in live:
                    heapq.heappush(heap, entry)
        self._parked = parked = []
        park, popleft, live_entry = parked.append, fifo.popleft, rank.get
        out: list[Key] = []
        wanted = num_pages
        while wanted:
            if heap:
                entry = popleft() if fifo and fifo[0] < heap[0] else pop(heap)
            elif fifo:
                entry = popleft()
            else:
                break
            key = entry[2]
            if live_entry(key) is not entry:
                continue  # stale: used again or removed since
            park(entry)
            if not is_pinned(key):
                out.append(key)
                wanted -= 1
        return out

    def __len__(self) -> int:
        return len(self._rank)

    def __contains__(self, key: Key) -> bool:
        return key in self._rank

