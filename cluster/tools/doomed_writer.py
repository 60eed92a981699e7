"""A client process that dies in the middle of a put (test-only): the fault "kill a client
mid-put". Its reservation must lapse after `reserve_lease_s`, and no half-written page may
ever be served."""

from __future__ import annotations

import os
import threading

import ray
import torch

from cluster import connect
from cluster.calls import run_sync
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
        tier, slot = next(s for s in slots if s is not None)
        target = client.view.slabs.page(tier, slot).reshape(-1).view(torch.uint8)
        source = kv[:, :, :, page_slices(0, client.page_tokens)].contiguous()
        half_bytes = target.numel() // 2
        target[:half_bytes].copy_(source.reshape(-1).view(torch.uint8)[:half_bytes])
        os._exit(1)

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
