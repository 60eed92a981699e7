"""The attention pairs of a step, read off vLLM's own SchedulerOutput (prefill_fit.
scheduled_spans): the names it reads are vLLM's, so a rename there fails here, not in the fit."""

from __future__ import annotations

from cluster.serving.prefill_fit import attention_pairs, scheduled_spans


def test_a_real_scheduler_output_s_new_and_running_requests_give_their_spans():
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    new = NewRequestData(req_id="new", prompt_token_ids=list(range(576)), mm_features=[],
                         sampling_params=None, pooling_params=None, block_ids=([],),
                         num_computed_tokens=64, lora_request=None)
    running = CachedRequestData(req_ids=["decode", "chunk"], resumed_req_ids=set(),
                                new_token_ids=[], all_token_ids={}, new_block_ids=[None, None],
                                num_computed_tokens=[700, 512], num_output_tokens=[3, 0])
    output = SchedulerOutput(scheduled_new_reqs=[new], scheduled_cached_reqs=running,
                             num_scheduled_tokens={"new": 512, "decode": 1, "chunk": 256},
                             total_num_scheduled_tokens=769, scheduled_spec_decode_tokens={},
                             scheduled_encoder_inputs={}, num_common_prefix_blocks=[0],
                             finished_req_ids=set(), free_encoder_mm_hashes=[])
    spans = sorted(scheduled_spans(output))
    assert spans == [(64, 512), (512, 256), (700, 1)]
    assert attention_pairs(spans) == (576**2 - 64**2) + (768**2 - 512**2) + (701**2 - 700**2)
