"""The operator API: pin and unpin a prompt's pages with a TTL, warm them onto a node.

Each call is written once as steps (cluster/calls.py), driven blocking by KVClient.pin/...
or on asyncio by the Serve ingress's admin endpoints:

    pin(prefix, ttl_s)     the directory says which nodes hold which of the prompt's pages;
                           each holder pins its own (node.pin), all or nothing: a node that
                           refuses (past its cap) or fails undoes the others' pins, which
                           get back the pin they replaced, if any
    unpin(prefix)          every kv node ends the prompt's pin (it may have moved)
    warm(prefix, node_id)  the named node pulls the pages it lacks from their holders:
                           node.pull, the control loop's replication path

A pin is named by the prompt's last page key, so pinning the same prompt again replaces its
pin (its TTL restarts), and unpinning it ends that pin only; pins of other prompts that share
its pages keep them.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray

from actors.handles import DirectoryHandle, NodeHandle, PeerCache, merge_shard_prefixes
from cluster.calls import Steps, Wait, Work, failed
from cluster.core.config import CacheConfig
from cluster.core.geometry import PageGeometry
from cluster.core.keys import PageKey
from cluster.core.membership import kv_nodes
from cluster.core.pins import check_ttl

MIN_NODE_PREFIX = 6  # characters of a node id that may name it


@dataclass(frozen=True, slots=True)
class Prefix:
    """A prompt's pages: its page keys (in a namespace's chain) and their geometry."""

    geometry: PageGeometry
    keys: tuple[PageKey, ...]
    namespace: str

    @property
    def pin_id(self) -> bytes:
        return bytes(self.keys[-1])


def cause(error: BaseException) -> BaseException:
    """The exception an actor raised (Ray wraps it in a RayTaskError)."""
    return getattr(error, "cause", None) or error


def resolve_node(node_id: str, known: list[str]) -> str:
    """The kv node `node_id` names: a node id, or a unique prefix of one (as `raykv status`
    prints them). ValueError naming the known nodes otherwise."""
    if node_id in known:
        return node_id
    matches = [n for n in known if len(node_id) >= MIN_NODE_PREFIX and n.startswith(node_id)]
    if len(matches) == 1:
        return matches[0]
    shown = ", ".join(n[:12] for n in sorted(known)) or "none"
    why = "names several nodes" if matches else "is not a raykv node"
    raise ValueError(f"node {node_id!r} {why}; raykv's nodes: {shown}")


def holders_of(located: list) -> dict[str, list[int]]:
    """Per node, the positions of the prefix's pages the directory places there."""
    nodes: dict[str, list[int]] = {}
    for position, places in enumerate(located):
        for node_id in dict.fromkeys(node for node, _ in places):
            nodes.setdefault(node_id, []).append(position)
    return nodes


def pull_plan(located: list, keys: tuple[PageKey, ...], target: str) -> dict[str, list]:
    """The pages `target` lacks, grouped by the node to pull each from (its best-tier
    holder, as the directory lists them)."""
    plan: dict[str, list] = {}
    for key, places in zip(keys, located, strict=False):
        holders = [node for node, _ in places]
        if target not in holders and holders:
            plan.setdefault(holders[0], []).append(key)
    return plan


