"""How long a vLLM engine's step may wait on raykv (no vLLM import).

Asynchronous, raykv costs a request whole engine steps: vLLM asks again about a request
whose lookup is out only after the step it runs meanwhile, and it schedules a request whose
load runs in the background only in the step after the worker reports the load done. Under
load a step is tens of milliseconds on a CPU engine, and a lookup or a load of a few pages
from this node's host tier is a few. And the background threads share one Python process
(one GIL) with the engine's busy loop, which slows them: a load of 19 pages took 215 to 390
ms in the loader thread and 6 to 9 ms in the step (docs/benchmarks.md, vllm). Waiting inside
the step instead costs every request in the step the wait.

So each step may spend on raykv at most what one of its requests' places in it is worth to
the batch: the measured step time divided by the requests the step carries (`StepBudget`).
An engine that runs no request (`idle`) holds nobody up by waiting: its lookups are waited
for whatever their estimate, each at most one step's measured time (and 1 ms). Not
waiting there cost the request whole steps for nothing, and the engine's empty steps, spun
while the lookup was out, took the GIL from the lookup thread: a follow-up turn whose prompt
vLLM held but for its last 48 tokens took 35 ms against 14 without the connector
(docs/benchmarks.md, vllm).
The scheduler side waits for a lookup whose measured time fits what is left, and makes a load
whose estimate fits in the step (vLLM's synchronous load: the worker fills the blocks before
the forward reads them), bounded by what recomputing its tokens would take, and at least one
step (`sync_deadline_s`): a load past it is a miss, recomputed, never a stall, and its time
a bound that the next estimate of its size does not go below, so a load estimated past its
deadline runs in the background instead (`may_load_in_step`). Nothing is
waited for before the engine has timed a step; a lookup is waited for once one was timed,
and a load is estimated from the loads made in the step (before any, the host copy prior).

LOAD_MODES are the connector's `raykv.load_mode`: "auto" (the budget decides), "async"
(never wait: every lookup and load is off the step) and "sync" (always wait, each lookup and
load bounded by the client's call timeout, as LMCache's connector does by default).

Saves (`raykv.save_mode`, the same three words; `StepBudget.save_waits`). A save's put runs
in the worker's saver thread and its commit in the client's committer thread, and the same
busy loop slows both: its commit's round trip took 10 to 560 ms while the writing engine
decoded, against 10 ms idle, and the writing engine could finish its request, and another
engine ask for the prompt, before the pages were in the directory (a miss, recomputed). So a
save also flushes (KVClient.flush: committed, and the directory told), and a step waits for it:
"auto", the step after the one that saved waits (in start_load_kv, before its outputs), at
most what recomputing the saved tokens would take (the reader's loss when it misses them) and
at least one step, so the request's first token is not delayed and its pages are in the
directory before its next one; only for requests still running (one that finished as it
saved, as a max_tokens 1 prefill does, has its output out: waiting cannot help it), and only
for the save that ends a prefill: a chunk of a long prompt whose prefill goes on in the next
step has no output to come before (its flush runs in the background, and the wait after the
last chunk's save waits for it too). On an idle CPU engine those waits were short: a
1,024-token prompt prefilled in 4 chunks took 5 % longer than with no connector, with them
and without them alike (docs/benchmarks.md, vllm-serve); under load a flush takes longer;
"sync", the saving step itself waits, at most the call timeout (before its first token);
"async", no step waits, and a save is visible when its commit lands.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass, field

from policies.cost_routing import ewma

LOAD_MODES = ("auto", "async", "sync")


def checked_load_mode(mode: str, setting: str = "raykv.load_mode") -> str:
    """`mode` if it is one of LOAD_MODES; ValueError naming `setting` and them otherwise."""
    if mode not in LOAD_MODES:
        raise ValueError(f"{setting} must be one of {list(LOAD_MODES)}, got {mode!r}")
    return mode


def settle_bound_s(step_s: float, recompute_s: float) -> float:
    """How long a step waits on raykv at most, outside "sync": what recomputing the tokens
    concerned would take, and at least one step's measured time (and 1 ms)."""
    return max(step_s, recompute_s, 1e-3)


