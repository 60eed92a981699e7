"""KVClient: what a serving replica imports.

Every operation is one generator of steps (cluster/calls.py), driven two ways:

    client.put / lookup / get / prefetch / stats          block this thread (ray.get)
    await client.aput / alookup / aget / aprefetch / astats   never block the event loop
    client.pin / unpin / warm (apin, aunpin, awarm)       the operator API (cluster/operator.py)

Each Ray call waits at most CacheConfig.call_timeout_s, and a failed or late call is a miss:
a put that stored nothing returns 0, a get returns (0, None). Bad input (tokens, shapes,
dtypes) raises TypeError/ValueError before anything is sent.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time

import numpy as np
import torch

from actors.handles import DirectoryHandle, NodeHandle, PeerCache
from cluster import ray_gate
from cluster.calls import Steps, Wait, Work, failed, run_async, run_sync
from cluster.core.config import CacheConfig
from cluster.core.copies import copy_pages
from cluster.core.dataplane.auth import ClientSecrets
from cluster.core.dataplane.transport import make_transport
from cluster.core.geometry import HOST, PageGeometry
from cluster.core.keys import KeyChain, PageKey
from cluster.core.kvcheck import check_kv, check_out, page_slices
from cluster.core.spec import ModelSpec
from cluster.core.tiers.slot_table import as_places
from cluster.fetch import fetch_prefix, located_prefix
from cluster.operator import Operator, Prefix
from cluster.puts import LeasedPuts
from cluster.slabs import LocalSlabs
from cluster.view import CacheView

log = logging.getLogger("raykv.client")


class KVClient:
    """put / lookup / get / prefetch / stats for one model and namespace (and a*-variants)."""

    def __init__(self, spec: ModelSpec, namespace: str, config: CacheConfig,
                 directory: DirectoryHandle, home: NodeHandle,
                 secrets: ClientSecrets | None = None):
        """`secrets`: the namespace's key-chain secret and the data plane's peer key
        (connect() gets them from the controller; see cluster/core/secrets.py)."""
        secrets = secrets or ClientSecrets()
        self.spec = spec
        self.namespace = namespace
        self.chain = KeyChain.of(spec, namespace, config.page_tokens, secrets.namespace_secret)
        self.config = config
        self.page_tokens = config.page_tokens
        self.geometry = PageGeometry.of(spec, config.page_tokens)
        slabs = LocalSlabs(home, self.geometry) if home.is_local else None
        self.view = CacheView(self.geometry, home, directory, PeerCache(config), slabs,
                              namespace, make_transport(config.transport),
                              config.call_timeout_s, authority=secrets.authority(namespace),
                              gate=ray_gate.background_call)
        self.timeout_s = config.call_timeout_s

    def map_slabs(self) -> bool:
        """Map this node's slabs and its held-pages index now (one call), so that a first get
        of pages held here needs none; False without local slabs or when the node did not
        answer (the first reply's stamp maps them then)."""
        slabs = self.view.slabs
        if slabs is None:
            return False
        try:
            return run_sync(slabs.map_now(), self.timeout_s)
        except Exception as error:  # noqa: BLE001 - a later reply maps them instead
            log.warning("could not map this node's slabs at connect: %s", error)
            return False

    @property
    def puts(self) -> LeasedPuts | None:
        """The view's slot lease and committer (cluster/puts.py); None without mapped slabs."""
        view = self.view
        if view.puts is None and view.slabs is not None:
            view.puts = LeasedPuts(view, self.config.put_lease_bytes,
                                   self.config.reserve_lease_s, gate=ray_gate.background_call)
        return view.puts

    @property
    def counters(self) -> dict[str, int]:
        return self.view.counters

    @property
    def home(self):
        """The node actor (a NodeHandle) this client writes through."""
        return self.view.home

    @property
    def local(self):
        """This node's actor (a NodeHandle) when the client maps its slabs, else None."""
        return self.view.local

    @property
    def directory(self):
        return self.view.directory

    def locate_keys(self, keys: list[PageKey]) -> list:
        """Where each page of the longest cached prefix of `keys` is: a tuple of
        (node_id, tier) per page, best tier first."""
        return run_sync(self._locate(keys), self.timeout_s)

    def keys(self, tokens: object) -> list[PageKey]:
        """The page keys of `tokens` in this client's namespace (its secret included)."""
        return self.chain.keys(tokens)

    def salted(self, extra: bytes) -> KVClient:
        """This client for the requests `extra` sets apart (a LoRA adapter, a cache salt,
        multimodal inputs: canonical bytes): the same calls, its pages keyed under
        KeyChain.salted(extra), never shared with other requests'. b"" is this client."""
        return self._with_chain(self.chain.salted(extra))

    def continued(self, key: PageKey) -> KVClient:
        """This client's calls on the tokens after the page keyed `key`: a put of
        tokens[k*T:] stores the pages the full prompt's put would store as pages k.. when `key`
        is its page k-1 (a chunked save puts only what it adds)."""
        return self._with_chain(self.chain.continued(key))

    def bounded(self, timeout_s: float) -> KVClient:
        """This client with each Ray call waiting at most `timeout_s` (a late call is a miss,
        as with the configured timeout): for a caller with a deadline of its own, such as a
        vLLM engine's load made inside its step."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        view = copy.copy(self)  # shares the connections, slabs and counters
        view.timeout_s = float(timeout_s)
        return view

    def _with_chain(self, chain: KeyChain) -> KVClient:
        if chain is self.chain:
            return self
        view = copy.copy(self)  # shares the connections, slabs and counters
        view.chain = chain
        return view

    # ---- the public calls ----------------------------------------------------------------

    def put(self, tokens: object, kv: torch.Tensor) -> int:
        """Store the full pages of `tokens`' KV; returns the tokens now stored (whole pages)."""
        with self._measured("put"):
            return run_sync(self._put(tokens, kv), self.timeout_s)

    async def aput(self, tokens: object, kv: torch.Tensor) -> int:
        with self._measured("put"):
            return await run_async(self._put(tokens, kv), self.timeout_s)

    def lookup(self, tokens: object) -> int:
        """Longest cached prefix, in tokens (a multiple of page_tokens)."""
        return run_sync(self._lookup(tokens), self.timeout_s)

    async def alookup(self, tokens: object) -> int:
        return await run_async(self._lookup(tokens), self.timeout_s)

    def get(self, tokens: object, out: torch.Tensor | None = None):
        """(prefix tokens, KV of that prefix); (0, None) on a miss. Fills `out` when given."""
        with self._measured("get"):
            return run_sync(self._get(tokens, out), self.timeout_s)

    async def aget(self, tokens: object, out: torch.Tensor | None = None):
        with self._measured("get"):
            return await run_async(self._get(tokens, out), self.timeout_s)

    def prefetch(self, tokens: object) -> int:
        """Start promoting the cached prefix toward this node's fastest tier; returns tokens."""
        return run_sync(self._prefetch(tokens), self.timeout_s)

    async def aprefetch(self, tokens: object) -> int:
        return await run_async(self._prefetch(tokens), self.timeout_s)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Make this client's puts so far visible to every client: True once they are
        committed at their node and the directory has heard of them; False when a wait ran
        past `timeout_s` (each wait; the call timeout by default), or the directory did not
        answer (they become visible later, or are a miss). A put returns once its pages are
        in slots leased ahead; the commit, and the node's directory flush after it, follow in
        the background, within milliseconds on an idle process. A caller whose pages another
        engine is about to ask for (a finished prefill, a P/D hand-off) flushes first."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        return run_sync(self._flushed(wait_s), wait_s)

    async def aflush(self, timeout_s: float | None = None) -> bool:
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        return await run_async(self._flushed(wait_s), wait_s)

    def stats(self) -> dict:
        """Client counters, this node's tiers, and the directory's size."""
        return run_sync(self._stats(), self.timeout_s)

    async def astats(self) -> dict:
        return await run_async(self._stats(), self.timeout_s)

    # ---- the operator API (cluster/operator.py) ----------------------------------------------

    def pin(self, tokens: object, ttl_s: float) -> int:
        """Keep the stored pages of `tokens` on every node that holds them for `ttl_s`
        seconds (eviction passes them by); returns how many of the prompt's pages were
        pinned. Pinning the same prompt again restarts its TTL. ValueError past a node's cap
        (CacheConfig.max_pinned_fraction): then nothing is pinned."""
        return run_sync(self._operator().pin(self._prefix(tokens), ttl_s), self.timeout_s)

    async def apin(self, tokens: object, ttl_s: float) -> int:
        return await run_async(self._operator().pin(self._prefix(tokens), ttl_s),
                               self.timeout_s)

    def unpin(self, tokens: object) -> int:
        """End the pin of `tokens` now, on every node; returns how many pages it held."""
        return run_sync(self._operator().unpin(self._prefix(tokens)), self.timeout_s)

    async def aunpin(self, tokens: object) -> int:
        return await run_async(self._operator().unpin(self._prefix(tokens)), self.timeout_s)

    def warm(self, tokens: object, node_id: str) -> int:
        """Copy the stored pages of `tokens` onto the node `node_id` (an id, or a unique
        prefix of one) ahead of its traffic; returns how many of the prompt's pages sit on
        that node now. ValueError for a node that is not raykv's."""
        return run_sync(self._operator().warm(self._prefix(tokens), node_id), self.timeout_s)

    async def awarm(self, tokens: object, node_id: str) -> int:
        return await run_async(self._operator().warm(self._prefix(tokens), node_id),
                               self.timeout_s)

    def _prefix(self, tokens: object) -> Prefix:
        keys = self.keys(tokens)
        if not keys:
            raise ValueError(f"the prompt has no full page ({self.page_tokens} tokens each)")
        return Prefix(self.geometry, tuple(keys), self.namespace)

    def _operator(self) -> Operator:
        return Operator(self.config, self.view.directory, self.view.peers)

    @contextlib.contextmanager
    def _measured(self, call: str):
        """Latency and bytes moved of one call, as metrics (exported by Ray's endpoint),
        recorded off the call's path (touches.MetricBatch)."""
        counters = self.view.counters
        before = (counters["local_pages"], counters["remote_pages"], counters["put_tokens"])
        start_s = time.perf_counter()
        try:
            yield
        finally:
            latency_s = time.perf_counter() - start_s
            page_bytes = self.geometry.page_bytes
            moved = tuple((path, (counters[key] - was) * unit) for path, key, was, unit in (
                ("get_local", "local_pages", before[0], page_bytes),
                ("get_remote", "remote_pages", before[1], page_bytes),
                ("put", "put_tokens", before[2], page_bytes // self.page_tokens))
                if counters[key] > was)
            fetch_s = 0.0
            if call == "get":
                fetch_s, self.view.fetch_s = self.view.fetch_s, 0.0
            self.view.metrics.note(call, latency_s, moved, fetch_s)

    # ---- the steps -----------------------------------------------------------------------

    def _put(self, tokens: object, kv: torch.Tensor) -> Steps[int]:
        """Into slots leased ahead, with no call (cluster/puts.py); else reserve (one call)
        -> copy into the slots -> commit (one call; the node tells the directory after it
        answers, so the put does not wait for that)."""
        keys = self.keys(tokens)
        check_kv(kv, self.spec, len(tokens))
        if not keys:
            return 0
        view = self.view
        if view.local is None:
            return (yield from self._put_remote(keys, kv))
        if self.puts.enabled:
            stored_tokens = yield from self._put_leased(keys, kv)
            if stored_tokens is not None:
                view.counters["put_tokens"] += stored_tokens
                return stored_tokens
        reserved = yield from self._reserve_mapped(keys)
        if reserved is None:
            return 0
        reservation_id, slots, mine = reserved
        if mine:
            view.slabs.prefault()  # chunks the node readied ahead since the last put
            slots = slots[: (yield from self._copy_in(keys, kv, reservation_id, mine))]
            view.slabs.prefault()  # and the one it readied after this reserve
        stored_tokens = len(slots) * self.page_tokens  # the prefix that is stored now
        view.counters["put_tokens"] += stored_tokens
        return stored_tokens

    def _put_leased(self, keys: list[PageKey], kv: torch.Tensor) -> Steps[int | None]:
        """Copy the pages into slots leased ahead (fenced, as a reservation's) and leave
        their commit to the committer: no call. The tokens written, or None when too few
        slots are leased (the put then reserves)."""
        puts, slabs = self.puts, self.view.slabs
        places = puts.take(len(keys))
        if places is None:
            return None
        try:
            blocks, mapped = slabs.kv_blocks(places, kv, 0)
        except BaseException:
            puts.give_back(places)  # nothing written: the lease keeps its slots
            raise
        if mapped < len(keys):  # the committer keeps only mapped slots: a torn mapping
            puts.give_back(places)
            return None
        pairs = [(block, kv_rows) for kv_rows, block in blocks]
        try:
            # The slots stay locked until their commit is answered (puts.wrote): a node
            # short of room then cannot revoke a written slot before its page is indexed.
            copied = yield Work(lambda: fenced_copy(slabs, places, pairs, hold=True))
        except BaseException:
            puts.give_back(places)  # uncommitted: rewritten by a later put
            raise
        if not copied:  # the lease lapsed: its slots are the node's again
            puts.fenced_off(places)
            return None
        puts.wrote(keys, places)
        return len(keys) * self.page_tokens

    def _settled(self, timeout_s: float | None = None) -> Steps[bool]:
        """Wait for this client's own leased writes to be committed (read-your-writes), at
        most `timeout_s` (None: the call timeout); whether they all were answered for."""
        puts = self.puts
        if puts is None or not puts.enabled or not puts.unsettled():  # no lock with leasing off
            return True
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        return (yield Work(lambda: puts.settle(wait_s)))

    def _flushed(self, timeout_s: float) -> Steps[bool]:
        settled = yield from self._settled(timeout_s)
        # The node tells the directory of its commits in a flush of its own, in the
        # background: publish makes one now and answers once the shards acknowledged it.
        (reply,) = yield Wait([self.view.home.publish()])
        if failed(reply):
            self.view.note_failures([reply])
        return settled and reply is True

    def _reserve_mapped(self, keys: list[PageKey], tier: int | None = None) -> Steps:
        """reserve (one call), and map what it names: (reservation_id, slots, ours as
        (position, place)), or None when nothing can be put. A VRAM slot on a GPU this process
        does not see (a worker that sees a renumbered subset of the node's GPUs) cannot be
        written here: that reservation goes back and the pages are reserved in host memory
        instead (one more call), so the put still lands."""
        view = self.view
        (reply,) = yield Wait([view.home.reserve(self.geometry, keys, self.namespace, tier)])
        if failed(reply):
            view.note_failures([reply])
            return None
        stamp, reservation_id, slots = reply
        mine = [(p, slot) for p, slot in enumerate(slots) if slot is not None]
        if not mine:
            return reservation_id, slots, mine
        if not (yield from view.slabs.ensure(stamp)):
            view.home.abort(reservation_id)
            return None
        places = as_places([place for _, place in mine])
        if sum(run.count for run, _ in view.slabs.runs(places)) == len(mine):
            return reservation_id, slots, mine
        view.home.abort(reservation_id)
        view.counters["unmapped_pages"] += 1
        if tier == HOST:  # host memory is always mapped: only a torn mapping gets here
            return None
        return (yield from self._reserve_mapped(keys, HOST))

    def _copy_in(self, keys: list[PageKey], kv: torch.Tensor, reservation_id: int,
                 mine: list) -> Steps[int]:
        """Copy the reserved pages in (fenced: only into slots still ours) and commit; returns
        how many leading pages of the put are stored: all of them, or none past the first of
        ours when the copy was fenced off or the commit failed."""
        view, slabs = self.view, self.view.slabs
        places = as_places([place for _, place in mine])  # (tier, slot, generation) reserved
        positions = np.array([p for p, _ in mine], dtype=np.int64)
        blocks, mapped = slabs.kv_blocks(places, kv, positions)  # one per run of slots
        if mapped < len(mine):  # a chunk this process cannot map: nothing written
            view.home.abort(reservation_id)
            view.counters["unmapped_pages"] += 1
            return mine[0][0]
        pairs = [(block, kv_rows) for kv_rows, block in blocks]
        try:
            copied = yield Work(lambda: fenced_copy(slabs, places, pairs))
        except BaseException:
            view.home.abort(reservation_id)
            raise
        if not copied:  # the reservation lapsed before the copy: its slots are not ours
            view.home.abort(reservation_id)
            return mine[0][0]
        (committed,) = yield Wait([view.home.commit(reservation_id)])
        if failed(committed) or committed < len(mine):  # dead node, or our reservation lapsed
            view.note_failures([committed])
            return mine[0][0]
        slabs.remember([keys[p] for p, _ in mine], places)  # a later get reads them directly
        return len(keys)

    def _put_remote(self, keys: list[PageKey], kv: torch.Tensor) -> Steps[int]:
        pages = [kv[:, :, :, page_slices(p, self.page_tokens)].contiguous().view(torch.uint8)
                 .reshape(-1).cpu().numpy() for p in range(len(keys))]
        (stored,) = yield Wait([self.view.home.put_pages(self.geometry, keys, pages,
                                                         self.namespace)])
        if failed(stored):
            self.view.note_failures([stored])
            return 0
        self.view.counters["put_tokens"] += stored * self.page_tokens
        return stored * self.page_tokens

    def _locate(self, keys: list[PageKey]) -> Steps[list]:
        if not keys:
            return []
        yield from self._settled()
        positions, refs = self.view.directory.prefix_refs(keys)
        answers = yield Wait(refs)
        return located_prefix(self.view, keys, answers, positions)

    def _lookup(self, tokens: object) -> Steps[int]:
        """The directory's prefix, or the pages this client saw on its own node (its puts are
        in the directory once the node's next event flush lands)."""
        keys = self.keys(tokens)
        self.view.counters["lookups"] += 1
        located = len((yield from self._locate(keys)))
        slabs = self.view.slabs
        hinted = slabs.num_unchanged(slabs.hinted(keys)) if slabs is not None else 0
        return max(located, hinted) * self.page_tokens

    def _get(self, tokens: object, out: torch.Tensor | None) -> Steps[tuple]:
        keys = self.keys(tokens)
        if out is not None:
            check_out(out, self.spec, len(keys) * self.page_tokens, self.page_tokens)
        if not keys:
            return 0, None
        yield from self._settled()
        num_pages, out = yield from fetch_prefix(self.view, keys, out)
        if num_pages == 0:
            return 0, None
        num_tokens = num_pages * self.page_tokens
        self.view.counters["get_tokens"] += num_tokens
        return num_tokens, out if out.shape[3] == num_tokens else out[:, :, :, :num_tokens]

    def _prefetch(self, tokens: object) -> Steps[int]:
        keys = self.keys(tokens)
        located = yield from self._locate(keys)
        if located:
            home = self.view.home.node_id
            remote: dict[str, list[PageKey]] = {}
            for key, locations in zip(keys, located, strict=False):
                if home not in (node for node, _ in locations):
                    remote.setdefault(locations[0][0], []).append(key)
            self.view.home.prefetch(self.geometry, keys[: len(located)], remote or None)
        return len(located) * self.page_tokens

    def _stats(self) -> Steps[dict]:
        yield from self._settled()
        self.view.flush_touched()  # so that the node's hits include this client's reads
        refs = [self.view.home.stats(), *self.view.directory.stats()]
        node, *directory = yield Wait(refs)
        return {"client": dict(self.counters), "node": _or_error(node),
                "directory": [_or_error(shard) for shard in directory],
                "namespace": self.namespace, "model": self.spec.name,
                "page_tokens": self.page_tokens}


def fenced_copy(slabs: LocalSlabs, places, pairs: list, hold: bool = False) -> bool:
    """Copy `pairs` into the reserved slots `places` (a slot table, or (tier, slot,
    generation) tuples) only while they are still this put's: under the
    slots' write locks, with their generations unmoved since the reserve. False (nothing
    copied) when a lock is held elsewhere or a generation moved: the reservation lapsed, and
    the node may have given the slot to another put. Holding the locks through the copy is
    what keeps the node from reusing a slot under a copy that stalls (tiers/fence.py).
    `hold`: after a copy that went through, keep the locks (the caller lets them go with
    `LocalSlabs.unlock_places`)."""
    places = as_places(places)
    by_tier = {tier: places[places[:, 0] == tier, 1] for tier in np.unique(places[:, 0]).tolist()}
    locked: list[int] = []
    copied = False
    try:
        for tier, slots in by_tier.items():
            if not slabs.fence(tier).lock(slots):
                return False
            locked.append(tier)
        if slabs.num_unchanged(places) < len(places):
            return False
        copy_pages(pairs)
        copied = True
        return True
    finally:
        if not (hold and copied):
            for tier in locked:
                slabs.fence(tier).unlock(by_tier[tier])



def _or_error(result: object) -> object:
    return {"error": str(result)} if failed(result) else result
