"""Migration: move cold pages off hot nodes.

A node is under pressure while its memory is fuller than `high_fraction`, or while it is hot
(policies/burst.py) and fuller than `low_fraction`: a busy node with room has nothing to gain
from losing pages. From such a node, the cold prefixes it holds (tracked, not hot, slower than
`cold_per_s`) leave, coldest first:

    another holder that is not under pressure   ->  Move(target=None): drop the copies here
    else a node with room (below `low_fraction`) ->  Move(target=it): it pulls, then we drop
    else                                         ->  it stays

Pages that a prefix still in use shares (a hot or warm prefix's pages, such as a system prompt
under a cold conversation) never move. A prefix moved is left alone for `cooldown_s`, so pages
do not bounce between nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.replication import LoadView
from policies.snapshot import Key, NodeLoad, PrefixLoad


@dataclass(frozen=True, slots=True)
class MigrationSettings:
    cold_per_s: float = 0.2
    high_fraction: float = 0.9
    low_fraction: float = 0.7
    cooldown_s: float = 10.0
    max_moves_per_step: int = 8


@dataclass(frozen=True, slots=True)
class Move:
    """`source` drops `keys`; when `target` is set it first pulls them from `source`."""

    prefix_id: Key
    keys: tuple[Key, ...]
    source: str
    target: str | None


@dataclass(frozen=True, slots=True)
class MigrationState:
    moved: dict = field(default_factory=dict)  # prefix_id -> when it last moved (s)


def under_pressure(view: LoadView, node: NodeLoad, settings: MigrationSettings) -> bool:
    if node.capacity_bytes <= 0:
        return False
    fraction = node.used_bytes / node.capacity_bytes
    hot = node.node_id in view.burst.hot_nodes
    return fraction >= settings.high_fraction or (hot and fraction >= settings.low_fraction)


def decide(view: LoadView, state: MigrationState | None, now_s: float,
           settings: MigrationSettings = MigrationSettings()
           ) -> tuple[tuple[Move, ...], MigrationState]:
    """The moves to make now."""
    state = state or MigrationState()
    moved = {p: at_s for p, at_s in state.moved.items() if now_s - at_s < settings.cooldown_s}
    pressed = {n.node_id for n in view.snapshot.nodes if under_pressure(view, n, settings)}
    if not pressed:
        return (), MigrationState(moved)
    rates = view.burst.prefix_rates_per_s
    cold, warm = [], []
    for prefix in view.snapshot.prefixes:
        is_cold = (prefix.prefix_id not in view.burst.hot_prefixes
                   and rates.get(prefix.prefix_id, 0.0) < settings.cold_per_s)
        (cold if is_cold else warm).append(prefix)
    cold.sort(key=lambda p: (rates.get(p.prefix_id, 0.0), p.prefix_id))
    used = {n.node_id: n.used_bytes for n in view.snapshot.nodes}
    moves: list[Move] = []
    kept: set | None = None  # the warm prefixes' keys, stay put; built when first needed
    for prefix in cold:
        if prefix.prefix_id in moved or len(moves) >= settings.max_moves_per_step:
            continue
        sources = sorted(set(prefix.holders) & pressed)
        if not sources:
            continue
        if kept is None:
            kept = {key for warm_prefix in warm for key in warm_prefix.keys}
        keys = tuple(k for k in prefix.keys if k not in kept)
        if not keys:
            continue
        if any(h not in pressed for h in prefix.holders):  # a copy stays elsewhere: drop ours
            moves += [Move(prefix.prefix_id, keys, source, None) for source in sources]
        else:
            target = _room(view, prefix, pressed, used, settings)
            if target is None:
                continue  # nowhere to go: it stays
            moves.append(Move(prefix.prefix_id, keys, sources[0], target))
            used[target] += prefix.num_bytes
        moved[prefix.prefix_id] = now_s
    return tuple(moves), MigrationState(moved)


def _room(view: LoadView, prefix: PrefixLoad, pressed: set[str], used: dict[str, int],
          settings: MigrationSettings) -> str | None:
    """The least loaded node, not under pressure, that can take the prefix below
    `low_fraction` of its memory; None when there is none."""
    room = [n for n in view.snapshot.nodes
            if n.node_id not in pressed and n.node_id not in prefix.holders
            and used[n.node_id] + prefix.num_bytes <= settings.low_fraction * n.capacity_bytes]
    if not room:
        return None
    return min(room, key=lambda n: (view.burst.node_rates_per_s.get(n.node_id, 0.0),
                                    used[n.node_id], n.node_id)).node_id
