"""What every eviction policy shares: the protocol the node store drives (described in
policies/eviction.py, where the policies are importable from), the per-key fallback for runs
of pages, and the argument checks. Pure Python (no ray, torch or numpy).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Protocol, runtime_checkable

Key = Hashable
IsPinned = Callable[[Key], bool]


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders the keys of one tier for eviction."""

    def on_insert(self, key: Key, parent: Key | None = None) -> None: ...

    def on_access(self, key: Key) -> None: ...

    def on_remove(self, key: Key) -> None: ...

    def on_insert_many(self, keys: Sequence[Key], parent: Key | None = None,
                       chained: bool = False) -> None: ...

    def on_remove_many(self, keys: Iterable[Key]) -> None: ...

    def victims(self, num_pages: int, is_pinned: IsPinned) -> list[Key]:
        """Up to num_pages distinct unpinned keys, first to evict first; removes none."""
        ...

    def __len__(self) -> int: ...


class PerKeyBatches:
    """The calls for a run of pages, as one call per page (a policy may run them faster)."""

    def on_insert_many(self, keys: Sequence[Key], parent: Key | None = None,
                       chained: bool = False) -> None:
        """on_insert(key, parent) for each of `keys`, in order: the first key's parent is
        `parent`, each next one's the key before it when `chained` (a put's new pages, as
        Pool.commit passes them), else None (pages demoted or adopted)."""
        insert = self.on_insert  # type: ignore[attr-defined]
        for key in keys:
            insert(key, parent)
            parent = key if chained else None

    def on_remove_many(self, keys: Iterable[Key]) -> None:
        """on_remove(key) for each of `keys`, in order."""
        remove = self.on_remove  # type: ignore[attr-defined]
        for key in keys:
            remove(key)


def _check_num_pages(num_pages: int) -> None:
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
        raise ValueError(f"num_pages must be a non-negative int, got {num_pages!r}")


def _check_capacity(capacity_pages: int) -> None:
    if isinstance(capacity_pages, bool) or not isinstance(capacity_pages, int):
        raise ValueError(f"capacity_pages must be an int, got {capacity_pages!r}")
    if capacity_pages <= 0:
        raise ValueError(f"capacity_pages must be positive, got {capacity_pages}")
