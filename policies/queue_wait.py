"""How long a request would wait in a replica's queue, as the cost router estimates it.

Pure, and shared: the live router (cluster/serving/router.py) and the simulator's raykv router
(cluster/core/sim_routers.py) both build their candidates' queue waits here, so that the
simulator feeds `cost_routing.decide` what the service feeds it.

    wait(replica) = requests in flight there x its compute seconds per request

    compute seconds per request: an EWMA of what the replica's requests took to compute (each
                 replica measures its own, cluster/serving/rates.py); before its first, the
                 mean of the others'; before any replica has one, one prefill of this prompt
                 at the replica's prefill rate

No replica reports how far along its running request is, nor what the requests queued there
will cost: the wait is a count times a mean, not the queue's remaining work.
"""

from __future__ import annotations

from collections.abc import Mapping

from policies.cost_routing import Prompt, RateEstimates, ewma, prefill_s


def busy_s_per_request(measured: Mapping[str, float | None]) -> dict[str, float]:
    """Each replica's compute seconds per request (`measured`: what it published, None or 0
    before its first); before its first, the mean of the others' (0.0 when none has one)."""
    known = {replica: busy_s for replica, busy_s in measured.items() if busy_s}
    mean = sum(known.values()) / len(known) if known else 0.0
    return {replica: known.get(replica, mean) for replica in measured}


def queue_waits(prompt: Prompt, queued: Mapping[str, int], busy_s: Mapping[str, float],
                rates: RateEstimates) -> dict[str, float]:
    """Per replica of `queued` (its requests in flight): its estimated queue wait, counting
    each request ahead as `busy_s` of the replica, or, where that is 0 or missing, as one
    prefill of this prompt at the replica's rate."""
    return {replica: count * (busy_s.get(replica)
                              or prefill_s(prompt, 0, rates.prefill_rate(replica)))
            for replica, count in queued.items()}


class BusyMeter:
    """One replica's compute seconds per request, an EWMA of its finished requests' (as
    RateMeter.finished keeps it)."""

    __slots__ = ("busy_s_per_request", "num_requests")

    def __init__(self) -> None:
        self.busy_s_per_request = 0.0
        self.num_requests = 0

    def finished(self, compute_s: float) -> None:
        self.busy_s_per_request = ewma(self.busy_s_per_request, compute_s, self.num_requests)
        self.num_requests += 1
