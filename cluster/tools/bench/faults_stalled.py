"""The "stalled writer" fault of `raykv bench faults`: a client process on the head node
reserves slots for a put, stalls past `reserve_lease_s` (before its copy, then inside it), and
writes only after the node let those slots go and a burst of other puts cycled the host tier
through them. No page may change under the late write.

    for each stall (before_copy, mid_copy):
        the writer reserves, marks itself stalled         (cluster/tools/doomed_writer.py)
        its reservation lapses (the node's expired_reservations grows)
        a burst of puts, more pages than the host tier holds, each read back checked
        the writer is released: its late copy runs (or is fenced off), its put returns
        every page of the burst read back again, checked

`stalled_writes` counts the late writes that ran after their reservation had lapsed; with none
(the writer never stalled, the lease never lapsed), the fault proved nothing and the bench
fails on it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import ray

from actors.handles import NodeHandle
from cluster.tools.bench.faults_workload import checked_get, page_sums, put_and_get
from cluster.tools.doomed_writer import STALLS, DoomedWriter, known_kv

CALL_TIMEOUT_S = 30.0
WAIT_S = 60.0
BURST_PROMPT_TOKENS = 256
TOKEN_BASE = 8_000_000


def stalled_writer(ctx) -> dict:
    """Run each stall in turn (ctx: faults_inject.Context); returns the figures."""
    from cluster import connect

    head = NodeHandle.lookup(ctx.head_id, ctx.config)
    client = connect(ctx.spec)
    attempts = 0
    for index, stall in enumerate(STALLS):
        attempts += _one_stall(ctx, head, client, stall, index)
    return {"stalled_writes": attempts, "stalls": list(STALLS),
            "reserve_lease_s": ctx.config.reserve_lease_s}


def _one_stall(ctx, head: NodeHandle, client, stall: str, index: int) -> int:
    """1 when the writer's late write ran after its reservation lapsed, else 0."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    marker_dir = tempfile.mkdtemp(prefix="raykv-stalled-")
    writer = DoomedWriter.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        ctx.head_id, soft=False)).remote(ctx.spec)
    try:
        expired_before = _expired(head)
        tokens = [TOKEN_BASE + 10_000 * index + i for i in range(64)]
        late = writer.put_stalled.remote(tokens, known_kv(ctx.spec, 64, 777 + index), stall,
                                         marker_dir)
        if not _wait(lambda: os.path.exists(os.path.join(marker_dir, "stalled"))):
            return 0
        lapsed = _wait(lambda: _expired(head) > expired_before)
        burst = _burst(ctx, client, index)
        open(os.path.join(marker_dir, "release"), "w").close()
        ray.get(late, timeout=CALL_TIMEOUT_S)
        _check(ctx, client, burst, "stalled_after")
        return int(lapsed)
    finally:
        ray.kill(writer)
        shutil.rmtree(marker_dir, ignore_errors=True)


def _burst(ctx, client, index: int) -> list[tuple[list[int], list[int]]]:
    """Puts of more pages than the host tier holds, each read back checked (as ops);
    returns (tokens, page sums) of each prompt."""
    page_bytes = ctx.spec.bytes_per_token * ctx.config.page_tokens
    num_pages = ctx.config.host_bytes // page_bytes + 64
    num_prompts = -(-num_pages * ctx.config.page_tokens // BURST_PROMPT_TOKENS)
    burst = []
    for prompt in range(num_prompts):
        tokens = [TOKEN_BASE + 1_000_000 * (index + 1) + BURST_PROMPT_TOKENS * prompt + i
                  for i in range(BURST_PROMPT_TOKENS)]
        kv = known_kv(ctx.spec, BURST_PROMPT_TOKENS, 50_000 + 1000 * index + prompt)
        sums = page_sums(kv, ctx.config.page_tokens)
        ctx.workload.op("stalled", put_and_get, client, tokens, kv, sums)
        burst.append((tokens, sums))
    return burst


def _check(ctx, client, burst: list, kind: str) -> None:
    """Read every prompt of the burst again, after the late write (as ops: ok unless a page
    came back with other bytes; one evicted since is no failure)."""
    for tokens, sums in burst:
        ctx.workload.op(kind, _unchanged, client, tokens, sums)


def _unchanged(client, tokens: list[int], sums: list[int]) -> tuple[bool, int]:
    wrong = checked_get(client, tokens, sums)[1]
    return not wrong, wrong


def _expired(head: NodeHandle) -> int:
    return ray.get(head.stats(), timeout=CALL_TIMEOUT_S)["expired_reservations"]


def _wait(predicate) -> bool:
    deadline_s = time.monotonic() + WAIT_S
    while time.monotonic() < deadline_s:
        if predicate():
            return True
        time.sleep(0.1)
    return False
