"""`raykv bench vllm`: vLLM (CPU) with no connector, LMCache's multi-process connector and
RaykvConnector, on one workload of long shared prefixes and multi-turn sessions, in one run.

Run it from .venv-vllm (`make bench-vllm` builds it and LMCache's .venv-lmcache). Per mode,
two engine processes (cluster/tools/bench/vllm_engine.py) stand in for two replicas; all six
run at once. The workload (cluster/tools/bench/vllm_workload.py) is replayed one request at a
time, each turn on the other engine than the turn before, and each request in the three modes
one after another, in an order that rotates per request:

    none     vLLM alone: each engine reuses only its own prefix cache
    lmcache  LMCacheMPConnector; its server (LMCache's venv) on a free loopback port
    raykv    RaykvConnector; raykv on a private local Ray started here (pages of 128 tokens)

Each request asks for one token, so its time is its time to first token (TTFT). Figures:
TTFT p50/p99 per mode, the cross-engine hit ratio (tokens vLLM did not compute beyond what
its own cache could hold, over the tokens only the other engine had computed), whether the
greedy tokens with raykv are those without a connector, and what moving KV between raykv's
layout and vLLM's blocks costs next to a memcpy of the same bytes.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cluster.tools.bench import common
from cluster.tools.bench.vllm_workload import HitAccount, workload

ROOT = Path(__file__).resolve().parents[3]
# Run with -m from the repository root: run as a script, its own folder would come first on
# sys.path, and this module (bench/vllm.py) would shadow the vllm package.
ENGINE_MODULE = "cluster.tools.bench.vllm_engine"
LMCACHE_PYTHON = ROOT / ".venv-lmcache" / "bin" / "python"
BLOCK_TOKENS = 128  # vLLM's CPU block; raykv pages of the same size
MODEL = "small-llama"
NUM_SESSIONS, NUM_TURNS = 8, 4
QUICK_SESSIONS, QUICK_TURNS = 4, 2
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
MODES = ("none", "lmcache", "raykv")
GOALS = {"ttft_vs_lmcache": {"max": 1.0}, "ttft_p99_vs_lmcache": {"max": 1.0},
         "cross_engine_hit_ratio": {"min": 0.9}, "same_output": {"min": 1.0}}


class Engine:
    """One engine process: JSON requests on stdin, "RESULT" lines on stdout."""

    def __init__(self, python: str, model_dir: str, transfer: dict | None, log_path: str):
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT))
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [python, "-m", ENGINE_MODULE, model_dir, json.dumps(transfer)], env=env, cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)

    def wait_ready(self) -> None:
        self._read_until("READY", START_TIMEOUT_S)

    def ask(self, prompt: list[int], max_tokens: int = 1) -> dict:
        self.process.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.process.stdin.flush()
        return json.loads(self._read_until("RESULT ", REQUEST_TIMEOUT_S)[len("RESULT "):])

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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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


def start_lmcache(port: int, log_path: str) -> subprocess.Popen:
    if not LMCACHE_PYTHON.exists():
        raise RuntimeError(f"{LMCACHE_PYTHON} is missing: `make bench-vllm` builds it")
    command = [str(LMCACHE_PYTHON), "-m", "lmcache.v1.multiprocess.server", "--host",
               "localhost", "--port", str(port), "--chunk-size", "256", "--l1-size-gb", "1",
               "--eviction-policy", "LRU", "--supported-transfer-mode", "auto"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
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


def replay(engines: dict[str, list[Engine]], requests: list) -> dict[str, list[dict]]:
    """Each request on its engine in every mode, the modes one after another in an order that
    rotates per request (a noisy neighbour slows all three alike); one untimed warm-up request
    first on each engine."""
    for mode_engines in engines.values():
        for index, engine in enumerate(mode_engines):
            engine.ask([7 + index] * 300)
    accounts = {mode: HitAccount(BLOCK_TOKENS) for mode in engines}
    results: dict[str, list[dict]] = {mode: [] for mode in engines}
    order = list(engines)
    for number, request in enumerate(requests):
        for mode in order[number % len(order):] + order[:number % len(order)]:
            local, cross = accounts[mode].expect(request)
            answer = engines[mode][request.engine].ask(request.prompt)
            loaded = min(max(answer["cached"] - local, 0), cross)
            results[mode].append({**answer, "local": local, "cross": cross, "loaded": loaded,
                                  "prompt_tokens": len(request.prompt)})
    return results


def run_modes(model_dir: str, requests: list, work_dir: str) -> dict[str, list[dict]]:
    """Start every mode's two engines (and LMCache's server, and raykv), replay, stop all."""
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
        for mode_engines in engines.values():  # they load side by side
            for engine in mode_engines:
                engine.wait_ready()
        return replay(engines, requests)
    finally:
        for mode_engines in engines.values():
            for engine in mode_engines:
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
    start(CacheConfig(page_tokens=BLOCK_TOKENS, device_bytes=0, host_bytes=1 << 30,
                      disk_bytes=0))
    return ray.get_runtime_context().gcs_address


def summarize(results: list[dict]) -> dict:
    ttft_s = [r["seconds"] for r in results]
    cross = sum(r["cross"] for r in results)
    return {**common.latency_ms(ttft_s), "num_requests": len(results),
            "cross_tokens": cross, "loaded_tokens": sum(r["loaded"] for r in results),
            "cross_engine_hit_ratio": sum(r["loaded"] for r in results) / cross if cross else 0.0,
            "prompt_tokens": sum(r["prompt_tokens"] for r in results),
            "cached_tokens": sum(r["cached"] for r in results)}


def same_output(engines_runs: dict[str, list[dict]]) -> float:
    """The share of requests whose greedy tokens with raykv equal those without a connector."""
    pairs = list(zip(engines_runs["none"], engines_runs["raykv"], strict=True))
    return sum(a["ids"] == b["ids"] for a, b in pairs) / len(pairs)


def layout_cost(num_tokens: int = 2048, reps: int = 20) -> dict:
    """kv_to_blocks / blocks_to_kv of small-llama's KV (vLLM's CPU "vec" layout: K stored
    [D, B]) against np.copyto of the same bytes."""
    import numpy as np
    import torch

    from cluster.core.spec import ModelSpec
    from cluster.serving.vllm_layout import BlockLayout, blocks_to_kv, kv_to_blocks

    spec = ModelSpec.preset(MODEL)
    num_blocks = num_tokens // BLOCK_TOKENS
    layers = [torch.ones(num_blocks * 2, spec.num_kv_heads, BLOCK_TOKENS, 2 * spec.head_dim)
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


def run(json_path: str | None, quick: bool) -> dict:
    from cluster.serving.model_dir import save_model_dir

    sessions, turns = (QUICK_SESSIONS, QUICK_TURNS) if quick else (NUM_SESSIONS, NUM_TURNS)
    requests = workload(sessions, turns)
    work_dir = tempfile.mkdtemp(prefix="raykv-bench-vllm-")
    model_dir = save_model_dir(os.path.join(work_dir, MODEL), MODEL)
    result = {"benchmark": "vllm", "unit": "ms", "machine": common.machine_info(),
              "config": {"model": MODEL, "sessions": sessions, "turns": turns,
                         "requests": len(requests), "block_tokens": BLOCK_TOKENS,
                         "work_dir": work_dir}}
    runs = run_modes(model_dir, requests, work_dir)
    modes = {mode: summarize(results) for mode, results in runs.items()}
    raykv, lmcache, none = modes["raykv"], modes["lmcache"], modes["none"]
    result.update(modes=modes, layout=layout_cost(),
                  requests=[{mode: {k: runs[mode][i][k] for k in ("seconds", "cached", "local",
                                                                  "cross", "ids")}
                             for mode in MODES} for i in range(len(requests))])
    result["ratios"] = {
        "ttft_vs_lmcache": raykv["p50_ms"] / lmcache["p50_ms"],
        "ttft_p99_vs_lmcache": raykv["p99_ms"] / lmcache["p99_ms"],
        "cross_engine_hit_ratio": raykv["cross_engine_hit_ratio"],
        "ttft_vs_no_connector": raykv["p50_ms"] / none["p50_ms"],
        "same_output": same_output(runs)}
    result["goals"] = GOALS
    result["notes"] = {"lmcache_cross_engine_hit_ratio": lmcache["cross_engine_hit_ratio"],
                       "ttft_median_of_pairwise_ratios_vs_lmcache": statistics.median(
                           ours["seconds"] / theirs["seconds"]
                           for ours, theirs in zip(runs["raykv"], runs["lmcache"], strict=True))}
    return common.finish(result, json_path)
