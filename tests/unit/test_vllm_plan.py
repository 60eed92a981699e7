"""The connector's scheduler-side plan and worker-side mover, without vLLM or Ray: loads run
in the background and report their unfilled blocks, saves copy each page once."""

import copy
import threading
import time

import pytest
import torch

from cluster.core.keys import KeyChain
from cluster.core.spec import ModelSpec
from cluster.serving.vllm_io import KVMover
from cluster.serving.vllm_layout import BlockLayout, blocks_to_kv
from cluster.serving.vllm_plan import (
    LOADED_KEY,
    UNFILLED_KEY,
    LoadSpec,
    NewRequest,
    RunningRequest,
    SaveSpec,
    StepPlanner,
    load_outcome_of,
    loadable_tokens,
    page_misfit,
    raykv_can_add,
)

B = 4  # tokens per vLLM block
P = 8  # tokens per raykv page: two blocks
L, H, D = 2, 2, 3
SPEC = ModelSpec("tiny", L, H, D, "float32")
LAYOUT = BlockLayout(key_transposed=True)


def planner(block_size=B, page_tokens=B):
    return StepPlanner(block_size=block_size, page_tokens=page_tokens)


def test_hits_are_whole_blocks_and_leave_one_token_to_compute():
    plan = planner()
    assert loadable_tokens(B, 9) == 8 and loadable_tokens(B, 8) == 4  # vLLM's own cache's
    assert plan.asked_tokens(9) == 8 and plan.asked_tokens(8) == 8  # asked of raykv
    assert plan.matched("r", num_local_tokens=4, num_cached_tokens=10, prompt_len=13) == 4
    assert plan.matched("s", num_local_tokens=8, num_cached_tokens=4, prompt_len=13) == 0
    # The whole prompt in raykv: vLLM is handed all but its last token, not all but its
    # last block (LMCache's rule); the prompt's hit stays its whole blocks.
    assert plan.matched("t", num_local_tokens=4, num_cached_tokens=8, prompt_len=8) == 3
    assert plan.hits["t"] == (4, 8)
    assert plan.matched("u", num_local_tokens=0, num_cached_tokens=12, prompt_len=8) == 7


def test_a_whole_prompt_hit_loads_its_last_block_whole_and_saves_nothing_again():
    plan = planner(page_tokens=P)
    prompt = list(range(16))
    plan.keyed("r", b"salt")
    assert plan.matched("r", 0, 16, len(prompt)) == 15
    plan.allocated("r", prompt, [7, 8, 9, 10], 15)
    loads, saves = plan.step([], [])
    assert loads == [LoadSpec("r", prompt, [7, 8, 9, 10], 0, b"salt")] and saves == []
    # vLLM computes the last token: the step saves nothing, raykv holds every page
    loads, saves = plan.step([NewRequest("r", prompt, [7, 8, 9, 10], 15, 1)], [])
    assert loads == [] and saves == [] and plan.saved_tokens("r") == 16
    # a last block that failed to load is saved again once computed
    plan.finished("r")
    plan.keyed("s", b"salt")
    plan.matched("s", 0, 16, len(prompt))
    plan.allocated("s", prompt, [1, 2, 3, 4], 15)
    plan.step([], [])
    plan.reported({"s"}, {4})
    _, saves = plan.step([NewRequest("s", prompt, [1, 2, 3, 4], 12, 4)], [])
    assert saves == [SaveSpec("s", prompt, [3, 4], 8, b"salt")]


def test_a_page_must_be_whole_blocks():
    assert page_misfit(16, 256) is None and page_misfit(128, 128) is None
    assert "not a multiple" in page_misfit(128, 200)


def test_a_hit_is_loaded_into_its_allocated_blocks_and_not_saved_again():
    plan = planner()
    prompt = list(range(13))
    plan.keyed("r", b"salt")
    plan.matched("r", 4, 12, 13)
    plan.allocated("r", prompt, [7, 8, 9, 10], 8)
    loads, saves = plan.step([], [])  # the request waits for its load: not scheduled
    assert loads == [LoadSpec("r", prompt[:12], [7, 8, 9, 10], 4, b"salt")] and saves == []
    loads, saves = plan.step([NewRequest("r", prompt, [7, 8, 9, 10], 12, 1)], [])
    assert loads == [] and saves == []  # loaded once; its full pages are raykv's already


