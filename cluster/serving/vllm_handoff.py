"""The decode side of prefill/decode disaggregation in RaykvConnector: whether a decode's
lookup is asked again because raykv does not hold its prefill's pages yet (the directory
hears of a put at the prefill node's next event flush). Pure: no vLLM, times are given."""

from __future__ import annotations

import logging
from typing import Any

from cluster.serving.vllm_plan import (
    HandoffWaits,
    fetch_limit,
    handoff_mismatch,
    handoff_of,
    tokens_wanted,
)
from cluster.serving.vllm_service import Answer

# logging.getLogger is what vLLM's init_logger returns (with helpers this module does not use)
log = logging.getLogger(__name__)


class DecodeGate:
    """Per decode request, the bounded wait for its prefill's pages (HandoffWaits), for the
    model and namespace this connector keys pages by."""

    def __init__(self, wait_s: float, model: str, namespace: str):
        self.handoffs = HandoffWaits(wait_s)
        self.model = model
        self.namespace = namespace
        self._told_mismatch = False

    def waits(self, request_id: str, answer: Answer, params: Any, num_asked: int,
              now_s: float) -> bool:
        """True while `answer` holds less than the prefill handed over and the request is
        within the wait; False for a request that is no decode, whose handoff names another
        model or namespace (logged once), or that has waited its time (logged: the rest is
        recomputed)."""
        handoff = handoff_of(params)
        if handoff is None or answer.salt is None or answer.page_tokens is None:
            return False
        why = handoff_mismatch(handoff, self.model, self.namespace)
        if why:
            if not self._told_mismatch:
                self._told_mismatch = True
                log.error("raykv P/D: %s; decodes do not wait for their prefill's pages", why)
            return False
        wanted = tokens_wanted(handoff, num_asked, fetch_limit(params))
        if self.handoffs.should_wait(request_id, answer.num_tokens, wanted, now_s):
            return True
        if answer.num_tokens < wanted:
            log.warning("raykv P/D: %s found %d of the prefill's %d tokens within %.1f s; "
                        "recomputing the rest", request_id, answer.num_tokens, wanted,
                        self.handoffs.wait_s)
        return False

    def forget(self, request_id: str) -> None:
        self.handoffs.forget(request_id)
