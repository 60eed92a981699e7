"""`raykv bench tiers`' phases: a host get and put taken apart through the calls the client
makes, each step timed alone, so that a missed goal shows which step holds the time."""

from __future__ import annotations

import statistics
import time

import numpy as np
import ray

from cluster.client import fenced_copy
from cluster.core.copies import copy_pages
from cluster.core.tiers.slot_table import as_places
from cluster.fetch import copy_pairs
from cluster.tools.bench import common
from cluster.tools.bench.tiers_session import GET_REPS, PUT_REPS, Session, _tokens


def get_phases_s(session: Session) -> dict[str, float]:
    """Medians of GET_REPS of each step of a get of batch 0 (no notes), each step alone."""
    client, out, plan = session.client, session.out, session.plan
    tokens = _tokens(plan, 0)
    keys = client.keys(tokens)

    def acquire_s(with_match: bool) -> float:
        """The node's acquire RPC (with the directory match: sent together and both awaited,
        as fetch_prefix does); its release untimed."""
        def call() -> tuple:
            acquired = client.local.acquire(client.geometry, keys)
            if with_match:
                ray.get(client.directory.prefix_refs(keys)[1])
            return ray.get(acquired)

        seconds, (_, lease, _, _) = common.timed(call)
        ray.get(client.local.release(lease))
        return seconds

    stamp, lease_id, slots, _ = ray.get(client.local.acquire(client.geometry, keys))
    common.map_slabs(client, stamp)
    pairs, _ = copy_pairs(client.view.slabs, as_places(slots), out, 0)  # as the get's
    try:
        copies_s = common.warm_median_s(lambda: copy_pages(pairs), GET_REPS)
    finally:
        ray.get(client.local.release(lease_id))
    median = lambda run: statistics.median(run() for _ in range(GET_REPS))  # noqa: E731
    return {"keys": common.median_s(lambda: client.keys(tokens), GET_REPS),
            "acquire": median(lambda: acquire_s(False)),
            "match": common.median_s(lambda: client.locate_keys(keys), GET_REPS),
            "acquire_and_match": median(lambda: acquire_s(True)), "get_copies": copies_s}


def put_phases_s(session: Session) -> dict[str, float]:
    """One put of a fresh batch, done step by step as client.put does it, each step timed."""
    client, kv = session.client, session.kv
    tokens = session.fresh_tokens()
    keys_s, keys = common.timed(lambda: client.keys(tokens))
    reserve_s, (stamp, reservation_id, slots) = common.timed(
        lambda: ray.get(client.local.reserve(client.geometry, keys)))
    if len(slots) != len(keys) or None in slots:
        raise RuntimeError(f"reserve found room for {len(slots)} of {len(keys)} pages")
    map_s, _ = common.timed(lambda: common.map_slabs(client, stamp))  # a new chunk: mapped
    blocks, _ = client.view.slabs.kv_blocks(as_places(slots), kv, np.arange(len(slots)))
    pairs = [(block, kv_rows) for kv_rows, block in blocks]  # as the put's
    copy = lambda: fenced_copy(client.view.slabs, slots, pairs)  # noqa: E731
    copies_s, copied = common.timed(copy)
    rewrite_s, _ = common.timed(copy)  # the same slots again: their memory now touched
    commit_s, _ = common.timed(lambda: ray.get(client.local.commit(reservation_id)))
    if not copied:
        raise RuntimeError("the put's copy was fenced off: its reservation lapsed")
    return {"put_keys": keys_s, "reserve": reserve_s, "put_map": map_s, "put_copies": copies_s,
            "put_copies_rewrite": rewrite_s, "commit": commit_s}


def leased_put_phases_s(session: Session) -> dict[str, float]:
    """One put of a fresh batch into the client's leased slots, step by step as client.put
    does it (take, fenced copy), and then the committer's call that commits it and tops the
    lease up again (mapping and faulting in the new slots), waited for."""
    client, kv, puts = session.client, session.kv, session.client.puts
    num_pages = session.plan.num_pages
    if not puts.settle(client.timeout_s):
        raise RuntimeError("the client's commits were not answered in time")
    deadline_s = time.monotonic() + client.timeout_s
    while len(puts.pool.free) < num_pages and time.monotonic() < deadline_s:
        time.sleep(0.005)  # the committer's top-up after the last put, in flight
    keys = client.keys(session.fresh_tokens())
    take_s, places = common.timed(lambda: puts.take(num_pages))
    if places is None:
        raise RuntimeError("the lease held too few slots for a batch")
    slabs = client.view.slabs
    blocks, _ = slabs.kv_blocks(places, kv, np.arange(num_pages))
    pairs = [(block, kv_rows) for kv_rows, block in blocks]
    copies_s, copied = common.timed(lambda: fenced_copy(slabs, places, pairs, hold=True))
    if not copied:
        raise RuntimeError("a leased put's copy was fenced off: its lease lapsed")
    puts.wrote(keys, places)
    commit_s, _ = common.timed(lambda: puts.settle(client.timeout_s))
    steps = {f"leased_call_{name}": step_s for name, step_s in puts.last_call_s.items()}
    return {"leased_take": take_s, "leased_copies": copies_s,
            "leased_commit_and_top_up": commit_s, **steps}


def phases_ms(session: Session) -> dict[str, float]:
    phases = get_phases_s(session)
    puts = [put_phases_s(session) | leased_put_phases_s(session) for _ in range(PUT_REPS)]
    names = dict.fromkeys(name for p in puts for name in p)  # a failed call has fewer steps
    phases.update({name: statistics.median(p[name] for p in puts if name in p)
                   for name in names})
    return {name: seconds * 1e3 for name, seconds in phases.items()}
