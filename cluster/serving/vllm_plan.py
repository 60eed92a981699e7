"""What the scheduler side of RaykvConnector decides each step (pure: no vLLM, no Ray).

    get_num_new_matched_tokens  ->  matched(): the raykv hit, cut to whole blocks, kept per request
                                    (asked again, as for a preempted request, vLLM's own count
                                    is taken afresh and raykv is not asked again)
    update_state_after_alloc    ->  allocated(): the hit will be loaded
    build_connector_meta        ->  step(): LoadSpecs for newly scheduled (or resumed) requests,
                                    SaveSpecs for the full pages the step's forward computes
    request_finished            ->  finished(): forget the request

A request's prompt pages are saved as they are computed (chunked prefill saves page by page);
the pages it loaded, or that were saved before, are not saved again. Generated tokens are not
saved: the next turn's prompt holds them and saves them then.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load tokens [start, len(token_ids)) of the request from raykv into its blocks."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Save the full pages of token_ids (their KV is in block_ids, in order)."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]


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


@dataclass(slots=True)
class StepPlanner:
    """Per-request bookkeeping of the scheduler side; see the module docstring."""

    block_size: int
    page_tokens: int
    hits: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (local, raykv end)
    to_load: dict[str, int] = field(default_factory=dict)  # id -> tokens vLLM will load
    tracked: dict[str, _Tracked] = field(default_factory=dict)

    def loadable_tokens(self, prompt_len: int) -> int:
        """The longest prefix worth asking for: whole blocks, leaving at least one prompt
        token for vLLM to compute (it needs the last position's logits)."""
        return max(prompt_len - 1, 0) // self.block_size * self.block_size

    def matched(self, request_id: str, num_local_tokens: int, num_cached_tokens: int) -> int:
        """Record raykv's hit for the request; the tokens to load beyond vLLM's own."""
        end = num_cached_tokens // self.block_size * self.block_size
        self.hits[request_id] = (num_local_tokens, end)
        return max(end - num_local_tokens, 0)

    def allocated(self, request_id: str, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self.to_load[request_id] = num_external_tokens

    def step(self, new: list[NewRequest],
             running: list[RunningRequest]) -> tuple[list[LoadSpec], list[SaveSpec]]:
        loads = [load for request in new
                 if (load := self._load(request.request_id, request.prompt, request.block_ids))]
        loads += [load for request in running  # a preempted request comes back as running
                  if request.resumed and request.request_id in self.tracked
                  and (load := self._load(request.request_id,
                                          self.tracked[request.request_id].prompt,
                                          request.new_block_ids or []))]
        saves = [save for request in new if (save := self._track_new(request))]
        saves += [save for request in running if (save := self._track_running(request))]
        return loads, saves

    def finished(self, request_id: str) -> None:
        for table in (self.hits, self.to_load, self.tracked):
            table.pop(request_id, None)

    def _load(self, request_id: str, prompt: list[int], block_ids: list[int]) -> LoadSpec | None:
        num_tokens = self.to_load.pop(request_id, 0)
        if not num_tokens:
            return None
        local, _ = self.hits.get(request_id, (0, 0))
        end = local + num_tokens
        return LoadSpec(request_id, prompt[:end], list(block_ids), local)

    def _track_new(self, request: NewRequest) -> SaveSpec | None:
        _, hit_end = self.hits.get(request.request_id, (0, 0))
        tracked = _Tracked(request.prompt, list(request.block_ids), hit_end)
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
        tracked.saved_tokens = end
        num_blocks = -(-end // self.block_size)
        return SaveSpec(request_id, tracked.prompt[:end], tracked.block_ids[:num_blocks])
