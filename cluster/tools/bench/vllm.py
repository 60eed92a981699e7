"""`raykv bench vllm`: vLLM (CPU) with no connector, LMCache's multi-process connector and
RaykvConnector, on one workload of long shared prefixes and multi-turn sessions, in one run.

Run it from .venv-vllm (`make bench-vllm` builds it and LMCache's .venv-lmcache). Per mode,
two engine processes (cluster/tools/bench/vllm_engine.py) stand in for two replicas; all six
run at once:

    none     vLLM alone: each engine reuses only its own prefix cache
    lmcache  LMCacheMPConnector, LMCache's multi-process mode (its docs' way to share KV
             between vLLM instances): its server, in LMCache's venv, on a free loopback port,
             chunks of PAGE_TOKENS, a 1 GiB L1 in CPU memory, LRU eviction, as many
             workers as raykv's client has copy threads
    raykv    RaykvConnector; raykv on a private local Ray started here, pages of PAGE_TOKENS,
             a 1 GiB host tier

PAGE_TOKENS (128) is vLLM's CPU block, raykv's page and LMCache's chunk, and every part of
the workload (cluster/tools/bench/vllm_workload.py) is whole pages. Phases:

    warm-up       untimed, every mode: a full-length prompt on one engine, then on the other
                  (the connector's store and load paths), and back the other way
    workload      every request once in each mode, harness.interleave rounds of one request,
                  the modes' order rotating per request; each turn of a session lands on the
                  other engine than the turn before
    back to back  per prompt and mode: one engine computes a fresh full-length prompt and the
                  other engine asks for it right after, nothing in between (not rotated
                  within the pair); the writer alternates per prompt

Each request decodes MAX_TOKENS greedy tokens; its TTFT is timed inside the engine process.
Ratios: ttft_vs_lmcache, the median of per-request TTFT ratios raykv / LMCache (with their
spread); ttft_p99_vs_lmcache, raykv's p99 TTFT over LMCache's, over the same paired requests;
cross_engine_hit_ratio, of the back-to-back reads, the tokens raykv loaded over what a cache
of whole pages could hand over (the prompt's whole pages, all but its last token);
same_output, the share of requests whose MAX_TOKENS greedy tokens with raykv equal those
without a connector. The TTFT ratios fail (null) unless both
caches handed KV across engines in the workload. Also: what moving KV between raykv's layout
and vLLM's blocks costs next to a memcpy of the same bytes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cluster.serving.vllm_plan import served_tokens
from cluster.tools.bench import common, harness, vllm_serve_setups
from cluster.tools.bench.vllm_workload import (
    PAGE_TOKENS,
    HitAccount,
    back_to_back_prompts,
    loadable_tokens,
    loaded_tokens,
    longest_prompt_tokens,
    warmup_prompt,
    workload,
)
from cluster.tools.redis_server import free_port

ROOT = Path(__file__).resolve().parents[3]
# Run with -m from the repository root: run as a script, its own folder would come first on
# sys.path, and this module (bench/vllm.py) would shadow the vllm package.
ENGINE_MODULE = "cluster.tools.bench.vllm_engine"
LMCACHE_PYTHON = ROOT / ".venv-lmcache" / "bin" / "python"
LMCACHE_L1_GB = 1
MODEL = "small-llama"
MAX_TOKENS = 16
NUM_SESSIONS, NUM_TURNS, NUM_BACK_TO_BACK = 8, 4, 4
QUICK_SESSIONS, QUICK_TURNS, QUICK_BACK_TO_BACK = 4, 2, 3
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
MODES = ("none", "lmcache", "raykv")
GOALS = {"ttft_vs_lmcache": {"max": 0.9}, "ttft_p99_vs_lmcache": {"max": 1.0},
         "cross_engine_hit_ratio": {"min": 0.9}, "same_output": {"min": 1.0}}


def served(answer: dict) -> dict:
    """An engine's answer, its `cached` the tokens a cache served: vLLM's count (kept as
    `vllm_cached`) less what raykv's connector says its loads did not fill. vLLM counts a
    load that fell short whole; LMCache's connector says nothing, so its count stays vLLM's."""
    answer["vllm_cached"] = answer["cached"]
    answer["cached"] = served_tokens(answer["cached"], answer.get("kv_transfer_params"))
    return answer


def engine_env() -> dict[str, str]:
    """Every mode's engine environment, as bench vllm-serve gives its engines (its
    engine_env: 1 GiB of KV space, the same CPU binding for all). Left
    to vLLM, an engine with a KV connector (raykv's, LMCache's) reserved one core more, and on
    2 cores that gave it 2 OpenMP threads on both cores, against 1 on core 0 for the engine
    with none: `ttft_vs_no_connector` compared the cores, not the connector (runs before
    this change)."""
    return dict(os.environ, PYTHONPATH=str(ROOT), **vllm_serve_setups.engine_env(1))


class Engine:
    """One engine process: JSON requests on stdin, "RESULT" lines on stdout."""

    def __init__(self, python: str, model_dir: str, transfer: dict | None, log_path: str):
        env = engine_env()
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [python, "-m", ENGINE_MODULE, model_dir, json.dumps(transfer)], env=env, cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)

    def wait_ready(self) -> None:
        self._read_until("READY", START_TIMEOUT_S)

    def ask(self, prompt: list[int]) -> dict:
        self.process.stdin.write(json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS}) + "\n")
        self.process.stdin.flush()
        return served(json.loads(self._read_until("RESULT ", REQUEST_TIMEOUT_S)[len("RESULT "):]))

    def _read_until(self, prefix: str, timeout_s: float) -> str:
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:  # stdout carries vLLM's own lines too
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"engine exited (code {self.process.poll()}); see "
                                   f"{self._log.name}")
            if line.startswith(prefix):
                return line.strip()
        raise TimeoutError(f"no {prefix.strip()} from the engine within {timeout_s} s")

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def wait_port(port: int, process: subprocess.Popen, timeout_s: float) -> None:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        if process.poll() is not None:
            raise RuntimeError(f"LMCache's server exited with code {process.returncode}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"LMCache's server did not listen on {port} within {timeout_s} s")


def lmcache_command(port: int) -> list[str]:
    """LMCache's MP server as its docs start it (`--l1-size-gb N --eviction-policy LRU`), its
    chunk raykv's page, with as many workers as raykv has copy threads."""
    from cluster.core.copies import COPY_THREADS

    return [str(LMCACHE_PYTHON), "-m", "lmcache.v1.multiprocess.server", "--host", "localhost",
            "--port", str(port), "--chunk-size", str(PAGE_TOKENS), "--l1-size-gb",
            str(LMCACHE_L1_GB), "--eviction-policy", "LRU", "--max-workers", str(COPY_THREADS),
            "--supported-transfer-mode", "auto"]


