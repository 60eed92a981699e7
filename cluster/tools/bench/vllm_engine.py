"""One vLLM engine process of `raykv bench vllm`, run by either venv's python from the
repository root:

    python -m cluster.tools.bench.vllm_engine MODEL_DIR KV_TRANSFER_JSON   ("null": none)

It reads one JSON request a line on stdin, {"prompt": [ids], "max_tokens": n}, and answers
each with one stdout line "RESULT {"ids": [...], "cached": n, "seconds": s}", where seconds is
the wall time of the generate call in this process (with max_tokens=1: the time to the first
token). It prints "READY" once the model is loaded and exits at end of input. It imports no
raykv module (only its light package __init__s), so LMCache's venv runs it as it is; vLLM
loads the connector it names.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    model_dir, transfer = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0,
              kv_transfer_config=KVTransferConfig(**transfer) if transfer else None)
    print("READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(temperature=0, max_tokens=request["max_tokens"],
                                ignore_eos=True)
        start_s = time.perf_counter()
        (output,) = llm.generate([{"prompt_token_ids": request["prompt"]}], params,
                                 use_tqdm=False)
        seconds = time.perf_counter() - start_s
        result = {"ids": list(output.outputs[0].token_ids),
                  "cached": output.num_cached_tokens or 0, "seconds": seconds}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    main()
