"""RateMeter: an engine replica's own measurements for cost-based routing.

Per request the engine tells it what it timed:
- the reads its raykv client made (the client's `view.transfers`: per source, bytes and
  seconds of each timed copy out of this node's slabs and each read from other nodes);
- the prefill, timed on the compute thread itself (not the wait for it), with the tokens it
  computed and the context they followed, for the prefill fit (prefill_fit.py: a step's
  overhead, a cost per token and one per attention pair);
- the compute time the request took in all (prefill and decode steps), which, times a
  replica's queue length, is the router's estimate of its queue wait.

They update EWMAs (policies/cost_routing.py). `published()` is what the replica's
`record_routing_stats` hands Serve for its routers, and what `raykv status` shows.
"""

from __future__ import annotations

from cluster.serving.prefill_fit import PrefillFit, attention_pairs, published_prefill
from policies.cost_routing import (
    RateEstimates,
    ewma,
    observe_transfer,
    prior_rates,
    published,
)


class RateMeter:
    """One replica's rates (see module doc); `page_tokens` and `page_bytes` are its pages'."""

    def __init__(self, replica_id: str, page_tokens: int, page_bytes: int) -> None:
        self.replica_id = replica_id
        self.page_tokens, self.page_bytes = page_tokens, page_bytes
        self.rates: RateEstimates = prior_rates()
        self.prefill = PrefillFit()
        self.busy_s_per_request = 0.0
        self.num_requests = 0

    def reads(self, client) -> None:
        """Take the client's timed reads (a client without them, e.g. the local-cache
        baseline's, has none)."""
        transfers = getattr(getattr(client, "view", None), "transfers", None)
        while transfers:
            source, num_bytes, seconds = transfers.popleft()
            self.rates = observe_transfer(self.rates, source, num_bytes, seconds)

    def prefilled(self, num_tokens: int, seconds: float, num_cached: int = 0) -> None:
        """A prefill of `num_tokens` after `num_cached` cached ones took `seconds`."""
        self.prefill.add(num_tokens, seconds, attention_pairs([(num_cached, num_tokens)]))

    def finished(self, compute_s: float) -> None:
        """A request's compute time, prefill and decode steps together."""
        self.busy_s_per_request = ewma(self.busy_s_per_request, compute_s, self.num_requests)
        self.num_requests += 1

    def published(self) -> dict:
        out = published(self.rates, self.replica_id)
        out.update(published_prefill(self.prefill))
        out.update(page_tokens=self.page_tokens, page_bytes=self.page_bytes,
                   busy_s_per_request=self.busy_s_per_request)
        return out
