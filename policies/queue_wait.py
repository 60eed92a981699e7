"""How long a request would wait in a replica's queue, as the cost router estimates it.

Pure, and shared: the live router (cluster/serving/router.py) and the simulator's raykv router
(cluster/core/sim_routers.py) both build their candidates' queue waits here, with one class
(VirtualQueue), so that the simulator feeds `cost_routing.decide` what the service feeds it.

    wait(replica) = the predicted seconds of work this router sent there still ahead
                    (VirtualQueue: each routed request adds the time `decide` priced it at
                    on that replica, fetch of its cut + prefill of the rest; the replica
                    works it off with the clock; it drains when none of this router's
                    requests is left in flight there)
                  + requests there that other routers sent (the replica's count as the router
                    knows it, less its own, never below 0) x its compute seconds per request

    A replica where one of this router's requests is still in flight after its predicted
    work ran out waits at least one engine step (its measured step overhead, the prefill
    fit's fixed part: cluster/serving/prefill_fit.py): the request is running, in a step a
    new one cannot start before. Without that floor an overdue replica read as idle, and won
    ties against idle ones: in a quick vllm-serve run, 10 of 226 requests went to a replica
    with a request in flight while another had none, 4 of them on a tie (docs/benchmarks.md,
    vllm-serve: what the router decided, logged).

    compute seconds per request: an EWMA of what the replica's requests took to compute (each
                 replica measures its own, cluster/serving/rates.py); before its first, the
                 mean of the others'; before any replica has one, one prefill of this prompt
                 at the replica's prefill rate and attention term

No replica reports how far along its running request is, nor what the requests queued there
will cost: the router's own requests are priced as it routed them; only the others' are a
count times a mean. (Until 7 December the whole wait was a count times a mean: on the
Mooncake trace at 16 nodes it lost to the Mooncake-like router, docs/simulator.md.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from policies.cost_routing import Prompt, RateEstimates, ewma


def own_or_mean(measured: Mapping[str, float | None]) -> dict[str, float]:
    """Each replica's own figure (`measured`: what it published, None or 0 before it has one:
    its compute seconds per request, its step overhead), else the mean of the others' (0.0
    when none has one): replicas of a deployment run one model."""
    known = {replica: value for replica, value in measured.items() if value}
    mean = sum(known.values()) / len(known) if known else 0.0
    return {replica: known.get(replica, mean) for replica in measured}


def queue_waits(prompt: Prompt, queue: VirtualQueue, reported: Mapping[str, int | None],
                busy_s: Mapping[str, float], rates: RateEstimates, now_s: float,
                step_s: Mapping[str, float] | None = None) -> dict[str, float]:
    """Per replica of `reported`: its estimated queue wait, the seconds of work this router
    sent there that are still ahead (`queue`), at least `step_s` (its step overhead) while
    one of them is in flight, plus the requests the replica holds beyond this router's own
    (`reported`, its count of requests in flight as the router knows it, None where it knows
    none) at `busy_s` each, or where that is 0 or missing, one prefill of this prompt at the
    replica's rate."""
    per_request = {replica: busy_s.get(replica)
                   or rates.prefill_s(prompt, 0, replica) for replica in reported}
    return queue.waits(reported, now_s, reported, per_request, step_s)


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


