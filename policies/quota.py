"""Who gives memory back when a tier is full: min, max and weight per model and namespace.

Pure. Decisions over a snapshot of who holds what:

    choose_donor(holdings, requester, need_bytes)
        a model that needs memory in a full tier takes a chunk from another model, or evicts
        its own pages (None). Nobody goes below its min; nobody grows past its max; otherwise
        the model holding the most per unit of weight gives.

    namespace_guard(usage, quotas, requester)
        when a namespace makes room for a page, which namespaces' pages are off limits: its
        own, if it is at its max, are the only ones it may evict; a namespace at or under its
        min keeps its pages; of the rest, those holding the most per unit of weight go first.

    giving_order(guard, usage, quotas)
        the rounds in which namespaces give pages, by priority class: every `low` namespace
        gives before any `normal` one, and `normal` before `high`; within a class, those
        over their share (the guard's `first`) before the rest.

    release_order(chunks, quotas)
        which of a donor model's chunks go back first: those holding only lower classes'
        pages (a chunk counts as the highest class it holds), the emptiest among equals.

    breaks_min(usage, quotas, giving)
        whether giving these bytes would put a namespace under its min (namespace_guard's
        rule, for a chunk's pages at once): such a chunk is not given back.

    fitted_mins(mins, capacity_bytes)
        the mins a tier can keep: as registered when they fit together, else cut in
        proportion so that they do (a min past the tier is a guarantee it cannot give).

    past_max(usage, quotas)
        the bytes each model or namespace holds in a tier past its max (one lowered while
        it held more): what it gives back.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

PRIORITIES = ("low", "normal", "high")  # a namespace's eviction class: the lowest gives first


@dataclass(frozen=True, slots=True)
class Quota:
    """Bytes per tier per node: a floor that is never reclaimed, a ceiling, and a weight.

    `priority` is a namespace's eviction class (low, normal, high): when memory is freed
    across namespaces, lower classes give first. Models' quotas ignore it.
    """

    min_bytes: int = 0
    max_bytes: int | None = None
    weight: float = 1.0
    priority: str = "normal"

    def __post_init__(self) -> None:
        figures = {"min_bytes": self.min_bytes, "max_bytes": self.max_bytes,
                   "weight": self.weight}
        for name, value in figures.items():
            if not (value is None and name == "max_bytes") and not _finite(value):
                raise ValueError(f"a quota's {name} must be a finite number, got {value!r}")
        if (self.min_bytes < 0 or self.weight <= 0
                or (self.max_bytes is not None and self.max_bytes < 0)):
            raise ValueError(f"a quota needs min_bytes >= 0, max_bytes >= 0 and weight > 0, "
                             f"got {self}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got "
                             f"{self.priority!r}")
        if self.max_bytes is not None and self.max_bytes < self.min_bytes:
            raise ValueError(f"max_bytes ({self.max_bytes}) is below min_bytes "
                             f"({self.min_bytes})")

    def combined(self, other: Quota) -> Quota:
        """Two models with one page geometry share a pool: their quotas add up."""
        maximum = (None if self.max_bytes is None or other.max_bytes is None
                   else self.max_bytes + other.max_bytes)
        priority = max(self.priority, other.priority, key=PRIORITIES.index)
        return Quota(self.min_bytes + other.min_bytes, maximum, self.weight + other.weight,
                     priority)


def _finite(value: object) -> bool:
    """A real number (not a bool) that is neither NaN nor infinite."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    return isinstance(value, numbers.Integral) or math.isfinite(value)


@dataclass(frozen=True, slots=True)
class Holding:
    """One model's memory in one tier: what it holds, its quota, what one chunk of it is."""

    holder: str
    held_bytes: int
    quota: Quota
    chunk_bytes: int
    releasable: bool = True  # False: every chunk has a page in use (pinned or moving)


def share(held_bytes: int, quota: Quota) -> float:
    return held_bytes / quota.weight


def choose_donor(holdings: list[Holding], requester: str, need_bytes: int) -> str | None:
    """The model that should give a chunk so that `requester` can grow by `need_bytes`; None
    when the requester should evict its own pages instead (at its max, or already holding
    its fair share while nobody else holds more than theirs)."""
    mine = next((h for h in holdings if h.holder == requester), None)
    held = mine.held_bytes if mine else 0
    quota = mine.quota if mine else Quota()
    if quota.max_bytes is not None and held + need_bytes > quota.max_bytes:
        return None
    below_min = held < quota.min_bytes
    wanted = share(held + need_bytes, quota)
    donors = [h for h in holdings if h.holder != requester and h.releasable
              and h.held_bytes - h.chunk_bytes >= h.quota.min_bytes
              and (below_min or share(h.held_bytes, h.quota) > wanted)]
    if not donors:
        return None
    return max(donors, key=lambda h: share(h.held_bytes, h.quota)).holder