class Operator:
    """Pins and warm-ups over the running service's directory and node actors."""

    def __init__(self, config: CacheConfig, directory: DirectoryHandle, peers: PeerCache):
        self.config = config
        self.directory = directory
        self.peers = peers

    @classmethod
    def of(cls, config: CacheConfig) -> Operator:
        return cls(config, DirectoryHandle.lookup(config), PeerCache(config))

    def _located(self, prefix: Prefix) -> Steps[list]:
        """Where each page of the longest stored prefix is: [(node_id, tier), ...] each."""
        positions, refs = self.directory.prefix_refs(list(prefix.keys))
        answers = yield Wait(refs)
        down = [a for a in answers if failed(a)]
        if down:
            raise RuntimeError(f"the directory did not answer: {down[0]}")
        return merge_shard_prefixes(len(prefix.keys), positions, answers)

    def _handles(self, node_ids: list[str]) -> Steps[dict[str, NodeHandle]]:
        handles = yield Work(lambda: {n: self.peers.get(n) for n in node_ids})
        missing = sorted(n[:12] for n, h in handles.items() if h is None)
        if missing:
            raise RuntimeError(f"no raykv node actor on {', '.join(missing)}")
        return handles

    def _kv_nodes(self) -> Steps[list[str]]:
        nodes = yield Work(ray.nodes)
        return kv_nodes(self.config.node_resource, nodes)

    def pin(self, prefix: Prefix, ttl_s: float) -> Steps[int]:
        """Pin the prompt's stored pages on every node holding them; returns how many of
        its pages were pinned. PinRefused (ValueError) past a node's cap, RuntimeError when
        a node or the directory fails: nothing stays pinned by this call then."""
        check_ttl(ttl_s)
        located = yield from self._located(prefix)
        holders = holders_of(located)
        handles = yield from self._handles(list(holders))
        asks = {n: [prefix.keys[p] for p in positions] for n, positions in holders.items()}
        replies = yield Wait([handles[n].pin(prefix.geometry, prefix.pin_id, keys, ttl_s)
                              for n, keys in asks.items()])
        answers = dict(zip(asks, replies, strict=True))
        refused = {n: cause(r) for n, r in answers.items() if failed(r)}
        if refused:
            yield from self._undo(prefix, handles, {n: r for n, r in answers.items()
                                                    if n not in refused})
            node_id, error = next(iter(refused.items()))
            kind = type(error) if isinstance(error, ValueError) else RuntimeError
            raise kind(f"pin refused by node {node_id[:12]}: {error}") from None
        pinned = {key for keys, _ in answers.values() for key in keys}
        return sum(1 for key in prefix.keys if key in pinned)

    def _undo(self, prefix: Prefix, handles: dict[str, NodeHandle], done: dict) -> Steps[None]:
        """Take back the pins just made: each node's earlier pin of the prompt comes back."""
        refs = []
        for node_id, (_, replaced) in done.items():
            node = handles[node_id]
            if replaced is None:
                refs.append(node.unpin(prefix.pin_id))
            elif replaced[1] > 0:
                refs.append(node.pin(prefix.geometry, prefix.pin_id, replaced[0], replaced[1]))
        yield Wait(refs)

    def unpin(self, prefix: Prefix) -> Steps[int]:
        """End the prompt's pin on every kv node; returns how many of its pages it held."""
        node_ids = yield from self._kv_nodes()
        handles = yield Work(lambda: {n: self.peers.get(n) for n in node_ids})
        live = [h for h in handles.values() if h is not None]
        replies = yield Wait([h.unpin(prefix.pin_id) for h in live])
        ended = {key for reply in replies if not failed(reply) for key in reply}
        return sum(1 for key in prefix.keys if key in ended)

    def warm(self, prefix: Prefix, node_id: str) -> Steps[int]:
        """Copy the prompt's stored pages onto `node_id` (an id or a unique prefix of one)
        ahead of traffic; returns how many of its pages sit on that node now. ValueError for
        a node that is not raykv's."""
        target_id = resolve_node(node_id, (yield from self._kv_nodes()))
        located = yield from self._located(prefix)
        target = (yield from self._handles([target_id]))[target_id]
        plan = pull_plan(located, prefix.keys, target_id)
        if plan:
            (pulled,) = yield Wait([target.pull(prefix.geometry, plan, prefix.namespace)])
            if failed(pulled):
                raise RuntimeError(f"node {target_id[:12]} could not pull: {cause(pulled)}")
        (held,) = yield Wait([target.namespaces(prefix.geometry, list(prefix.keys))])
        if failed(held):
            raise RuntimeError(f"node {target_id[:12]} did not answer: {cause(held)}")
        return sum(1 for namespace in held if namespace is not None)