def start_lmcache(port: int, log_path: str) -> subprocess.Popen:
    if not LMCACHE_PYTHON.exists():
        raise RuntimeError(f"{LMCACHE_PYTHON} is missing: `make bench-vllm` builds it")
    with open(log_path, "w") as log:
        process = subprocess.Popen(lmcache_command(port), stdout=log, stderr=subprocess.STDOUT)
    wait_port(port, process, START_TIMEOUT_S)
    return process


def transfer_config(mode: str, port: int | None, ray_address: str | None) -> dict | None:
    if mode == "lmcache":
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost",
                                              "lmcache.mp.port": port}}
    if mode == "raykv":
        from cluster.serving.vllm_app import kv_transfer_config

        return {**kv_transfer_config(MODEL, "default", ray_address)}
    return None


def warm_up(engines: dict[str, list[Engine]], num_tokens: int) -> None:
    """Untimed, per mode: each engine computes a full-length prompt and the other asks for it
    right after, so that no timed request is an engine's or a connector's first."""
    for first, second in ((0, 1), (1, 0)):
        prompt = warmup_prompt(first, num_tokens)
        for pair in engines.values():
            pair[first].ask(prompt)
            pair[second].ask(prompt)


def replay(engines: dict[str, list[Engine]], requests: list) -> dict[str, list[dict]]:
    """The workload: one harness round per request, every mode once, in rotating order."""
    accounts = {mode: HitAccount() for mode in engines}
    answers: dict[str, list[dict]] = {mode: [] for mode in engines}

    def contender(mode: str):
        def one(index: int) -> float:
            request = requests[index]
            local, cross = accounts[mode].expect(request)
            answer = engines[mode][request.engine].ask(request.prompt)
            answers[mode].append({**answer, "local": local, "cross": cross,
                                  "loaded": loaded_tokens(answer["cached"], local, cross),
                                  "prompt_tokens": len(request.prompt)})
            return answer["ttft_s"]
        return one

    harness.interleave({mode: contender(mode) for mode in engines}, len(requests))
    return answers