def test_an_unkeyed_request_is_neither_loaded_nor_saved():
    plan = planner()
    prompt = list(range(13))
    plan.matched("r", 0, 12, 13)
    plan.allocated("r", prompt, [1, 2, 3, 4], 12)
    assert plan.step([NewRequest("r", prompt, [1, 2, 3, 4], 0, 13)], []) == ([], [])


def test_chunked_prefill_saves_only_the_new_pages_of_each_step():
    plan = planner(page_tokens=P)
    prompt = list(range(27))
    plan.keyed("r", b"")
    plan.matched("r", 0, 0, 13)
    # Only the save that holds the prompt's last full page (24) is final: the step after a
    # chunk's save does not wait for it (step_budget.save_waits).
    _, saves = plan.step([NewRequest("r", prompt, [3, 5, 6], 0, 10)], [])
    assert saves == [SaveSpec("r", prompt[:8], [3, 5], 0, b"", final=False)]
    _, saves = plan.step([], [RunningRequest("r", [9, 2], False, 10, 10)])  # tokens 10..19
    assert saves == [SaveSpec("r", prompt[:16], [6, 9], 8, b"", final=False)]
    _, saves = plan.step([], [RunningRequest("r", [4, 11], False, 20, 7)])  # tokens 20..26
    assert saves == [SaveSpec("r", prompt[:24], [2, 4], 16, b"", final=True)]
    _, saves = plan.step([], [RunningRequest("r", None, False, 27, 1)])  # decoding
    assert saves == []
    plan.finished("r")
    assert not plan.tracked and not plan.hits and not plan.salts


def test_a_resumed_request_saves_from_its_new_blocks():
    plan = planner()
    prompt = list(range(9))
    plan.keyed("r", b"")
    plan.step([NewRequest("r", prompt, [1, 2, 3], 0, 2)], [])
    _, saves = plan.step([], [RunningRequest("r", [7, 8, 9], True, 0, 9)])
    assert saves == [SaveSpec("r", prompt[:8], [7, 8], 0, b"")]


def test_a_preempted_request_loads_again_into_its_new_blocks():
    plan = planner()
    prompt = list(range(13))
    plan.keyed("r", b"")
    plan.matched("r", 0, 12, 13)
    plan.allocated("r", prompt, [1, 2, 3, 4], 12)
    loads, _ = plan.step([], [])
    assert loads == [LoadSpec("r", prompt[:12], [1, 2, 3, 4], 0, b"")]
    plan.step([NewRequest("r", prompt, [1, 2, 3, 4], 12, 1)], [])
    # preempted, its blocks freed; asked again with vLLM's cache holding the first block
    assert plan.matched("r", 4, plan.hits["r"][1], 13) == 8
    plan.allocated("r", prompt, [1, 6, 7, 8], 8)
    loads, saves = plan.step([], [])
    assert loads == [LoadSpec("r", prompt[:12], [1, 6, 7, 8], 4, b"")] and saves == []
    _, saves = plan.step([], [RunningRequest("r", [1, 6, 7, 8], True, 12, 1)])
    assert saves == []


def test_a_preempted_request_is_offered_the_pages_it_saved_itself():
    plan = planner()
    prompt = list(range(13))
    plan.keyed("r", b"")
    assert plan.matched("r", 0, 0, 13) == 0  # raykv held nothing when it came
    _, saves = plan.step([NewRequest("r", prompt, [1, 2, 3, 4], 0, 13)], [])
    assert saves == [SaveSpec("r", prompt[:12], [1, 2, 3], 0, b"")]
    assert plan.rematched("r", 0, 13) == 12  # preempted, asked again: its own pages load