class VirtualQueue:
    """Per replica, the predicted seconds of work that this router sent there and that is
    not done: a virtual queue, kept from the router's own routing and its requests'
    completions.

        routed r, work w:  busy_until[r] = max(now, busy_until[r]) + w
        wait(r):           max(0, busy_until[r] - now)
                           + (requests the replica reports beyond this router's own)
                             x its compute seconds per request   (other routers' requests)
        completed:         the request's entry goes; a replica with none of this router's
                           requests left has drained: busy_until[r] = now

    `w` is the request's predicted time on r as `cost_routing.decide` priced it (the fetch
    of its cut and the prefill of the rest at r's rate). Completion is heard when the whole
    request ends (Serve's `on_request_completed`), so a replica's virtual queue counts only
    down with the clock between routings, not with its prefills. Entries are keyed by the
    request's id; one whose completion never came (a request chosen but not dispatched, a
    lost callback) expires `ttl_s` after it was routed, and at most `max_entries` are kept
    (the oldest go first), each expiry counted as a completion."""

    def __init__(self, ttl_s: float = 600.0, max_entries: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.busy_until: dict[str, float] = {}
        self.entries: dict[object, tuple[str, float, float]] = {}  # id -> (replica,
        # routed at, work)
        self.in_flight: dict[str, int] = {}
        self.expired = 0

    def routed(self, replica: str, request_id: object, work_s: float, now_s: float) -> None:
        """This router sent `request_id` to `replica`, predicted to take `work_s` there."""
        self.expire(now_s)
        self.withdraw(request_id, now_s)  # routed again (Serve retries a choice): once
        work_s = max(0.0, work_s)
        self.busy_until[replica] = max(now_s, self.busy_until.get(replica, now_s)) + work_s
        self.entries[request_id] = (replica, now_s, work_s)
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1
        while len(self.entries) > self.max_entries:
            self._drop(next(iter(self.entries)), now_s)
            self.expired += 1

    def moved(self, request_id: object, replica: str, now_s: float) -> None:
        """The request went to `replica`, not where it was recorded (Serve took a later
        rank): its work moves with it."""
        entry = self.entries.get(request_id)
        if entry is None or entry[0] == replica:
            return
        self.withdraw(request_id, now_s)
        self.busy_until[replica] = max(now_s, self.busy_until.get(replica, now_s)) + entry[2]
        self.entries[request_id] = (replica, entry[1], entry[2])
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1

    def withdraw(self, request_id: object, now_s: float) -> None:
        """Take back a recorded request that did not go where recorded (routed again, or
        moved): its entry, and its work off its replica's virtual queue."""
        entry = self.entries.get(request_id)
        if entry is None:
            return
        replica = self._drop(request_id, now_s)
        if replica in self.in_flight:
            self.busy_until[replica] = max(now_s, self.busy_until[replica] - entry[2])

    def completed(self, request_id: object, now_s: float) -> str | None:
        """The request ended (at `now_s`); its replica, or None when it was not recorded
        (already completed or expired, or routed by another router)."""
        if request_id not in self.entries:
            return None
        return self._drop(request_id, now_s)

    def _drop(self, request_id: object, now_s: float) -> str:
        replica = self.entries.pop(request_id)[0]
        left = self.in_flight.get(replica, 0) - 1
        if left <= 0:
            self.in_flight.pop(replica, None)
            self.busy_until[replica] = now_s  # drained: nothing of ours left there
        else:
            self.in_flight[replica] = left
        return replica

    def expire(self, now_s: float) -> None:
        """Drop the entries routed more than `ttl_s` ago (in routing order)."""
        entries, horizon = self.entries, now_s - self.ttl_s
        while entries:
            request_id, (_, routed_s, _) = next(iter(entries.items()))
            if routed_s >= horizon:
                break
            self._drop(request_id, now_s)
            self.expired += 1

    def wait_s(self, replica: str, now_s: float) -> float:
        """The seconds of this router's work still ahead at `replica`."""
        return max(0.0, self.busy_until.get(replica, now_s) - now_s)

    def waits(self, replicas: Iterable[str], now_s: float,
              reported: Mapping[str, int | None] | None = None,
              busy_s: Mapping[str, float] | None = None,
              step_s: Mapping[str, float] | None = None) -> dict[str, float]:
        """Per replica: its queue wait, this router's virtual queue (at least `step_s`, the
        replica's step overhead, while one of this router's requests is in flight there: the
        module doc) plus the requests the replica is known to hold beyond this router's
        (`reported`: Serve's count, None where it keeps none) at `busy_s` seconds each (its
        compute seconds per request)."""
        self.expire(now_s)
        reported, busy_s, step_s = reported or {}, busy_s or {}, step_s or {}
        out = {}
        for replica in replicas:
            own = self.in_flight.get(replica, 0)
            others = max(0, (reported.get(replica) or 0) - own)
            ahead_s = self.wait_s(replica, now_s)
            if own:
                ahead_s = max(ahead_s, step_s.get(replica, 0.0))
            out[replica] = ahead_s + others * busy_s.get(replica, 0.0)
        return out