def back_to_back(engines: dict[str, list[Engine]], prompts: list[list[int]]
                 ) -> dict[str, list[dict]]:
    """Per prompt and mode: one engine computes it, the other asks right after. Rounds rotate
    the modes' order; nothing runs between a writer and its reader."""
    reads: dict[str, list[dict]] = {mode: [] for mode in engines}

    def contender(mode: str):
        def one(index: int) -> float:
            prompt = prompts[index]
            writer, reader = engines[mode][index % 2], engines[mode][1 - index % 2]
            written = writer.ask(prompt)
            answer = reader.ask(prompt)
            reads[mode].append({**answer, "written_ids": written["ids"],
                                "loadable": loadable_tokens(len(prompt)),
                                "writer": index % 2, "writer_seconds": written["seconds"]})
            return answer["ttft_s"]
        return one

    harness.interleave({mode: contender(mode) for mode in engines}, len(prompts))
    return reads


def run_modes(model_dir: str, plan: dict, work_dir: str, phase_s: dict) -> tuple[dict, dict]:
    """Start every mode's two engines (and LMCache's server, and raykv), run the phases,
    stop all; (workload answers, back-to-back reads) per mode. phase_s gets each phase's
    seconds."""
    since_s = time.monotonic()

    def lap(phase: str) -> None:
        nonlocal since_s
        phase_s[phase], since_s = time.monotonic() - since_s, time.monotonic()

    port = free_port()
    server = start_lmcache(port, os.path.join(work_dir, "lmcache-server.log"))
    engines: dict[str, list[Engine]] = {}
    try:
        address = start_raykv()
        for mode in MODES:
            python = str(LMCACHE_PYTHON) if mode == "lmcache" else sys.executable
            engines[mode] = [Engine(python, model_dir, transfer_config(mode, port, address),
                                    os.path.join(work_dir, f"{mode}-engine{i}.log"))
                             for i in range(2)]
        for pair in engines.values():  # they load side by side
            for engine in pair:
                engine.wait_ready()
        lap("start")
        warm_up(engines, plan["prompt_tokens"])
        lap("warm_up")
        answers = replay(engines, plan["requests"])
        lap("workload")
        reads = back_to_back(engines, plan["back_to_back"])
        lap("back_to_back")
        return answers, reads
    finally:
        for pair in engines.values():
            for engine in pair:
                engine.close()
        server.terminate()
        server.wait(timeout=30)
        common.stop_service()


def start_raykv() -> str:
    import ray

    from cluster import start
    from cluster.core.config import CacheConfig

    common.ensure_local_ray(512 * common.MiB)
    common.stop_service()
    start(CacheConfig(page_tokens=PAGE_TOKENS, device_bytes=0, host_bytes=1 << 30,
                      disk_bytes=0))
    return ray.get_runtime_context().gcs_address


# ---- figures and ratios (pure) --------------------------------------------------------------


def summarize(answers: list[dict], reads: list[dict]) -> dict:
    """One mode's workload TTFTs and hits, and its back-to-back reads."""
    ttft_s = [a["ttft_s"] for a in answers]
    cross, loaded = sum(a["cross"] for a in answers), sum(a["loaded"] for a in answers)
    read_loaded, loadable = back_to_back_hits(reads)
    return {**common.latency_ms(ttft_s), "num_requests": len(answers),
            "prompt_tokens": sum(a["prompt_tokens"] for a in answers),
            "cached_tokens": sum(a["cached"] for a in answers),
            "cross_tokens": cross, "loaded_tokens": loaded,
            "workload_cross_engine_hit_ratio": loaded / cross if cross else None,
            "back_to_back": {"num_reads": len(reads), "loadable_tokens": loadable,
                             "loaded_tokens": read_loaded,
                             "hit_ratio": read_loaded / loadable if loadable else None,
                             **common.latency_ms([r["ttft_s"] for r in reads])}}