def test_a_load_that_failed_is_not_offered_again():
    plan = planner()
    prompt = list(range(13))
    plan.keyed("r", b"")
    plan.matched("r", 0, 12, 13)
    plan.allocated("r", prompt, [1, 2, 3, 4], 12)
    plan.step([], [])
    plan.reported(set(), {9})  # another request's block: nothing changes
    assert plan.rematched("r", 0, 13) == 12
    plan.reported({"r"}, {2, 3})  # tokens 4..11 never came
    assert plan.rematched("r", 0, 13) == 4 and not plan.loading
    plan.matched("s", 0, 12, 13)
    plan.keyed("s", b"")
    plan.allocated("s", prompt, [5, 6, 7, 8], 12)
    plan.reported({"s"}, {5, 6, 7})  # nothing came: vLLM asks again and is told 0
    assert plan.rematched("s", 0, 13) == 0


def test_a_load_s_outcome_is_what_it_filled_and_what_vllm_counts_that_it_did_not():
    plan = planner()
    prompt = list(range(13))
    plan.keyed("r", b"")
    plan.matched("r", 4, 12, 13)  # vLLM's own cache holds the first block
    plan.allocated("r", prompt, [1, 2, 3, 4], 8)
    assert plan.load_outcome("r") == {LOADED_KEY: 8, UNFILLED_KEY: 0}
    plan.reported(set(), {3})  # the block of tokens 8..11 never came
    assert plan.load_outcome("r") == {LOADED_KEY: 4, UNFILLED_KEY: 4}
    plan.finished("r")
    assert plan.load_outcome("r") is None
    assert plan.load_outcome("never") is None


def test_a_response_s_load_outcome_is_read_back_and_odd_values_are_nothing():
    assert load_outcome_of({LOADED_KEY: 32, UNFILLED_KEY: 96, "other": 1}) == (32, 96)
    assert load_outcome_of({LOADED_KEY: 32}) == (32, 0)
    assert load_outcome_of(None) == (None, 0)
    assert load_outcome_of({LOADED_KEY: "32", UNFILLED_KEY: True}) == (None, 0)
    assert load_outcome_of({LOADED_KEY: -1, UNFILLED_KEY: -5}) == (None, 0)


def test_a_load_that_fell_short_saves_the_pages_it_did_not_fill():
    plan = planner()
    prompt = list(range(13))
    plan.keyed("r", b"")
    plan.matched("r", 0, 12, 13)
    plan.allocated("r", prompt, [1, 2, 3, 4], 12)
    plan.step([], [])
    # vLLM cut the request's count to the first failed block (token 4) and computes the rest
    _, saves = plan.step([NewRequest("r", prompt, [1, 2, 3, 4], 4, 9)], [])
    assert saves == [SaveSpec("r", prompt[:12], [2, 3], 4, b"")]


# ---- the worker side -----------------------------------------------------------------------


class ChainClient:
    """raykv's client calls over a dict of pages, keyed by raykv's real key chain."""

    def __init__(self, page_tokens: int = P):
        self.chain = KeyChain.of(SPEC, "default", page_tokens)
        self.page_tokens = page_tokens
        self.pages: dict[bytes, torch.Tensor] = {}
        self.put_tokens: list[int] = []
        self.gate: threading.Event | None = None  # a get waits on it when set
        self.flushes: list = []
        self.flush_ok = True

    def keys(self, tokens):
        return self.chain.keys(tokens)

    def salted(self, extra):
        return self._view(self.chain.salted(extra))

    def continued(self, key):
        return self._view(self.chain.continued(key))

    def bounded(self, timeout_s):
        return self  # no calls to bound

    def flush(self, timeout_s=None):
        self.flushes.append(timeout_s)  # views share the list (copy.copy)
        return self.flush_ok

    def put(self, tokens, kv):
        assert kv.shape[3] == len(tokens)
        keys = self.keys(tokens)
        for p, key in enumerate(keys):
            self.pages[key] = kv[:, :, :, p * self.page_tokens:(p + 1) * self.page_tokens].clone()
        self.put_tokens.append(len(keys) * self.page_tokens)
        return len(keys) * self.page_tokens

    def get(self, tokens, out=None):
        if self.gate is not None:
            self.gate.wait(10)
        held = 0
        for key in self.keys(tokens):
            if key not in self.pages:
                break
            out[:, :, :, held:held + self.page_tokens] = self.pages[key]
            held += self.page_tokens
        return (held, out[:, :, :, :held]) if held else (0, None)

    def _view(self, chain):
        view = copy.copy(self)  # shares the pages
        view.chain = chain
        return view


