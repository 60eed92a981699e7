"""The faults of `raykv bench faults`, a registry: name -> (inject, the workload's operation
kinds whose success means "recovered"). Each inject function does the damage (and, for a
fault that lasts, holds it for `hold_s` and undoes it), and returns extra figures.

    node                 remove a worker node (a raylet and its node actor); add one back
    node_actor           kill the head node's actor (the put threads' home); Ray restarts it
    directory            kill every directory shard; Ray restarts them (recovery from Redis)
    redis                stop redis-server, then start it again on the same port
    client_mid_put       a client process reserves, writes half a page, exits
    stalled_writer       a client process stalls past its lease (before, then inside its
                         copy) while a burst of puts reuses the host tier (faults_stalled.py)
    serve_replica        kill one engine replica of the Serve app; Serve replaces it
    flipped_disk_bytes   flip a payload byte of every page in the head node's slab files
    torn_write           truncate the head node's slab in the middle of a page
                         (both: then wait until the workload read a damaged page, seen as
                         the node's disk_checksum_failures rising; it must rise)
    full_disk            every disk write fails with ENOSPC, for hold_s
    slow_disk            20 ms before every disk read and write, for hold_s
    event_batches        half the head node's event batches lost, the rest reordered, hold_s
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray

from actors.handles import DirectoryHandle, NodeHandle
from cluster.core.config import CacheConfig
from cluster.tools.bench.faults_stalled import stalled_writer
from cluster.tools.bench.faults_workload import (
    Workload,
    checked_get,
    full_get,
    page_sums,
)
from cluster.tools.doomed_writer import DoomedWriter, known_kv
from cluster.tools.slab_faults import flip_page_bytes, tear_slab

CALL_TIMEOUT_S = 30.0
DAMAGE_READ_WAIT_S = 30.0
MID_PUT_TOKENS = 64


@dataclass
class Context:
    """What the faults act on."""

    cluster: object  # ray.cluster_utils.Cluster
    node_args: dict
    victim: object  # the worker node that "node" removes
    head_id: str
    config: CacheConfig
    redis: object  # cluster.tools.redis_server.RedisServer
    workload: Workload
    hold_s: float
    spec: object
    extra: dict = field(default_factory=dict)


def _head(ctx: Context) -> NodeHandle:
    handle = NodeHandle.lookup(ctx.head_id, ctx.config)
    assert handle is not None, "the head node has no node actor"
    return handle


def _node(ctx: Context) -> dict:
    ctx.cluster.remove_node(ctx.victim)
    time.sleep(ctx.hold_s)
    ctx.victim = ctx.cluster.add_node(**ctx.node_args)
    ctx.cluster.wait_for_nodes()
    return {}


def _node_actor(ctx: Context) -> dict:
    ray.kill(_head(ctx).actor, no_restart=False)
    return {}


def _directory(ctx: Context) -> dict:
    for shard in DirectoryHandle.lookup(ctx.config).shards:
        ray.kill(shard, no_restart=False)
    return {}


def _redis(ctx: Context) -> dict:
    ctx.redis.stop()
    time.sleep(ctx.hold_s)
    ctx.redis.start()
    return {}


def _client_mid_put(ctx: Context) -> dict:
    """A writer dies mid-put; then (as an op, every 0.2 s) put the same prompt again until it
    is stored, and read it back checked, 3 times. Before that, any hit is a half page."""
    from cluster import connect

    tokens = [7_000_000 + i for i in range(MID_PUT_TOKENS)]
    kv = known_kv(ctx.spec, MID_PUT_TOKENS, 424242)
    sums = page_sums(kv, ctx.config.page_tokens)
    doomed = DoomedWriter.options(scheduling_strategy=_on(ctx.head_id)).remote(ctx.spec)
    try:
        ray.get(doomed.reserve_then_die.remote(tokens, kv), timeout=CALL_TIMEOUT_S)
    except ray.exceptions.RayActorError:
        pass  # it died, as it should
    client = connect(ctx.spec)
    deadline_s = time.monotonic() + ctx.config.reserve_lease_s + 30
    while (not ctx.workload.op("mid_put", _reput, client, tokens, kv, sums).ok
           and time.monotonic() < deadline_s):
        time.sleep(0.2)
    for _ in range(3):
        ctx.workload.op("mid_put", full_get, client, tokens, sums)
    return {"reserve_lease_s": ctx.config.reserve_lease_s}


def _reput(client, tokens: list[int], kv, sums: list[int]) -> tuple[bool, int]:
    """An op: a get (any page it finds must hold the bytes put), then a put of what is
    missing; ok once a get finds every token (a put into leased slots answers before its
    commit, which is refused while the dead writer's reservation holds the pages)."""
    num_tokens, wrong = checked_get(client, tokens, sums)
    if num_tokens < len(tokens):
        client.put(tokens, kv)
    return num_tokens == len(tokens) and not wrong, wrong


def _on(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def _serve_replica(ctx: Context) -> dict:
    from ray._private.state import actors

    def engines() -> list[dict]:
        return [a for a in actors().values() if a["State"] == "ALIVE"
                and "EngineDeployment" in a.get("ActorClassName", "")]

    before = len(engines())
    victim = engines()[0]
    killed_s = time.monotonic()
    ray.kill(ray.get_actor(victim["Name"], namespace="serve"), no_restart=True)
    deadline_s = killed_s + 120
    while len(engines()) < before and time.monotonic() < deadline_s:
        time.sleep(0.5)
    return {"replaced_s": time.monotonic() - killed_s}


def _damaged(damage: Callable[[str], int], what: str) -> Callable[[Context], dict]:
    """Damage the head node's slabs (damage(disk_dir) -> pages damaged), then wait until the
    workload read a damaged page: the node's disk_checksum_failures rose (or
    DAMAGE_READ_WAIT_S passed; then the fault was not exercised)."""

    def inject(ctx: Context) -> dict:
        head = _head(ctx)
        before = ray.get(head.stats(), timeout=CALL_TIMEOUT_S)
        damaged = damage(before["disk_dir"])
        deadline_s = time.monotonic() + DAMAGE_READ_WAIT_S
        while True:
            after = ray.get(head.stats(), timeout=CALL_TIMEOUT_S)["disk_checksum_failures"]
            failures = after - before["disk_checksum_failures"]
            if failures > 0 or time.monotonic() > deadline_s:
                return {what: damaged, "checksum_failures": failures}
            time.sleep(0.2)

    return inject


def _held(kind: str, **params) -> Callable[[Context], dict]:
    def inject(ctx: Context) -> dict:
        head = _head(ctx)
        ray.get(head.inject_fault(kind, **params), timeout=CALL_TIMEOUT_S)
        time.sleep(ctx.hold_s)
        described = ray.get(head.inject_fault("clear"), timeout=CALL_TIMEOUT_S)
        stats = ray.get(head.stats(), timeout=CALL_TIMEOUT_S)
        return {"node_faults_after": described, "events": stats["events"]}

    return inject


KV_KINDS = ("put", "remote")
FAULTS: dict[str, tuple[Callable[[Context], dict], tuple[str, ...]]] = {
    "node": (_node, KV_KINDS),
    "node_actor": (_node_actor, KV_KINDS),
    "directory": (_directory, KV_KINDS),
    "redis": (_redis, KV_KINDS),
    "client_mid_put": (_client_mid_put, ("mid_put",)),
    "stalled_writer": (stalled_writer, KV_KINDS),
    "serve_replica": (_serve_replica, ("http",)),
    "flipped_disk_bytes": (_damaged(flip_page_bytes, "damaged_pages"), KV_KINDS),
    "torn_write": (_damaged(tear_slab, "torn_pages"), KV_KINDS),
    "full_disk": (_held("full_disk"), KV_KINDS),
    "slow_disk": (_held("slow_disk", delay_s=0.02), KV_KINDS),
    "event_batches": (_held("event_batches", drop_fraction=0.5, reorder=True, seed=1),
                      KV_KINDS),
}


def http_loop(url: str, model: str, expected: dict[str, str]):
    """A workload thread: greedy completions of fixed prompts over HTTP; the text must be the
    one answered before any fault. An OpenAI-shaped error is a clear error (not ok, not a
    client error)."""
    import requests

    def loop(work: Workload) -> None:
        for index in itertools.count():
            if not work.running():
                return
            text_prompt = list(expected)[index % len(expected)]
            work.op("http", _http_op, requests, url, model, text_prompt, expected[text_prompt])
            time.sleep(0.05)

    return loop


def completion(requests_module, url: str, model: str, text_prompt: str):
    return requests_module.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": text_prompt, "max_tokens": 4, "temperature": 0})


def _http_op(requests_module, url, model, text_prompt, expected) -> tuple[bool, int]:
    """An op: one completion. A 200 must carry the expected text (else a wrong answer); an
    OpenAI-shaped error is not ok; anything else (no answer, not JSON) raises: an error."""
    reply = completion(requests_module, url, model, text_prompt)
    try:
        body = reply.json()
    except ValueError as error:
        raise RuntimeError(f"HTTP {reply.status_code}, not JSON") from error
    if reply.status_code == 200:
        text = body["choices"][0]["text"]
        return text == expected, int(text != expected)
    if isinstance(body.get("error"), dict) and "message" in body["error"]:
        return False, 0
    raise RuntimeError(f"HTTP {reply.status_code}: {str(body)[:200]}")
