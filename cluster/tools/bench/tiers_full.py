"""`raykv bench tiers`' puts into a full host tier: a serving node's steady state.

The host rounds (tiers_host.py) put into a tier with room to spare, as a node does only
until its memory first fills. From then on every put needs room that a stored page gives up.
Here the service has a disk tier below a small host tier and demotes ahead of need (the
defaults), is filled past full, and then puts fresh batches at a steady pace:

    full_put         client.put of a fresh batch into the full host tier, one every PACE_S
                     (the node's loop demotes ahead between them: cluster/core/demote_ahead.py);
                     the median of FULL_PUTS a round
    memcpy_put_full  the memcpy limit of the host rounds (tiers_host.memcpy_contenders' pairs),
                     timed as full_put is: one copy every PACE_S, the median of FULL_PUTS

full_put_leased_share: the share of the timed puts' pages that went into leased slots (no
call on the put's path; cluster/puts.py); the rest reserved and made room on their path.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from cluster.core.config import CacheConfig
from cluster.core.copies import copy_pages
from cluster.tools.bench import common, harness
from cluster.tools.bench.tiers_host import memcpy_pairs
from cluster.tools.bench.tiers_session import (
    DISK_HEADER_BYTES,
    PUT_LEASE_BYTES,
    SPEC,
    Session,
    SizePlan,
    _gbps,
)

FULL_HOST_BATCHES = 8  # the host tier, in batches: full after as many puts
FILL_PUTS = FULL_HOST_BATCHES + 8  # past full, through the first puts that found it so
FULL_PUTS = 3  # timed, per round
# Between puts: the gap in which the node demotes ahead. 64 MiB every 0.1 s is 0.67 GB/s of
# new KV per client, about a tenth of what this disk takes (bench tiers' fio_write); a put
# stream that outruns the disk makes its room on its own path, whatever the design.
PACE_S = 0.1


def full_config(plan: SizePlan) -> CacheConfig:
    """A host tier of FULL_HOST_BATCHES batches over a disk tier holding every batch put;
    demotion ahead of need on (the default), unlike the host and disk rounds' service."""
    disk_batches = FILL_PUTS + plan.rounds * FULL_PUTS + 2
    return CacheConfig(page_tokens=plan.page_tokens, device_bytes=0,
                       host_bytes=FULL_HOST_BATCHES * plan.batch_bytes,
                       disk_bytes=disk_batches * plan.num_pages
                       * (DISK_HEADER_BYTES + plan.page_bytes),
                       eviction="lru", disk_codec="none", put_lease_bytes=PUT_LEASE_BYTES,
                       disk_dir=os.path.join(plan.disk_dir,
                                             f"service-full-{plan.page_bytes >> 20}"))


def paced_s(run: Callable[[], object]) -> float:
    """Wait PACE_S, then run(); its seconds."""
    time.sleep(PACE_S)
    return common.timed(run)[0]


def measure_full_puts(plan: SizePlan) -> tuple[dict[str, list[float]], float, dict[str, str]]:
    """The full_put and memcpy_put_full rounds (GB/s); full_put_leased_share; and the
    figures whose path was not taken (figure -> why)."""
    client = common.start_service(full_config(plan), SPEC)
    kv = common.page_kv(SPEC, plan.page_tokens, plan.num_pages)
    session = Session(plan, client, kv, common.touched_like(kv))
    for _ in range(FILL_PUTS):
        paced_s(session.put_batch)
    leased, first = session.node_stat("leased_pages"), session.num_batches
    pairs = memcpy_pairs(session)["memcpy_put"]

    def paced(run: Callable[[], object]) -> Callable[[int], float]:
        return lambda _: _gbps(plan, statistics.median(paced_s(run) for _ in range(FULL_PUTS)))

    rounds = harness.interleave({"memcpy_put_full": paced(lambda: copy_pages(pairs)),
                                 "full_put": paced(session.put_batch)}, plan.rounds)
    session.settle()
    timed_pages = (session.num_batches - first) * plan.num_pages
    leased_share = (session.node_stat("leased_pages") - leased) / timed_pages
    session.check_batch(session.num_batches - 1)
    session.expect("full_put", session.node_stat("disk_bytes_written") > 0,
                   "the host tier never filled: no page went to disk")
    return rounds, leased_share, session.unmet