class GatedPuts(ChainClient):
    """A ChainClient whose puts wait for `gate` (a busy or slow saver)."""

    def __init__(self, gate: threading.Event):
        super().__init__()
        self.put_gate = gate

    def put(self, tokens, kv):
        self.put_gate.wait(10)
        return super().put(tokens, kv)


def caches(num_blocks=12):
    return [torch.zeros(num_blocks, H, B, 2 * D) for _ in range(L)]


def filled_caches(num_blocks=12):
    layers = caches(num_blocks)
    for layer in layers:
        layer.normal_()
    return layers


def kv_of(layers, block_ids, num_tokens):
    return blocks_to_kv(layers, LAYOUT, block_ids, num_tokens, torch.zeros(L, 2, H, num_tokens, D))


def wait_for_loads(mover, count=1, timeout_s=10.0):
    done, deadline_s = [], time.monotonic() + timeout_s
    while len(done) < count:
        assert time.monotonic() < deadline_s, "the load never finished"
        done += mover.finished()
        time.sleep(0.01)
    return done


def test_chunked_saves_copy_each_page_once_and_key_it_as_the_whole_prompt():
    client, layers = ChainClient(), filled_caches()
    mover = KVMover(client, layers, LAYOUT, SPEC)
    prompt, blocks = list(range(27)), [3, 5, 6, 9, 2, 4, 11]
    for save in (SaveSpec("r", prompt[:8], [3, 5], 0), SaveSpec("r", prompt[:16], [6, 9], 8),
                 SaveSpec("r", prompt[:24], [2, 4], 16)):
        mover.save(save)
    mover.close()
    assert mover.stats.gathered_tokens == 24 and client.put_tokens == [8, 8, 8]
    assert mover.stats.saved_tokens == 24
    # A fresh get of the whole prompt (from the chain's root) finds every page, with its KV.
    num_tokens, kv = client.get(prompt, out=torch.zeros(L, 2, H, 27, D))
    assert num_tokens == 24 and torch.equal(kv, kv_of(layers, blocks, 24))


def test_a_salted_save_is_not_found_unsalted_or_under_another_salt():
    client, layers = ChainClient(), filled_caches()
    mover = KVMover(client, layers, LAYOUT, SPEC)
    mover.save(SaveSpec("r", list(range(16)), [1, 2, 3, 4], 0, b"lora-a"))
    mover.close()
    out = torch.zeros(L, 2, H, 16, D)
    assert client.get(list(range(16)), out=out)[0] == 0
    assert client.salted(b"lora-b").get(list(range(16)), out=out)[0] == 0
    assert client.salted(b"lora-a").get(list(range(16)), out=out)[0] == 16


def test_loads_run_in_the_background_and_report_when_done():
    client, source = ChainClient(), filled_caches()
    client.put(list(range(16)), kv_of(source, [1, 2, 3, 4], 16))
    client.gate = threading.Event()  # raykv is slow to answer
    mover = KVMover(client, caches(), LAYOUT, SPEC)
    mover.start_load(LoadSpec("r", list(range(16)), [7, 8, 9, 10], 0))  # returns at once
    time.sleep(0.05)
    assert mover.finished() == []  # still loading: vLLM keeps the request waiting
    client.gate.set()
    assert wait_for_loads(mover) == [("r", set())]
    assert torch.equal(kv_of(mover.layers, [7, 8, 9, 10], 16), kv_of(source, [1, 2, 3, 4], 16))
    mover.close()


def test_a_load_fetches_from_the_page_holding_its_first_token():
    client, source = ChainClient(), filled_caches()
    client.put(list(range(24)), kv_of(source, [1, 2, 3, 4, 5, 6], 24))
    del client.pages[client.keys(list(range(8)))[0]]  # page 0 is gone from raykv
    layers = caches()
    mover = KVMover(client, layers, LAYOUT, SPEC)
    # vLLM holds tokens 0..11 (three blocks); raykv gives 12..23, from page 1 on
    assert mover.load(LoadSpec("r", list(range(24)), [7, 8, 9, 10, 11, 0], 12)) == set()
    got = kv_of(layers, [7, 8, 9, 10, 11, 0], 24)[:, :, :, 12:]
    assert torch.equal(got, kv_of(source, [1, 2, 3, 4, 5, 6], 24)[:, :, :, 12:])
    assert mover.stats.loaded_tokens == 12
    mover.close()


