"""DirectoryIndex's fast paths against a plain reference (the loop before them): batches with
repeated keys, delivered out of order and more than once, from two nodes. Every answer,
place, tombstone, digest and prefix match must be the same. No Ray."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.core.directory_index import DirectoryIndex, NodeLog
from cluster.core.events import EventBatch, key_digest


def key(i: int) -> bytes:
    return b"k" + i.to_bytes(15, "little")


class ReferenceIndex(DirectoryIndex):
    """Every change looked up one at a time, a tombstone for every removal, log.keys asked
    for every store, every place list sorted."""

    def _apply_changes(self, node_id: str, log: NodeLog, changes: list, seq: int) -> None:
        for k, tier in changes:
            places = self.index.get(k)
            current = places.get(node_id) if places else None
            if tier is None:
                if current is not None and current[1] > seq:
                    continue
                tombstone = log.tombstones.get(k)
                if tombstone is None or tombstone < seq:
                    log.tombstones[k] = seq
                if current is not None:
                    self._forget(node_id, k)
                    log.discard_key(k)
                continue
            if log.tombstones.get(k, -1) > seq:
                continue
            if current is None or current[1] < seq:
                self.index.setdefault(k, {})[node_id] = (tier, seq)
                self.ranked.pop(k, None)
                log.add_key(k)
                log.tombstones.pop(k, None)

    def prefix_runs(self, keys: list) -> list[list]:
        runs: list[list] = []
        for k in keys:
            places = self.index.get(k)
            if not places:
                break
            ranked = tuple(sorted(((n, t) for n, (t, _) in places.items()),
                                  key=lambda p: p[1]))
            if runs and runs[-1][0] == ranked:
                runs[-1][1] += 1
            else:
                runs.append([ranked, 1])
        return runs


CHANGE = st.tuples(st.integers(0, 9), st.one_of(st.none(), st.integers(0, 2)))
BATCHES = st.lists(st.lists(CHANGE, max_size=6), min_size=1, max_size=8)


def numbered(node_id: str, batches: list) -> list[EventBatch]:
    """The node's batches in the order it built them, each with its digest after it."""
    held: dict[bytes, int] = {}
    out = []
    for seq, changes in enumerate(batches, start=1):
        changes = [(key(i), tier) for i, tier in changes]
        for k, tier in changes:
            if tier is None:
                held.pop(k, None)
            else:
                held[k] = tier
        digest = 0
        for k in held:
            digest ^= key_digest(k)
        out.append(EventBatch(node_id, 1, seq, changes, 0, digest, len(held)))
    return out


def state(index: DirectoryIndex) -> tuple:
    nodes = {n: (log.watermark, sorted(log.applied), dict(log.tombstones), sorted(log.keys),
                 log.digest) for n, log in index.nodes.items()}
    return {k: dict(p) for k, p in index.index.items()}, nodes


@settings(max_examples=300, deadline=None)
@given(a=BATCHES, b=BATCHES, data=st.data())
def test_the_fast_paths_give_the_references_answers(a, b, data):
    deliveries = numbered("a", a) + numbered("b", b)
    deliveries += data.draw(st.lists(st.sampled_from(deliveries), max_size=4))  # resent
    order = data.draw(st.permutations(deliveries))
    probes = data.draw(st.lists(st.lists(st.integers(0, 9), max_size=6), max_size=4))
    fast, plain = DirectoryIndex(), ReferenceIndex()
    for index in (fast, plain):
        for node_id in ("a", "b"):
            index.replace_node(node_id, 1, [], 0)
    for batch in order:
        assert fast.apply(batch) == plain.apply(batch)
        assert state(fast) == state(plain)
        for probe in probes:
            keys = [key(i) for i in probe]
            assert fast.prefix_runs(keys) == plain.prefix_runs(keys)
