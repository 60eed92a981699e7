"""`raykv bench vllm`'s pure parts: the workload's pages, LMCache's chunk, the paired ratios and
when they fail. No Ray, no vLLM."""

import statistics

from cluster.tools.bench import harness, vllm
from cluster.tools.bench.vllm_workload import PAGE_TOKENS, loadable_tokens, loaded_tokens


def test_every_prompt_is_whole_pages_and_lmcache_chunks_are_raykv_pages():
    command = vllm.lmcache_command(5555)
    assert command[command.index("--chunk-size") + 1] == str(PAGE_TOKENS)
    for quick in (True, False):
        plan = vllm.plan_of(quick)
        prompts = [r.prompt for r in plan["requests"]] + plan["back_to_back"]
        assert all(len(p) % PAGE_TOKENS == 0 for p in prompts)
        assert max(len(r.prompt) for r in plan["requests"]) == plan["prompt_tokens"]
        assert len(plan["requests"]) >= harness.MIN_ROUNDS
        assert len(plan["back_to_back"]) >= harness.MIN_ROUNDS
        # warm-up and back-to-back prompts share no page with the workload or each other
        firsts = {tuple(p[:PAGE_TOKENS]) for p in plan["back_to_back"]}
        firsts |= {tuple(vllm.warmup_prompt(e, PAGE_TOKENS)) for e in (0, 1)}
        assert len(firsts) == len(plan["back_to_back"]) + 2
        assert tuple(plan["requests"][0].prompt[:PAGE_TOKENS]) not in firsts
    assert loadable_tokens(2176) == 2175 and loadable_tokens(2200) == 2176  # 17 pages whole
    assert loaded_tokens(2048, 1536, 640) == 512


def _answer(ttft_s, loaded, ids=(1,) * 16):
    return {"ttft_s": ttft_s, "ids": list(ids), "cached": loaded, "local": 0, "cross": loaded,
            "loaded": loaded, "prompt_tokens": 2176, "seconds": ttft_s * 2}


def _runs(lmcache_loaded=256, raykv_ids=(1,) * 16):
    answers = {"none": [_answer(t, 0) for t in (1.0, 1.0, 1.0, 2.0)],
               "lmcache": [_answer(t, lmcache_loaded) for t in (0.5, 0.4, 0.2, 1.0)],
               "raykv": [_answer(t, 512, raykv_ids) for t in (0.4, 0.4, 0.1, 0.8)]}
    reads = {mode: [{**_answer(0.1, cached), "written_ids": [1] * 16, "loadable": 2048,
                     "writer": index % 2, "writer_seconds": 0.3}
                    for index, cached in enumerate((0, 0, 0) if mode == "none"
                                                   else (2048, 2048, 1024))]
             for mode in answers}
    return answers, reads


def test_ttft_ratios_are_paired_per_request_and_hits_are_back_to_back():
    report = harness.Report("vllm", "ms", {}, vllm.GOALS)
    vllm.fill_ratios(report, *_runs())
    ratios = report.ratios
    assert ratios["ttft_vs_lmcache"] == statistics.median([0.8, 1.0, 0.5, 0.8])
    assert report["spread"]["ttft_vs_lmcache"]["rounds"] == [0.8, 1.0, 0.5, 0.8]
    assert 0.79 < ratios["ttft_p99_vs_lmcache"] < 0.81  # 0.794 / 0.994 ms: the tails
    assert ratios["cross_engine_hit_ratio"] == (2048 + 2048 + 1024) / (3 * 2048)
    assert ratios["same_output"] == 1.0 and report["lmcache_same_output"] == 1.0
    assert not report["not_exercised"]


def test_ratios_fail_without_lmcache_hits_and_same_output_counts_differences():
    report = harness.Report("vllm", "ms", {}, vllm.GOALS)
    vllm.fill_ratios(report, *_runs(lmcache_loaded=0, raykv_ids=(2,) * 16))
    assert report.ratios["ttft_vs_lmcache"] is None
    assert report.ratios["ttft_p99_vs_lmcache"] is None
    assert set(report["not_exercised"]) == {"ttft_vs_lmcache", "ttft_p99_vs_lmcache"}
    assert report.ratios["same_output"] == 6 / 10  # 4 workload requests of 10 outputs differ
    result = harness.finish(report.result, None)
    assert not result["met"]["ttft_vs_lmcache"] and not result["met"]["same_output"]


def test_each_back_to_back_read_is_recorded_with_its_writer_and_what_it_got():
    _, reads = _runs()
    rows = vllm.read_rows(reads)
    assert len(rows) == 3 and set(rows[0]) == {"none", "lmcache", "raykv"}
    assert [row["raykv"]["cached"] for row in rows] == [2048, 2048, 1024]
    assert [row["raykv"]["writer"] for row in rows] == [0, 1, 0]
    assert rows[2]["raykv"] == {"writer": 0, "cached": 1024, "loadable": 2048, "ttft_s": 0.1,
                                "writer_seconds": 0.3}


def test_an_engine_s_cached_tokens_leave_out_what_raykv_s_loads_did_not_fill():
    short = vllm.served({"cached": 160, "kv_transfer_params": {
        "raykv_loaded_tokens": 32, "raykv_unfilled_tokens": 128}})
    assert (short["cached"], short["vllm_cached"]) == (32, 160)
    lmcache = vllm.served({"cached": 160, "kv_transfer_params": None})  # says nothing
    assert (lmcache["cached"], lmcache["vllm_cached"]) == (160, 160)


def test_every_mode_s_engine_gets_the_same_cpu_binding(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    env = vllm.engine_env()  # the one environment of every mode's Engine process
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