def test_a_short_load_reports_the_blocks_it_did_not_fill():
    client, source = ChainClient(), filled_caches()
    client.put(list(range(8)), kv_of(source, [1, 2], 8))  # raykv holds one page of three
    mover = KVMover(client, caches(), LAYOUT, SPEC)
    mover.start_load(LoadSpec("r", list(range(24)), [4, 1, 2, 5, 6, 7], 4))
    assert wait_for_loads(mover) == [("r", {2, 5, 6, 7})]  # tokens 8..23
    assert torch.equal(kv_of(mover.layers, [4, 1], 8)[:, :, :, 4:],
                       kv_of(source, [1, 2], 8)[:, :, :, 4:])
    assert mover.stats.loaded_tokens == 4 and mover.stats.failed_tokens == 16
    mover.close()


@pytest.mark.parametrize("error", [TimeoutError("no answer"), RuntimeError("bug")])
def test_a_failing_client_is_a_miss_of_every_block(error):
    class Broken(ChainClient):
        def get(self, tokens, out=None):
            raise error

    mover = KVMover(Broken(), caches(), LAYOUT, SPEC)
    mover.start_load(LoadSpec("r", list(range(8)), [0, 3], 0))
    assert wait_for_loads(mover) == [("r", {0, 3})]
    mover.close()


def test_a_load_in_the_step_fills_the_blocks_before_returning_in_the_callers_thread():
    client, source = ChainClient(), filled_caches()
    client.put(list(range(16)), kv_of(source, [1, 2, 3, 4], 16))
    bounds = []

    class Bounded(ChainClient):
        def bounded(self, timeout_s):
            bounds.append(timeout_s)
            return self

    bounded = Bounded()
    bounded.pages = client.pages
    mover = KVMover(bounded, caches(), LAYOUT, SPEC)
    spec = LoadSpec("r", list(range(16)), [7, 8, 9, 10], 0, sync_timeout_s=0.04)
    assert mover.load_now(spec) == set()
    assert bounds == [0.04]  # each raykv call within the step's deadline
    assert torch.equal(kv_of(mover.layers, [7, 8, 9, 10], 16), kv_of(source, [1, 2, 3, 4], 16))
    assert mover.finished() == []  # vLLM hears of it through the step's load errors only
    assert mover.stats.loaded_tokens == 16
    _, in_step = mover.take_samples()  # its time, for the next load's estimate
    assert [(num_bytes, cut) for num_bytes, _, cut in in_step] == [(SPEC.page_bytes(16), False)]
    mover.start_load(LoadSpec("bg", list(range(16)), [1, 2, 3, 4], 0))
    wait_for_loads(mover)
    assert mover.take_samples()[1] == []  # a background load is not one made in the step
    mover.close()


def test_a_load_in_the_step_past_its_deadline_is_a_miss_and_drops_its_staging():
    class Late(ChainClient):
        def get(self, tokens, out=None):
            raise TimeoutError("past the deadline")

    mover = KVMover(Late(), caches(), LAYOUT, SPEC)
    mover._out(8, in_step=True)
    spec = LoadSpec("r", list(range(16)), [7, 8, 9, 10], 4, sync_timeout_s=0.01)
    assert mover.load_now(spec) == {8, 9, 10}  # tokens 4..15: vLLM recomputes them
    assert True not in mover._buffers  # a late reply cannot land in the next load's staging
    (cut,) = mover.take_samples()[1]  # its 16 tokens took at least this long: measured
    assert cut[0] == SPEC.page_bytes(16) and cut[1] > 0 and cut[2]
    mover.close()