@dataclass(slots=True)
class StepBudget:
    """The wait a step may spend on raykv (module doc). `step_timed` feeds it each step's
    seconds; `step_started` refills it as the scheduler hands a step out."""

    mode: str = "auto"
    step_s: float = 0.0  # EWMA of the timed steps' seconds
    num_steps: int = 0
    num_requests: int = 1  # in the last step handed out
    remaining_s: float = 0.0
    idle: bool = False  # no request runs in the engine: a wait holds nobody up (module doc)
    save_mode: str = "auto"
    # request id -> the tokens its saves handed the worker in the last step built
    last_saves: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        checked_load_mode(self.mode)
        checked_load_mode(self.save_mode, "raykv.save_mode")

    def step_timed(self, seconds: float) -> None:
        """A step with tokens took `seconds`."""
        if seconds > 0:
            self.step_s = ewma(self.step_s, seconds, self.num_steps)
            self.num_steps += 1

    def step_started(self, num_requests: int) -> None:
        """A step of `num_requests` was handed out: the next schedule's budget, its share."""
        self.num_requests = max(1, num_requests)
        self.remaining_s = self.per_step_s()

    def per_step_s(self) -> float:
        """A step's whole budget: its time over its requests (0 before a step is timed)."""
        return self.step_s / self.num_requests if self.num_steps else 0.0

    def may_wait(self, estimate_s: float | None) -> bool:
        """Whether a wait estimated at `estimate_s` (None: never measured) fits what is left
        of this step's budget ("sync": always; "async": never)."""
        if self.mode != "auto":
            return self.mode == "sync"
        return self.num_steps > 0 and estimate_s is not None \
            and 0.0 <= estimate_s <= self.remaining_s

    def may_load_in_step(self, estimate_s: float | None, deadline_s: float) -> bool:
        """may_wait, and ("auto") the load is estimated to end before its deadline
        (sync_deadline_s): one estimated past it would be cut there, a miss that costs the
        step the wait and the request its load; in the background it ends."""
        if self.mode == "auto" and estimate_s is not None and estimate_s >= deadline_s:
            return False
        return self.may_wait(estimate_s)

    def may_wait_for_lookup(self, estimate_s: float | None) -> bool:
        """may_wait, and always in an idle engine ("auto"): a lookup waited for there costs
        no other request anything, and it is bounded by wait_limit_s. (A load is not: an
        engine that has timed nothing yet would bound it by 1 ms, and miss it.)"""
        if self.mode == "auto" and self.idle:
            return True
        return self.may_wait(estimate_s)

    def spend(self, seconds: float) -> None:
        """Charge a wait to this step's budget."""
        self.remaining_s = max(0.0, self.remaining_s - max(0.0, seconds))

    def wait_limit_s(self, call_timeout_s: float) -> float:
        """How long a lookup judged to fit may be waited for: what is left of the budget
        ("sync": the call timeout; an idle engine: one step's measured time, and 1 ms)."""
        if self.mode == "sync":
            return call_timeout_s
        return settle_bound_s(self.step_s, 0.0) if self.idle else self.remaining_s

    def sync_deadline_s(self, call_timeout_s: float, recompute_s: float = 0.0) -> float:
        """The bound on a load made in the step ("sync": the call timeout): what recomputing
        its tokens would take (`recompute_s`, at the engine's measured prefill rate), and at
        least one step's measured time. A load still out past it is a miss that vLLM
        recomputes: past that point waiting costs more than recomputing, and a stalled raykv
        holds the step no longer."""
        if self.mode == "sync":
            return call_timeout_s
        return settle_bound_s(self.step_s, recompute_s)

    def save_waits(self, saving: dict[str, int], running: Container[str],
                   call_timeout_s: float, recompute_s: Callable[[int], float],
                   ending: Container[str] | None = None) -> tuple[float | None, float | None]:
        """For a step whose saves hand the worker `saving` (request id -> tokens): (how long
        the worker waits in it for the saves of the step before, how long for its own), None
        for no wait (module doc: "auto", "sync", "async"). `running`: the requests not
        finished yet; `recompute_s(n)`: what computing n tokens takes this engine; `ending`:
        the requests of `saving` whose save holds their prompt's last full page, no chunk of
        a longer prefill (None: all of them).

        "auto" waits only for the saves of requests still running. One that finished in the
        step that saved it (a prefill with max_tokens 1, a stop token) has its output out
        already: a wait could not put its pages in the directory before that, and would only
        hold up the other requests of the step. Nor for a save whose prefill goes on (a chunk
        of a long prompt): no output of its request comes before the next chunk's."""
        last = self.last_saves
        self.last_saves = {request_id: tokens for request_id, tokens in saving.items()
                           if ending is None or request_id in ending}
        if self.save_mode == "sync":
            return None, call_timeout_s if any(saving.values()) else None
        waited = sum(tokens for request_id, tokens in last.items() if request_id in running)
        if self.save_mode == "async" or not waited:
            return None, None
        return settle_bound_s(self.step_s, recompute_s(waited)), None
