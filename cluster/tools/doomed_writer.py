"""Client processes that fail in the middle of a put (test-only).

    DoomedWriter.reserve_then_die    "kill a client mid-put": its reservation must lapse after
                                     `reserve_lease_s`, and no half-written page be served
    DoomedWriter.lease_then_die      "kill a client holding leased slots": it writes into slots
                                     of its lease and dies before their commit; the node must
                                     take them back after `reserve_lease_s`, none of it served
    DoomedWriter.put_stalled         "a stalled writer": a put that stalls past its lease,
                                     before its copy or in the middle of it, until released;
                                     its late bytes must never land in another page's slot
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import ray
import torch

from cluster import connect
from cluster.calls import Wait, run_sync
from cluster.core.kvcheck import page_slices
from cluster.core.spec import ModelSpec


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class DoomedWriter:
    """A same-node client (place it on a kv node) that reserves, writes, and dies."""

    def __init__(self, spec: ModelSpec):
        self.client = connect(spec)

    def pid(self) -> int:
        return os.getpid()

    def reserve_then_die(self, tokens: list[int], kv: torch.Tensor) -> None:
        """Reserve every page of `tokens`, copy half of the first page's bytes into its
        slot, and exit without committing or aborting (as a process killed there would)."""
        client = self.client
        keys = client.keys(tokens)
        reply = ray.get(client.local.reserve(client.geometry, keys, client.namespace),
                        timeout=client.timeout_s)
        epoch, _, slots = reply
        if not run_sync(client.view.slabs.ensure(epoch), client.timeout_s):
            os._exit(2)
        tier, slot, _ = next(s for s in slots if s is not None)
        target = client.view.slabs.page(tier, slot).reshape(-1).view(torch.uint8)
        source = kv[:, :, :, page_slices(0, client.page_tokens)].contiguous()
        half_bytes = target.numel() // 2
        target[:half_bytes].copy_(source.reshape(-1).view(torch.uint8)[:half_bytes])
        os._exit(1)

    def leased_slots(self, tokens: list[int], kv: torch.Tensor, num_slots: int) -> int:
        """Put once (a put that finds no lease reserves, and starts the client's lease), then
        wait until `num_slots` slots are leased; returns how many are."""
        self.client.put(tokens, kv)
        deadline_s = time.monotonic() + 30.0
        while len(self.client.puts.pool.free) < num_slots and time.monotonic() < deadline_s:
            time.sleep(0.01)
        return len(self.client.puts.pool.free)

    def lease_then_die(self, tokens: list[int], kv: torch.Tensor) -> None:
        """Take leased slots for every page of `tokens`, copy half of the first page in, and
        exit before the commit (as a process killed there would)."""
        client = self.client
        places = client.puts.take(len(client.keys(tokens)))
        if places is None:
            os._exit(2)
        tier, slot, _ = places[0].tolist()
        target = client.view.slabs.page(tier, slot).reshape(-1).view(torch.uint8)
        source = kv[:, :, :, page_slices(0, client.page_tokens)].contiguous()
        half_bytes = target.numel() // 2
        target[:half_bytes].copy_(source.reshape(-1).view(torch.uint8)[:half_bytes])
        os._exit(1)

    def put_stalled(self, tokens: list[int], kv: torch.Tensor, stall: str,
                    marker_dir: str) -> int:
        """client.put(tokens, kv) with a stall (a key of STALLS) after its reserve: it writes
        `marker_dir`/stalled once stalled and waits for `marker_dir`/release. Returns the
        tokens the put reports stored."""
        import cluster.client as client_module

        hook = _Stall(marker_dir)
        real_copy = client_module.copy_pages
        if stall == "mid_copy":  # inside the copy (and its fence, where there is one)
            client_module.copy_pages = lambda pairs: (hook.wait(), real_copy(pairs))[1]
        try:
            return _drive(self.client._put(tokens, kv), self.client.timeout_s,
                          hook.wait if stall == "before_copy" else None)
        finally:
            client_module.copy_pages = real_copy

    def put_in_background(self, prompts: list[list[int]], seeds: list[int],
                          num_tokens: int) -> None:
        """Put each prompt (KV from kv_of(seed)) in a thread, until this process is killed."""
        def loop() -> None:
            for tokens, seed in zip(prompts, seeds, strict=True):
                self.client.put(tokens, known_kv(self.client.spec, num_tokens, seed))

        threading.Thread(target=loop, daemon=True).start()


def known_kv(spec: ModelSpec, num_tokens: int, seed: int) -> torch.Tensor:
    """[L, 2, H, num_tokens, D] of seeded normals in spec's dtype (the same as tests/kv.py)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, 2, spec.num_kv_heads, num_tokens, spec.head_dim)
    return torch.randn(shape, generator=generator).to(spec.torch_dtype())


STALLS = ("before_copy", "mid_copy")
RELEASE_WAIT_S = 120.0


class _Stall:
    """Marks the stall with a file, then waits for the release file (once)."""

    def __init__(self, marker_dir: str):
        self.marker_dir = marker_dir
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        with open(os.path.join(self.marker_dir, "stalled"), "w"):
            pass
        deadline_s = time.monotonic() + RELEASE_WAIT_S
        while (not os.path.exists(os.path.join(self.marker_dir, "release"))
               and time.monotonic() < deadline_s):
            time.sleep(0.02)


def _drive(steps, timeout_s: float, before_first_work: Callable[[], None] | None):
    """run_sync's loop, with a hook before the first Work step (the put's copy)."""
    reply = None
    try:
        while True:
            step = steps.send(reply)
            if isinstance(step, Wait):
                reply = [_result(ref, timeout_s) for ref in step.refs]
                continue
            if before_first_work is not None:
                before_first_work()
                before_first_work = None
            reply = step.fn()
    except StopIteration as done:
        return done.value


def _result(ref, timeout_s: float):
    try:
        return ray.get(ref, timeout=timeout_s)
    except (ray.exceptions.RayError, TimeoutError) as error:  # a miss, as run_sync has it
        return error