def test_a_load_in_the_step_answered_short_past_its_deadline_is_measured_as_cut():
    """The real bounded client does not raise at its deadline: it answers what it had (a
    miss). That cut must be measured like a raised one, or every next load is estimated to
    fit the step again and cut again; and its staging is dropped as well."""
    class Slow(ChainClient):
        def get(self, tokens, out=None):
            time.sleep(0.03)
            return 0, None

    mover = KVMover(Slow(), caches(), LAYOUT, SPEC)
    mover._out(8, in_step=True)
    spec = LoadSpec("r", list(range(16)), [7, 8, 9, 10], 4, sync_timeout_s=0.01)
    assert mover.load_now(spec) == {8, 9, 10}
    assert True not in mover._buffers
    (cut,) = mover.take_samples()[1]
    assert cut[0] == SPEC.page_bytes(16) and cut[1] >= 0.01 and cut[2]
    mover.close()


def test_a_load_in_the_step_that_misses_before_its_deadline_measures_nothing():
    """A quick miss (raykv holds none of it) says nothing of the rate: no sample."""
    mover = KVMover(ChainClient(), caches(), LAYOUT, SPEC)
    spec = LoadSpec("r", list(range(16)), [7, 8, 9, 10], 4, sync_timeout_s=5.0)
    assert mover.load_now(spec) == {8, 9, 10}
    assert mover.take_samples()[1] == []
    mover.close()


def test_saves_copy_the_blocks_and_put_in_the_background():
    client, layers = ChainClient(), filled_caches()
    mover = KVMover(client, layers, LAYOUT, SPEC)
    mover.save(SaveSpec("r", list(range(8)), [5, 0]))
    expected = kv_of(layers, [5, 0], 8)
    for layer in layers:  # the blocks are reused right after the step: the save kept a copy
        layer.zero_()
    mover.close()
    num_tokens, kv = client.get(list(range(8)), out=torch.zeros(L, 2, H, 8, D))
    assert num_tokens == 8 and torch.equal(kv, expected)


def test_a_save_is_flushed_and_a_step_waits_for_it_within_its_bound():
    gate = threading.Event()
    client = GatedPuts(gate)
    mover = KVMover(client, filled_caches(), LAYOUT, SPEC)
    assert mover.settle_saves(0.0)  # nothing handed over: nothing to wait for
    mover.save(SaveSpec("r", list(range(8)), [5, 0]))
    start_s = time.monotonic()
    assert not mover.settle_saves(0.05)  # the put is held: the step goes on
    assert time.monotonic() - start_s < 1.0
    assert mover.stats.late_saves == 1 and mover.stats.num_settles == 1
    gate.set()
    mover.save(SaveSpec("s", list(range(100, 108)), [1, 2]))
    assert mover.settle_saves(5.0)  # the late one is no longer waited for; this one is done
    assert client.get(list(range(100, 108)), out=torch.zeros(SPEC.page_shape(8)))[0] == 8
    mover.close()
    assert mover.stats.num_puts == 2 and mover.stats.late_saves == 1
    assert len(client.flushes) == 2 and mover.stats.unflushed_saves == 0


def test_a_failed_flush_is_counted_and_async_saves_are_not_flushed():
    client = ChainClient()
    client.flush_ok = False
    mover = KVMover(client, filled_caches(), LAYOUT, SPEC)
    mover.save(SaveSpec("r", list(range(8)), [5, 0]))
    assert mover.settle_saves(5.0)  # put, though not flushed: it is done all the same
    assert mover.stats.unflushed_saves == 1
    mover.close()
    quiet = ChainClient()
    mover = KVMover(quiet, filled_caches(), LAYOUT, SPEC, flush_saves=False)
    mover.save(SaveSpec("r", list(range(8)), [5, 0]))
    mover.close()
    assert quiet.flushes == [] and quiet.put_tokens == [8]


def test_raykv_is_asked_only_when_a_whole_page_could_end_past_vllms_hit():
    """16-token blocks, 256-token pages: a 255-token prompt's asked prefix (240) has no whole
    page, so a lookup could only answer 0; one of 256 could bring a page, unless vLLM holds
    it already."""
    assert not raykv_can_add(240, 256, 0)
    assert raykv_can_add(256, 256, 0) and raykv_can_add(256, 256, 240)
    assert not raykv_can_add(256, 256, 256) and not raykv_can_add(500, 256, 256)
    assert raykv_can_add(512, 256, 256) and not raykv_can_add(0, 256, 0)