def back_to_back_hits(reads: list[dict]) -> tuple[int, int]:
    """(tokens the readers got from the cache, whole pages they could have got)."""
    return (sum(min(r["cached"], r["loadable"]) for r in reads),
            sum(r["loadable"] for r in reads))


def outputs(answers: list[dict], reads: list[dict]) -> list[list[int]]:
    """Every greedy output of a mode: workload requests, back-to-back writers and readers."""
    return ([a["ids"] for a in answers] + [r["written_ids"] for r in reads]
            + [r["ids"] for r in reads])


def same_share(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """The share of requests whose generated ids are the same."""
    pairs = list(zip(ours, theirs, strict=True))
    return sum(a == b for a, b in pairs) / len(pairs)


def fill_ratios(report: harness.Report, answers: dict[str, list[dict]],
                reads: dict[str, list[dict]]) -> None:
    ttft_s = {mode: [a["ttft_s"] for a in answers[mode]] for mode in answers}
    loaded = {mode: sum(a["loaded"] for a in answers[mode]) for mode in answers}
    both_hit = loaded["raykv"] > 0 and loaded["lmcache"] > 0
    why = (f"tokens loaded across engines in the workload: raykv {loaded['raykv']}, lmcache "
           f"{loaded['lmcache']}; a TTFT ratio needs both caches to have handed KV over")
    if report.require("ttft_vs_lmcache", both_hit, why):
        report.paired("ttft_vs_lmcache", ttft_s["raykv"], ttft_s["lmcache"])
    if report.require("ttft_p99_vs_lmcache", both_hit, why):
        report.ratio("ttft_p99_vs_lmcache", common.percentile_ms(ttft_s["raykv"], 99)
                     / common.percentile_ms(ttft_s["lmcache"], 99))
    report.paired("ttft_vs_no_connector", ttft_s["raykv"], ttft_s["none"])
    read_loaded, loadable = back_to_back_hits(reads["raykv"])
    if report.require("cross_engine_hit_ratio", loadable > 0, "no back-to-back read"):
        report.ratio("cross_engine_hit_ratio", read_loaded / loadable)
    ours, plain = outputs(answers["raykv"], reads["raykv"]), outputs(answers["none"],
                                                                     reads["none"])
    compared = min(len(ids) for ids in ours + plain)
    exercised = compared >= MAX_TOKENS and (loaded["raykv"] + read_loaded) > 0
    if report.require("same_output", exercised, f"{compared} tokens compared (at least "
                      f"{MAX_TOKENS}), {loaded['raykv'] + read_loaded} loaded by raykv"):
        report.ratio("same_output", same_share(ours, plain))
    report["lmcache_same_output"] = same_share(outputs(answers["lmcache"], reads["lmcache"]),
                                               plain)


def request_rows(answers: dict[str, list[dict]]) -> list[dict]:
    keys = ("ttft_s", "seconds", "cached", "local", "cross", "loaded")
    return [{mode: {key: answers[mode][i][key] for key in keys} for mode in answers}
            for i in range(len(answers["none"]))]


def read_rows(reads: dict[str, list[dict]]) -> list[dict]:
    """Per back-to-back read, per mode: which engine wrote, what the reader got from the
    cache and its TTFT (a miss is told apart from a slow load here)."""
    keys = ("writer", "cached", "loadable", "ttft_s", "writer_seconds")
    return [{mode: {key: reads[mode][i][key] for key in keys} for mode in reads}
            for i in range(len(reads["none"]))]


def layout_cost(num_tokens: int = 2048, reps: int = 20) -> dict:
    """kv_to_blocks / blocks_to_kv of small-llama's KV (vLLM's CPU "vec" layout: K stored
    [D, B]) against np.copyto of the same bytes."""
    import numpy as np
    import torch

    from cluster.core.spec import ModelSpec
    from cluster.serving.vllm_layout import BlockLayout, blocks_to_kv, kv_to_blocks

    spec = ModelSpec.preset(MODEL)
    num_blocks = num_tokens // PAGE_TOKENS
    layers = [torch.ones(num_blocks * 2, spec.num_kv_heads, PAGE_TOKENS, 2 * spec.head_dim)
              for _ in range(spec.num_layers)]
    block_ids = list(range(1, 2 * num_blocks, 2))
    kv = torch.ones(spec.page_shape(num_tokens))
    out = common.touched_like(kv)
    flat, flat_out = kv.numpy().reshape(-1), out.numpy().reshape(-1)
    num_bytes = kv.numel() * kv.element_size()
    layout = BlockLayout(key_transposed=True)
    into_s = common.warm_median_s(lambda: kv_to_blocks(kv, layers, layout, block_ids,
                                                       (0, num_tokens)), reps)
    out_s = common.warm_median_s(lambda: blocks_to_kv(layers, layout, block_ids, num_tokens,
                                                      out), reps)
    memcpy_s = common.warm_median_s(lambda: np.copyto(flat_out, flat), reps)
    return {"num_bytes": num_bytes, "into_blocks_gbps": num_bytes / into_s / 1e9,
            "out_of_blocks_gbps": num_bytes / out_s / 1e9,
            "memcpy_gbps": num_bytes / memcpy_s / 1e9,
            "into_blocks_vs_memcpy": memcpy_s / into_s, "out_of_blocks_vs_memcpy": memcpy_s / out_s}


def plan_of(quick: bool) -> dict:
    sessions, turns, num_reads = ((QUICK_SESSIONS, QUICK_TURNS, QUICK_BACK_TO_BACK) if quick
                                  else (NUM_SESSIONS, NUM_TURNS, NUM_BACK_TO_BACK))
    prompt_tokens = longest_prompt_tokens(turns)
    return {"sessions": sessions, "turns": turns, "requests": workload(sessions, turns),
            "prompt_tokens": prompt_tokens,
            "back_to_back": back_to_back_prompts(num_reads, prompt_tokens)}


def notes_of(plan: dict) -> list[str]:
    return [
        f"workload: {plan['sessions']} sessions x {plan['turns']} turns = "
        f"{len(plan['requests'])} requests per mode; a shared system prefix, a document per "
        f"session, each turn {PAGE_TOKENS} tokens more (prompts of up to "
        f"{plan['prompt_tokens']} tokens, all whole pages of {PAGE_TOKENS})",
        f"every request decodes {MAX_TOKENS} greedy tokens; TTFT is timed in the engine "
        "process, from adding the request to vLLM's LLMEngine to its first token",
        "warm-up: per mode, two untimed full-length prompts, each computed on one engine and "
        "read on the other",
        "ttft_vs_lmcache: median over the workload's requests of raykv's TTFT / LMCache's "
        "(harness rounds of one request, the modes' order rotating); ttft_p99_vs_lmcache: "
        "the p99 of raykv's TTFTs over the p99 of LMCache's, same requests",
        f"cross_engine_hit_ratio: {len(plan['back_to_back'])} back-to-back reads of fresh "
        f"{plan['prompt_tokens']}-token prompts (one engine computes, the other asks right "
        "after): tokens loaded over the prompt's whole pages less its last token",
        f"LMCache: {LMCACHE_L1_GB} GiB L1, chunk {PAGE_TOKENS}, LRU, as many workers as raykv's "
        "copy threads (lmcache_command)"]


def run(json_path: str | None, quick: bool, **_extra) -> dict:
    from cluster.serving.model_dir import save_model_dir

    plan = plan_of(quick)
    work_dir = tempfile.mkdtemp(prefix="raykv-bench-vllm-")
    model_dir = save_model_dir(os.path.join(work_dir, MODEL), MODEL)
    config = {"model": MODEL, "sessions": plan["sessions"], "turns": plan["turns"],
              "requests": len(plan["requests"]), "back_to_back": len(plan["back_to_back"]),
              "page_tokens": PAGE_TOKENS, "max_tokens": MAX_TOKENS, "work_dir": work_dir}
    report = harness.Report("vllm", "ms", config, GOALS, notes_of(plan))
    report["lmcache_command"] = lmcache_command(0)[1:]
    report["phase_s"] = {}
    answers, reads = run_modes(model_dir, plan, work_dir, report["phase_s"])
    report["modes"] = {mode: summarize(answers[mode], reads[mode]) for mode in MODES}
    report["requests"] = request_rows(answers)
    report["back_to_back_reads"] = read_rows(reads)
    report["layout"] = layout_cost()
    fill_ratios(report, answers, reads)
    return report.finish(json_path)
