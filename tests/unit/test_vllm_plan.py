"""The connector's scheduler-side plan and worker-side mover, without vLLM or Ray."""

import torch

from cluster.serving.vllm_io import KVMover
from cluster.serving.vllm_layout import BlockLayout, blocks_to_kv
from cluster.serving.vllm_plan import LoadSpec, NewRequest, RunningRequest, SaveSpec, StepPlanner

B = 4  # tokens per vLLM block, and per raykv page
L, H, D = 2, 2, 3
LAYOUT = BlockLayout(key_transposed=True)


def test_hits_are_whole_blocks_and_leave_one_token_to_compute():
    plan = StepPlanner(block_size=B, page_tokens=B)
    assert plan.loadable_tokens(9) == 8 and plan.loadable_tokens(8) == 4
    assert plan.matched("r", num_local_tokens=4, num_cached_tokens=10) == 4  # 8 - 4 local
    assert plan.matched("s", num_local_tokens=8, num_cached_tokens=4) == 0


def test_a_hit_is_loaded_past_vllms_own_blocks_and_not_saved_again():
    plan = StepPlanner(block_size=B, page_tokens=B)
    prompt = list(range(13))
    plan.matched("r", 4, 12)
    plan.allocated("r", 8)
    loads, saves = plan.step([NewRequest("r", prompt, [7, 8, 9, 10], 12, 1)], [])
    assert loads == [LoadSpec("r", prompt[:12], [7, 8, 9, 10], 4)]
    assert saves == []  # its full pages are raykv's already


def test_chunked_prefill_saves_each_new_full_page_once():
    plan = StepPlanner(block_size=B, page_tokens=B)
    prompt = list(range(11))
    plan.matched("r", 0, 0)
    _, saves = plan.step([NewRequest("r", prompt, [3, 5], 0, 6)], [])
    assert saves == [SaveSpec("r", prompt[:4], [3])]
    _, saves = plan.step([], [RunningRequest("r", [6], False, 6, 5)])
    assert saves == [SaveSpec("r", prompt[:8], [3, 5])]
    _, saves = plan.step([], [RunningRequest("r", None, False, 11, 1)])  # decoding
    assert saves == []
    plan.finished("r")
    assert not plan.tracked and not plan.hits


def test_a_resumed_request_saves_from_its_new_blocks():
    plan = StepPlanner(block_size=B, page_tokens=B)
    prompt = list(range(9))
    plan.step([NewRequest("r", prompt, [1, 2, 3], 0, 2)], [])
    _, saves = plan.step([], [RunningRequest("r", [7, 8, 9], True, 0, 9)])
    assert saves == [SaveSpec("r", prompt[:8], [7, 8])]


class FakeClient:
    """raykv's get/put over a dict; `held` caps what a get returns (a dead node, a miss)."""

    def __init__(self, held: int | None = None):
        self.held, self.kv, self.puts = held, None, []

    def get(self, tokens, out=None):
        num_tokens = len(tokens) if self.held is None else min(self.held, len(tokens))
        if not num_tokens:
            return 0, None
        out[:, :, :, :num_tokens] = self.kv[:, :, :, :num_tokens]
        return num_tokens, out[:, :, :, :num_tokens]

    def put(self, tokens, kv):
        self.puts.append((list(tokens), kv.clone()))
        return len(tokens)


def caches():
    return [torch.zeros(6, H, B, 2 * D) for _ in range(L)]


def test_a_short_load_reports_the_blocks_it_did_not_fill():
    client = FakeClient(held=8)
    client.kv = torch.randn(L, 2, H, 12, D)
    mover = KVMover(client, caches(), LAYOUT, torch.float32)
    failed = mover.load(LoadSpec("r", list(range(12)), [4, 1, 2, 5], 4))
    assert failed == {2}  # tokens 8..11; block 4 was vLLM's own, block 1 was loaded
    got = blocks_to_kv(mover.layers, LAYOUT, [4, 1], 8, torch.zeros(L, 2, H, 8, D))
    assert torch.equal(got[:, :, :, 4:], client.kv[:, :, :, 4:8])
    assert mover.stats.loaded_tokens == 4 and mover.stats.failed_tokens == 4


def test_a_failing_client_is_a_miss():
    class Broken(FakeClient):
        def get(self, tokens, out=None):
            raise TimeoutError("no answer")

    mover = KVMover(Broken(), caches(), LAYOUT, torch.float32)
    assert mover.load(LoadSpec("r", list(range(8)), [0, 3], 0)) == {0, 3}


def test_saves_copy_the_blocks_and_put_in_the_background():
    client, layers = FakeClient(), caches()
    for layer in layers:
        layer.normal_()
    mover = KVMover(client, layers, LAYOUT, torch.float32)
    mover.save(SaveSpec("r", list(range(8)), [5, 0]))
    expected = blocks_to_kv(layers, LAYOUT, [5, 0], 8, torch.zeros(L, 2, H, 8, D))
    for layer in layers:  # the blocks are reused right after the step: the save kept a copy
        layer.zero_()
    mover.close()
    ((tokens, kv),) = client.puts
    assert tokens == list(range(8)) and torch.equal(kv, expected)
    assert mover.stats.saved_tokens == 8


def test_a_preempted_request_loads_again_into_its_new_blocks():
    plan = StepPlanner(block_size=B, page_tokens=B)
    prompt = list(range(13))
    plan.matched("r", 0, 12)
    plan.allocated("r", 12)
    loads, _ = plan.step([NewRequest("r", prompt, [1, 2, 3, 4], 12, 1)], [])
    assert loads == [LoadSpec("r", prompt[:12], [1, 2, 3, 4], 0)]
    # preempted, its blocks freed; rescheduled with vLLM's cache holding the first block
    assert plan.matched("r", 4, 12) == 8
    plan.allocated("r", 8)
    loads, saves = plan.step([], [RunningRequest("r", [1, 6, 7, 8], True, 12, 1)])
    assert loads == [LoadSpec("r", prompt[:12], [1, 6, 7, 8], 4)] and saves == []
