"""What the scheduler side of RaykvConnector decides each step (pure: no vLLM, no Ray).

    get_num_new_matched_tokens  ->  keyed() + matched(): the request's key salt and raykv's
                                    hit (from its asynchronous lookup), cut to whole blocks,
                                    kept per request (asked again, as for a preempted request,
                                    vLLM's own count is taken afresh and raykv is not asked
                                    again)
    update_state_after_alloc    ->  allocated(): a LoadSpec into the request's new blocks; the
                                    worker loads it in the background while vLLM holds the
                                    request in WAITING_FOR_REMOTE_KVS
    update_connector_output     ->  reported(): the loads the workers finished, and the blocks
                                    they could not fill: a request whose load fell short is
                                    not offered those tokens again (vLLM would ask again, and
                                    fail again, forever)
    build_connector_meta        ->  step(): the loads allocated since the last step, and
                                    SaveSpecs for the new full pages the step's forward computes
    request_finished            ->  finished(): forget the request

A request's prompt pages are saved as they are computed (chunked prefill saves page by page);
each save holds only the pages new since the last: the pages it loaded, or that were saved
before, are not copied again. Generated tokens are not saved: the next turn's prompt holds
them and saves them then. A request without a salt (its lookup failed, or raykv cannot key
it) is never saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The keys in a request's kv_transfer_params (vLLM's OpenAI field, carried to the
# scheduler's Request) under which raykv's router sends what it decided:
# - its cut: the most prompt tokens to load (it found fetching the rest slower);
# - its hit: the prompt tokens raykv's directory held when it routed the request. The
#   connector takes that as its lookup's answer, so that the request is scheduled at its
#   first step rather than one engine step later (an asynchronous lookup answers "ask
#   again" first, and vLLM asks again only after the step it then runs).
FETCH_LIMIT_KEY = "raykv_max_fetch_tokens"
HIT_KEY = "raykv_hit_tokens"
# A client's, for checking the router's choice by running both (`raykv bench vllm-serve`'s
# recompute part): the cut to apply whatever the router decides (0: recompute the whole
# prefix; more than the prompt: load all raykv holds). It changes only what the request's
# own engine loads of pages raykv holds under its own keys, as the router's cut does.
FORCE_KEY = "raykv_force_max_fetch_tokens"
# The connector's, in the kv_transfer_params of a finished request it loaded pages for (the
# completion's response carries them): the prompt tokens its loads filled, and those it was
# to fill and did not. A load that falls short is recomputed from its first unfilled block,
# and vLLM's `cached_tokens` still counts what the load was to fill (the prefill's stats are
# taken when the request is first scheduled): the unfilled tokens are to be taken off it.
LOADED_KEY = "raykv_loaded_tokens"
UNFILLED_KEY = "raykv_unfilled_tokens"


def _tokens_param(kv_transfer_params: Any, key: str) -> int | None:
    """A non-negative int under `key`, else None: a client's odd params never fail a
    request."""
    if not isinstance(kv_transfer_params, dict):
        return None
    value = kv_transfer_params.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def load_outcome_of(kv_transfer_params: Any) -> tuple[int | None, int]:
    """From a finished request's kv_transfer_params: the tokens raykv's loads filled (None:
    the connector said nothing) and those vLLM counts as cached that they did not fill."""
    return (_tokens_param(kv_transfer_params, LOADED_KEY),
            _tokens_param(kv_transfer_params, UNFILLED_KEY) or 0)


def served_tokens(vllm_cached_tokens: int, kv_transfer_params: Any) -> int:
    """The prompt tokens a cache served a finished request: vLLM's count less what raykv's
    loads did not fill (a connector that says nothing leaves vLLM's count)."""
    _, unfilled = load_outcome_of(kv_transfer_params)
    return max(vllm_cached_tokens - unfilled, 0)


def fetch_limit(kv_transfer_params: Any) -> int | None:
    """The router's cut, if the request carries one: load at most this many prompt tokens and
    recompute the rest (the router found fetching them slower). None: load the whole hit.
    Anything but a non-negative int is ignored."""
    return _tokens_param(kv_transfer_params, FETCH_LIMIT_KEY)


def routed_hit(kv_transfer_params: Any) -> int | None:
    """The prompt tokens raykv held when the router placed the request (None: no router
    said). A hint, never trusted further than a load: pages gone since are not loaded, and
    vLLM recomputes them (the connector's failure policy). A client that sends its own
    value (raykv's router replaces it) only changes what its own request tries to load,
    under its own keys."""
    return _tokens_param(kv_transfer_params, HIT_KEY)


def forced_fetch_limit(kv_transfer_params: Any) -> int | None:
    """The cut the client forces (FORCE_KEY), if any (anything but a non-negative int is
    ignored)."""
    return _tokens_param(kv_transfer_params, FORCE_KEY)


def with_fetch_limit(kv_transfer_params: Any, max_fetch_tokens: int | None) -> dict | None:
    """kv_transfer_params carrying the cut (None: no cut; the request's other params kept)."""
    return _with_tokens(kv_transfer_params, FETCH_LIMIT_KEY, max_fetch_tokens)


def with_routed_hit(kv_transfer_params: Any, hit_tokens: int | None) -> dict | None:
    """kv_transfer_params carrying the router's hit (None: none; other params kept)."""
    return _with_tokens(kv_transfer_params, HIT_KEY, hit_tokens)


def _with_tokens(kv_transfer_params: Any, key: str, num_tokens: int | None) -> dict | None:
    params = dict(kv_transfer_params) if isinstance(kv_transfer_params, dict) else {}
    params.pop(key, None)
    if num_tokens is not None:
        params[key] = int(num_tokens)
    return params or None


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load tokens [start, len(token_ids)) of the request from raykv into its blocks
    (block_ids: the request's blocks from its first token on), keyed under `salt`. A load
    with `sync_timeout_s` is made in the step, before the forward, within that many seconds
    (vLLM's synchronous load: step_budget.py); one without it runs in the background."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    salt: bytes = b""
    sync_timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Save the full pages of token_ids from token `start` on (a page boundary: raykv holds
    the pages before it); block_ids hold tokens [start, len(token_ids)), in order."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int = 0
    salt: bytes = b""
    keep: bool = False  # a prefill's pages for a remote decode: never dropped when busy
    final: bool = True  # it holds the prompt's last full page: no later save of its prompt


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request scheduled for the first time in this step."""

    request_id: str
    prompt: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(frozen=True, slots=True)
class RunningRequest:
    """A request scheduled again: new_block_ids are appended, or replace all after a
    preemption (resumed)."""

    request_id: str
    new_block_ids: list[int] | None
    resumed: bool
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(slots=True)
class _Tracked:
    prompt: list[int]
    block_ids: list[int]
    saved_tokens: int
    salt: bytes


def loadable_tokens(block_size: int, prompt_len: int) -> int:
    """The whole blocks before the prompt's last token: the most vLLM's own prefix cache can
    give a prompt (it computes the last token's block itself, for the last position's
    logits). An engine that holds this much asks raykv nothing."""
    return max(prompt_len - 1, 0) // block_size * block_size


def asked_tokens(block_size: int, prompt_len: int) -> int:
    """The prefix the connector asks raykv for: every whole block of the prompt. When raykv
    holds them all, vLLM is handed all but the prompt's last token (handed_tokens), as
    LMCache does, and computes that one token, not its whole last block."""
    return prompt_len // block_size * block_size


def raykv_can_add(num_asked: int, page_tokens: int, num_local_tokens: int) -> bool:
    """Whether raykv could hold more of the asked prefix than vLLM's own cache does: it
    answers in whole pages, so not when the asked prefix's whole pages end within vLLM's hit
    (a prompt shorter than a page, say: 17 to 255 tokens at 16-token blocks and 256-token
    pages would each cost a lookup, and maybe an engine step, for an answer of 0)."""
    return num_asked // page_tokens * page_tokens > num_local_tokens


def handed_tokens(hit_end: int, prompt_len: int) -> int:
    """The prompt tokens vLLM takes as computed from a hit of `hit_end` tokens: at most all
    but the last, whose logits vLLM needs."""
    return min(hit_end, max(prompt_len - 1, 0))


def page_misfit(block_size: int, page_tokens: int) -> str | None:
    """Why raykv pages of `page_tokens` cannot hold vLLM blocks of `block_size`, or None: a
    page must be whole blocks."""
    if page_tokens % block_size:
        return (f"the raykv service's pages are {page_tokens} tokens, not a multiple of "
                f"vLLM's {block_size}-token blocks (start raykv with page_tokens a multiple "
                f"of the block size)")
    return None


@dataclass(slots=True)
class StepPlanner:
    """Per-request bookkeeping of the scheduler side; see the module docstring."""

    block_size: int
    page_tokens: int
    hits: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (local, raykv end)
    salts: dict[str, bytes] = field(default_factory=dict)  # id -> key salt (keyed requests)
    loads: list[LoadSpec] = field(default_factory=list)  # allocated, not in a step yet
    loading: dict[str, LoadSpec] = field(default_factory=dict)  # id -> its load, until done
    tracked: dict[str, _Tracked] = field(default_factory=dict)
    producers: set[str] = field(default_factory=set)  # prefills for a remote decode (P/D)
    # id -> (vLLM's own cached tokens, their end with raykv's as vLLM counts them, the end of
    # what its loads filled: cut back to the first block a worker could not fill)
    filled: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    def asked_tokens(self, prompt_len: int) -> int:
        return asked_tokens(self.block_size, prompt_len)

    def keyed(self, request_id: str, salt: bytes) -> None:
        """The request's pages are keyed under `salt` (b"": the model's own chain)."""
        self.salts[request_id] = salt

    def matched(self, request_id: str, num_local_tokens: int, num_cached_tokens: int,
                prompt_len: int) -> int:
        """Record raykv's hit for the request (whole blocks); the tokens vLLM takes from it
        beyond its own (at most all but the prompt's last token)."""
        end = min(num_cached_tokens, prompt_len) // self.block_size * self.block_size
        self.hits[request_id] = (num_local_tokens, end)
        return max(handed_tokens(end, prompt_len) - num_local_tokens, 0)

    def rematched(self, request_id: str, num_local_tokens: int, prompt_len: int) -> int:
        """matched() for a request asked about again (preempted, or not placed yet): its hit,
        or the pages it saved itself since, whichever reach further."""
        end = self.hits[request_id][1]
        tracked = self.tracked.get(request_id)
        if tracked is not None:
            end = max(end, min(tracked.saved_tokens, self.asked_tokens(prompt_len)))
        return self.matched(request_id, num_local_tokens, end, prompt_len)

    def allocated(self, request_id: str, prompt: list[int], block_ids: list[int],
                  num_external_tokens: int, sync_timeout_s: float | None = None) -> None:
        """vLLM gave the request blocks for its raykv hit: load it in the next step (in the
        step itself, within `sync_timeout_s`, when given)."""
        if num_external_tokens <= 0 or request_id not in self.salts:
            return
        local, _ = self.hits.get(request_id, (0, 0))
        # Whole blocks: a hit of the whole prompt is handed over less its last token, and its
        # last block is loaded whole (vLLM then writes that token's KV over the same values).
        end = min(-(-(local + num_external_tokens) // self.block_size) * self.block_size,
                  len(prompt))
        load = LoadSpec(request_id, prompt[:end], list(block_ids), local, self.salts[request_id],
                        sync_timeout_s)
        self.loads.append(load)
        self.loading[request_id] = load
        self.filled[request_id] = (local, local + num_external_tokens, end)

    def load_outcome(self, request_id: str) -> dict[str, int] | None:
        """What the request's loads filled of the prompt, and what vLLM counts as cached of
        it that they did not fill, under LOADED_KEY and UNFILLED_KEY (None: no load)."""
        filled = self.filled.get(request_id)
        if filled is None:
            return None
        local, counted_end, end = filled
        return {LOADED_KEY: max(min(end, counted_end) - local, 0),
                UNFILLED_KEY: max(counted_end - end, 0)}

    def reported(self, finished: set[str], failed_block_ids: set[int]) -> None:
        """The workers finished the loads of `finished`; `failed_block_ids` they could not
        fill. raykv does not hold what a load could not fill: the request's hit ends there,
        and its pages from there on are saved again."""
        for request_id, load in list(self.loading.items()):
            first_block = load.start // self.block_size
            last_block = -(-len(load.token_ids) // self.block_size)
            failed = [index for index in range(first_block, last_block)
                      if load.block_ids[index] in failed_block_ids]
            if failed:
                self._held_up_to(request_id, failed[0] * self.block_size)
                if request_id in self.filled:
                    local, counted_end, end = self.filled[request_id]
                    self.filled[request_id] = (local, counted_end,
                                               min(end, failed[0] * self.block_size))
            if request_id in finished:
                del self.loading[request_id]

    def step(self, new: list[NewRequest],
             running: list[RunningRequest]) -> tuple[list[LoadSpec], list[SaveSpec]]:
        loads, self.loads = self.loads, []
        saves = [save for request in new if (save := self._track_new(request))]
        saves += [save for request in running if (save := self._track_running(request))]
        return loads, saves

    def forget_unloading(self) -> int:
        """Forget every request but those whose load is planned or under way (a cache reset:
        the rest are asked, keyed and saved afresh); how many were forgotten."""
        busy = set(self.loading) | {load.request_id for load in self.loads}
        idle = (set(self.hits) | set(self.salts) | set(self.tracked) | set(self.filled)) - busy
        for request_id in idle:
            self.finished(request_id)
        return len(idle)

    def finished(self, request_id: str) -> None:
        for table in (self.hits, self.salts, self.tracked, self.loading, self.filled):
            table.pop(request_id, None)
        self.producers.discard(request_id)
        self.loads = [load for load in self.loads if load.request_id != request_id]

    def _held_up_to(self, request_id: str, num_tokens: int) -> None:
        local, end = self.hits.get(request_id, (0, 0))
        self.hits[request_id] = (local, min(end, num_tokens))
        tracked = self.tracked.get(request_id)
        if tracked is not None:
            tracked.saved_tokens = min(tracked.saved_tokens, num_tokens)

    def _track_new(self, request: NewRequest) -> SaveSpec | None:
        salt = self.salts.get(request.request_id)
        if salt is None:
            return None
        _, hit_end = self.hits.get(request.request_id, (0, 0))
        # A load that fell short left vLLM's count below the hit: the rest is saved again. A
        # hit of the whole prompt left vLLM's count one short of it (handed_tokens): raykv
        # holds that last page already.
        whole_prompt = 0 < hit_end == len(request.prompt)
        held = min(hit_end, request.num_computed_tokens + int(whole_prompt))
        tracked = _Tracked(request.prompt, list(request.block_ids), held, salt)
        self.tracked[request.request_id] = tracked
        return self._save(request.request_id, tracked,
                          request.num_computed_tokens + request.num_scheduled_tokens)

    def _track_running(self, request: RunningRequest) -> SaveSpec | None:
        tracked = self.tracked.get(request.request_id)
        if tracked is None:
            return None
        if request.resumed and request.new_block_ids is not None:
            tracked.block_ids = list(request.new_block_ids)
        elif request.new_block_ids:
            tracked.block_ids.extend(request.new_block_ids)
        return self._save(request.request_id, tracked,
                          request.num_computed_tokens + request.num_scheduled_tokens)

    def _save(self, request_id: str, tracked: _Tracked, num_computed: int) -> SaveSpec | None:
        """The prompt's full pages computed by the end of this step, if any are new."""
        end = min(num_computed, len(tracked.prompt)) // self.page_tokens * self.page_tokens
        if end <= tracked.saved_tokens:
            return None
        start = tracked.saved_tokens // self.page_tokens * self.page_tokens
        tracked.saved_tokens = end
        blocks = tracked.block_ids[start // self.block_size: -(-end // self.block_size)]
        return SaveSpec(request_id, tracked.prompt[:end], blocks, start, tracked.salt,
                        request_id in self.producers,
                        end == len(tracked.prompt) // self.page_tokens * self.page_tokens)

    def saved_tokens(self, request_id: str) -> int:
        """The request's prompt tokens raykv holds or is being handed (its hit and its saves
        so far); 0 for a request never keyed."""
        tracked = self.tracked.get(request_id)
        return 0 if tracked is None else tracked.saved_tokens


# ---- prefill/decode disaggregation (P/D) over raykv --------------------------------------
#
#   prefill (P): kv_transfer_params {"do_remote_decode": True, ...} (Ray Serve LLM's shaping):
#                its whole prompt is looked up, keyed and saved, even what vLLM's own cache
#                held; request_finished hands back {"raykv_pd": {"tokens": E, ...}}
#   decode  (D): those params (plus the router's cut): raykv is asked again, without blocking
#                vLLM's scheduler, until it holds min(E, wanted, cut) tokens or `pd_wait_s`
#                passes (a put is committed before the directory hears of it, at the node's
#                next event flush); then D loads what is there and recomputes the rest.
#
# No blocks are held for D and no side channel is needed: raykv is the transfer.

PD_KEY = "raykv_pd"


@dataclass(frozen=True, slots=True)
class Handoff:
    """What a prefill tells its decode: raykv holds `num_tokens` of the prompt, keyed under
    `model` (the engine's page-key name: model, TP rank, PP stage) in `namespace`."""

    num_tokens: int
    model: str
    namespace: str


# What a router other than raykv's adds to every request it routes, for its own scoring and
# nothing the connector acts on: Ray's KVAwareRouter forwards the prompt's token ids
# (ray.llm's kv_aware prompt_token_forwarding).
ROUTING_ONLY_KEYS = frozenset({"prompt_token_ids"})


def is_plain_params(kv_transfer_params: Any) -> bool:
    """Whether the request carries no kv_transfer_params the connector acts on (none, or only
    another router's own keys): no hit or cut from raykv's router, no P/D role or handoff."""
    return kv_transfer_params is None or (isinstance(kv_transfer_params, dict)
                                          and set(kv_transfer_params) <= ROUTING_ONLY_KEYS)


def is_producer(kv_transfer_params: Any) -> bool:
    """Whether the request is a prefill for a remote decode (Ray Serve LLM's P/D shaping)."""
    return isinstance(kv_transfer_params, dict) and \
        kv_transfer_params.get("do_remote_decode") is True


def handoff_params(handoff: Handoff) -> dict:
    """The kv_transfer_params a prefill returns (vLLM puts them in its response)."""
    return {PD_KEY: {"tokens": handoff.num_tokens, "model": handoff.model,
                     "namespace": handoff.namespace}}


def handoff_of(kv_transfer_params: Any) -> Handoff | None:
    """A decode request's handoff, or None (none, or malformed: a client's odd params are
    ignored, never failing the request)."""
    if not isinstance(kv_transfer_params, dict):
        return None
    value = kv_transfer_params.get(PD_KEY)
    if not isinstance(value, dict):
        return None
    tokens, model, namespace = value.get("tokens"), value.get("model"), value.get("namespace")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0 \
            or not isinstance(model, str) or not isinstance(namespace, str):
        return None
    return Handoff(tokens, model, namespace)


def handoff_mismatch(handoff: Handoff, model: str, namespace: str) -> str | None:
    """Why this decode engine can never find the prefill's pages, or None: both must key pages
    alike (the same model name, TP/PP shape and dtype, the same namespace)."""
    if handoff.model != model or handoff.namespace != namespace:
        return (f"the prefill keyed its pages as {handoff.model!r} in namespace "
                f"{handoff.namespace!r}, this decode engine as {model!r} in {namespace!r}: "
                f"give both the same raykv.model_name, namespace, TP/PP sizes and dtype")
    return None


def decode_params(prefill_params: Any, request_params: Any) -> dict | None:
    """The decode request's kv_transfer_params: the prefill's handoff, plus the router's cut
    from the client's request (raykv's router on the decode deployment puts it there)."""
    return with_fetch_limit(prefill_params, fetch_limit(request_params))


def tokens_wanted(handoff: Handoff, num_asked: int, limit: int | None) -> int:
    """The prompt tokens a decode waits to see in raykv: the prefill's, at most the prompt's
    whole blocks (asked_tokens) and the router's cut."""
    wanted = min(handoff.num_tokens, num_asked)
    return wanted if limit is None else min(wanted, limit)


@dataclass(slots=True)
class HandoffWaits:
    """The decode side's bounded wait for a prefill's pages, per request (pure: times are
    given). A request is asked about again until raykv holds what it wants, or `wait_s`
    after its first short answer; then it takes what is there."""

    wait_s: float
    since_s: dict[str, float] = field(default_factory=dict)

    def should_wait(self, request_id: str, num_held: int, num_wanted: int,
                    now_s: float) -> bool:
        if num_held >= num_wanted:
            self.since_s.pop(request_id, None)
            return False
        started_s = self.since_s.setdefault(request_id, now_s)
        if now_s - started_s < self.wait_s:
            return True
        del self.since_s[request_id]
        return False

    def forget(self, request_id: str) -> None:
        self.since_s.pop(request_id, None)
