"""`raykv bench tiers`' host contenders (the module doc of tiers.py): the memcpy limits,
raykv's warm and cold get and its put, Redis and Ray, every one once a round on a Session."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from cluster.core.copies import COPY_THREADS, copy_pages
from cluster.core.kvcheck import page_rows, page_slices, slab_order
from cluster.tools.bench import common, harness, peers
from cluster.tools.bench.tiers_session import GET_REPS, PUT_REPS, Session, _gbps


def memcpy_pairs(session: Session) -> dict[str, list]:
    """The limits' copies: into the page slices of the session's `out` (get) from the pages in
    one private buffer, and from the page slices of its `kv` (put) into another: one block
    each, as a get or a put copies a run of consecutive slots."""
    plan, kv, out = session.plan, session.kv, session.out
    slices = [page_slices(p, plan.page_tokens) for p in range(plan.num_pages)]
    slab_like = torch.stack([kv[:, :, :, s].contiguous() for s in slices])  # a put's run
    target = common.touched_like(slab_like)  # a run of reserved slots, for the put
    return {"memcpy_get": [(page_rows(out, plan.page_tokens), slab_order(slab_like))],
            "memcpy_put": [(slab_order(target), page_rows(kv, plan.page_tokens))]}


def memcpy_contenders(session: Session) -> dict[str, Callable[[int], float]]:
    """The limits: copies.copy_pages (the routine and threads client.get and client.put copy
    with) over memcpy_pairs, the median of GET_REPS after one untimed."""
    plan = session.plan

    def memcpy(pairs: list) -> Callable[[int], float]:
        def run(_: int) -> float:
            seconds = common.warm_median_s(lambda: copy_pages(pairs), GET_REPS)
            for dst, src in pairs:
                common.check_same(dst, src, "a page copied by the memcpy limit")
            return _gbps(plan, seconds)
        return run

    return {name: memcpy(pairs) for name, pairs in memcpy_pairs(session).items()}


def get_gbps(session: Session) -> float:
    """GET_REPS gets of batch 0, after one that asks the node and notes its slots afresh (a
    note is trusted for slabs.HINT_TTL_S): each must copy from the noted slots."""
    plan, counters = session.plan, session.client.counters
    session.forget(0)
    session.get_batch(0)
    before = counters["optimistic_pages"]
    seconds = common.median_s(lambda: session.get_batch(0), GET_REPS)
    session.expect("get", counters["optimistic_pages"] - before == GET_REPS * plan.num_pages,
                   "a warm get asked the node: its slot notes went stale")
    return _gbps(plan, seconds)


def cold_get_gbps(session: Session) -> float:
    """Gets of batch 0, each after the client dropped its notes of it and with the node's
    held-pages index left unread: every page must come through the node's acquire (none
    from a note; `raykv bench pages` times the get that reads the index instead)."""
    plan, counters = session.plan, session.client.counters
    slabs = session.client.view.slabs

    def first_get_s() -> float:
        session.forget(0)
        return common.timed(lambda: session.get_batch(0))[0]

    slabs.use_held = False
    try:
        first_get_s()
        local, optimistic = counters["local_pages"], counters["optimistic_pages"]
        seconds = statistics.median(first_get_s() for _ in range(GET_REPS))
    finally:
        slabs.use_held = True
    session.expect("cold_get", counters["optimistic_pages"] == optimistic and
                   counters["local_pages"] - local == GET_REPS * plan.num_pages,
                   "a cold get did not ask the node for every page")
    return _gbps(plan, seconds)


def peer_contenders(session: Session, redis_url: str) -> dict[str, Callable[[int], float]]:
    """Redis on COPY_THREADS connections and Ray's get in another worker (peers.py), each
    filling a KV tensor laid out as `out` (its page windows); their SET and put figures are
    kept alongside."""
    plan = session.plan
    page_shape = tuple(session.kv[:, :, :, :plan.page_tokens].view(torch.uint8).shape)

    def peer(name: str, measure: Callable[[], dict[str, float]], put: str):
        def run(_: int) -> float:
            figures = measure()
            session.side.setdefault(f"{name}_{put}", []).append(figures[put])
            return figures["get"]
        return run

    return {"redis_get": peer("redis", lambda: peers.redis_gbps(
                redis_url, plan.page_bytes, plan.num_pages, COPY_THREADS, page_shape), "set"),
            "ray_get": peer("ray", lambda: peers.ray_gbps_remote(
                plan.page_bytes, plan.num_pages, page_shape), "put")}


def measure_host(session: Session, redis_url: str) -> dict[str, list[float]]:
    """Batch 0 put and checked byte for byte, a warm-up put; every host contender once a round
    in rotating order; batch 0 checked again, and no page gone to disk. GB/s per round."""
    plan = session.plan
    session.put_batch()
    session.check_batch(0)
    session.put_batch()
    rounds = harness.interleave({
        **memcpy_contenders(session),
        "get": lambda _: get_gbps(session), "cold_get": lambda _: cold_get_gbps(session),
        "put": lambda _: _gbps(plan, common.median_s(session.put_batch, PUT_REPS)),
        **peer_contenders(session, redis_url)}, plan.rounds)
    session.check_batch(0)
    session.expect("put", session.node_stat("disk_bytes_written") == 0,
                   "a host put demoted pages to disk: the host tier was too small")
    return {**rounds, **session.side}
