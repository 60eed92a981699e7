"""A phase run's per-request split and paired ratios (from its results.json), as the bench JSON
keeps them (vllm_serve_breakdown): per set-up TTFT p50/p99, cached share, replica shares, the
split (engine queue, engine prefill, outside the engine), and `against` paired by request with
every other set-up.

    .venv-vllm/bin/python -m cluster.tools.bench.vllm_serve_phases.split /tmp/phases \
        --against raykv-direct [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

from cluster.tools.bench.vllm_serve_breakdown import columns, paired, split
from cluster.tools.outputs import write_text_atomic


def condensed(results: dict, against: str) -> dict:
    cols = {}
    out: dict = {"setups": {}, "paired": {}, "ratios": {}}
    for name, result in results.items():
        sent = [SimpleNamespace(index=s["i"], status=s["status"], ttft_s=s["ttft_s"] or 0.0,
                                sent_at_s=s["sent_at_s"], prompt_tokens=s["prompt_tokens"],
                                cached_tokens=s["cached_tokens"],
                                engine_queue_ms=s["engine_queue_ms"],
                                engine_prefill_ms=s["engine_prefill_ms"])
                for s in result["sent"]]
        cols[name] = columns(sent)
        summary = result["summary"]
        out["setups"][name] = {
            "requests": summary["requests"], "errors": summary["errors"],
            "ttft_p50_ms": round(summary["ttft_p50_ms"], 1),
            "ttft_p99_ms": round(summary["ttft_p99_ms"], 1),
            "cached_share": round(summary["cached_tokens"] / max(1, summary["prompt_tokens"]), 3),
            "replica_shares": {k: round(v, 3) for k, v in summary["replica_shares"].items()},
            "split": split(cols[name]), "wall0": result["wall0"]}
    mine = out["setups"].get(against)
    for name in results:
        if name == against or mine is None:
            continue
        theirs = out["setups"][name]
        out["paired"][f"{against}_vs_{name}"] = paired(cols[against], cols[name])
        out["ratios"][f"{against}_vs_{name}"] = {
            "ttft_p50": round(mine["ttft_p50_ms"] / theirs["ttft_p50_ms"], 3),
            "ttft_p99": round(mine["ttft_p99_ms"] / theirs["ttft_p99_ms"], 3),
            "cached_tokens": round(mine["cached_share"] / max(1e-9, theirs["cached_share"]), 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--against", default="raykv-direct")
    parser.add_argument("--json")
    args = parser.parse_args()
    results = json.loads((Path(args.out_dir) / "results.json").read_text())
    report = condensed(results, args.against)
    text = json.dumps(report, indent=1)
    if args.json:
        write_text_atomic(args.json, text + "\n")
    print(text)


if __name__ == "__main__":
    main()
