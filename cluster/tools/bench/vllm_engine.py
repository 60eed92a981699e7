"""One vLLM engine process of `raykv bench vllm`, run by either venv's python from the
repository root:

    python -m cluster.tools.bench.vllm_engine MODEL_DIR KV_TRANSFER_JSON   ("null": none)

It reads one JSON request a line on stdin, {"prompt": [ids], "max_tokens": n}, and answers
each with one stdout line "RESULT {"ids": [...], "cached": n, "ttft_s": s, "seconds": s,
"kv_transfer_params": {...} or null}" (the connector's word on what its loads filled):
greedy decoding (temperature 0, EOS ignored); ttft_s is the wall time in this process from
adding the request to vLLM's engine until its first output token came back, seconds the time
until the last. It prints "READY" once the model is loaded and exits at end of input. It
imports no raykv module (only its light package __init__s), so LMCache's venv runs it as it
is; vLLM loads the connector it names.
"""

from __future__ import annotations

import json
import sys
import time


def generate(engine, request_id: str, request: dict) -> dict:
    """Run one request on vLLM's LLMEngine step by step, timing its first token."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=request["max_tokens"], ignore_eos=True)
    start_s = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": request["prompt"]}, params)
    ttft_s, final = None, None
    while final is None:
        for output in engine.step():
            if ttft_s is None and output.outputs and output.outputs[0].token_ids:
                ttft_s = time.perf_counter() - start_s
            if output.finished:
                final = output
    seconds = time.perf_counter() - start_s
    return {"ids": list(final.outputs[0].token_ids), "cached": final.num_cached_tokens or 0,
            "ttft_s": ttft_s, "seconds": seconds,
            "kv_transfer_params": getattr(final, "kv_transfer_params", None)}


def main() -> None:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    model_dir, transfer = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0,
              kv_transfer_config=KVTransferConfig(**transfer) if transfer else None)
    print("READY", flush=True)
    for number, line in enumerate(sys.stdin):
        result = generate(llm.llm_engine, f"bench-{number}", json.loads(line))
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    main()