@dataclass(frozen=True, slots=True)
class Guard:
    """What a namespace making room may evict: only its own pages (`only`), or anyone's
    except the `kept` namespaces'; `first` are the namespaces to take from before others."""

    only: str | None
    kept: frozenset[str]
    first: frozenset[str]


def namespace_guard(usage: dict[str, int], quotas: dict[str, Quota], requester: str,
                    page_bytes: int) -> Guard:
    """`usage`: bytes each namespace holds in the tier; `quotas`: unknown ones get Quota()."""
    quota = quotas.get(requester, Quota())
    held = usage.get(requester, 0)
    if quota.max_bytes is not None and held + page_bytes > quota.max_bytes:
        return Guard(requester, frozenset(), frozenset())
    kept = frozenset(ns for ns, used in usage.items() if ns != requester
                     and used - page_bytes < quotas.get(ns, Quota()).min_bytes)
    wanted = share(held + page_bytes, quota)
    first = frozenset(ns for ns, used in usage.items() if ns not in kept and ns != requester
                      and share(used, quotas.get(ns, Quota())) > wanted)
    return Guard(None, kept, first)


def giving_order(guard: Guard, usage: dict[str, int],
                 quotas: dict[str, Quota]) -> tuple[frozenset[str], ...]:
    """The namespaces whose pages a request for room may take, in rounds, first to give
    first: class by class (low, normal, high), and within a class those over their share
    (`guard.first`) before the rest. `guard.kept` never give; with `guard.only`, only that
    one does. `usage`: the namespaces holding pages in the tier; unknown ones are normal."""
    if guard.only is not None:
        return (frozenset((guard.only,)),)
    rounds: list[frozenset[str]] = []
    for priority in PRIORITIES:
        members = {ns for ns in usage if ns not in guard.kept
                   and quotas.get(ns, Quota()).priority == priority}
        over = members & guard.first
        rounds += [frozenset(r) for r in (over, members - over) if r]
    return tuple(rounds)


def class_rank(namespace: str, quotas: dict[str, Quota]) -> int:
    """0 for low, 1 for normal, 2 for high (unknown namespaces are normal)."""
    return PRIORITIES.index(quotas.get(namespace, Quota()).priority)


def release_order(chunks: list[tuple[int, int, frozenset[str]]],
                  quotas: dict[str, Quota]) -> list[int]:
    """The chunks of a model that gives memory back, first to go first. `chunks`: (chunk,
    pages used in it, the namespaces with pages in it)."""
    def key(chunk: tuple[int, int, frozenset[str]]) -> tuple[int, int, int]:
        number, used, namespaces = chunk
        top = max((class_rank(ns, quotas) for ns in namespaces), default=-1)
        return top, used, number

    return [chunk[0] for chunk in sorted(chunks, key=key)]


def breaks_min(usage: dict[str, int], quotas: dict[str, Quota], giving: dict[str, int]) -> bool:
    """Whether giving `giving` (bytes per namespace) would put a namespace under its min:
    `usage`, the bytes each holds in the tier; `quotas`: unknown ones get Quota()."""
    return any(usage.get(ns, 0) - given < quotas.get(ns, Quota()).min_bytes
               for ns, given in giving.items() if given > 0)


def fitted_mins(mins: dict[str, int], capacity_bytes: int) -> dict[str, int]:
    """The mins (bytes, by holder or namespace) that a tier of `capacity_bytes` can keep: as
    given when their sum fits, else each cut in proportion (rounded down), so that they do."""
    total = sum(mins.values())
    if total <= capacity_bytes:
        return dict(mins)
    return {name: int(minimum * capacity_bytes // total) for name, minimum in mins.items()}


def fitted_quotas(quotas: dict[str, Quota], capacity_bytes: int) -> dict[str, Quota]:
    """`quotas` with the mins a tier of `capacity_bytes` can keep (fitted_mins)."""
    mins = fitted_mins({name: q.min_bytes for name, q in quotas.items()}, capacity_bytes)
    return {name: q if mins[name] == q.min_bytes else replace(q, min_bytes=mins[name])
            for name, q in quotas.items()}


def past_max(usage: dict[str, int], quotas: dict[str, Quota]) -> dict[str, int]:
    """The bytes each holder (model or namespace) of `usage` holds past its max in a tier;
    those within theirs (or with none) are left out."""
    over = {}
    for name, used_bytes in usage.items():
        maximum = quotas.get(name, Quota()).max_bytes
        if maximum is not None and used_bytes > maximum:
            over[name] = used_bytes - maximum
    return over
