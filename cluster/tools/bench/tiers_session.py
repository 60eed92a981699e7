"""`raykv bench tiers`' sizes and service: a page size's plan (SizePlan), the service
configured for it, and a Session on it (a client, one batch's kv and out tensors, and what the
run found). tiers.py runs the benchmark; tiers_host.py and tiers_phases.py measure a Session."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from cluster.core.config import CacheConfig
from cluster.tools.bench import common, harness

MiB = common.MiB
BATCH_BYTES = 64 * MiB
QUICK_BATCH_BYTES = 32 * MiB
ROUNDS = 5  # host rounds
# Each disk round runs fio three times for FIO_RUNTIME_S. Five rounds, not three: this VM's
# disk drifts within minutes. In four probes fio's rounds ran at 4.1 to 9.4 GB/s and the disk
# tier's, timed beside them, at 5.4 to 6.6; a ratio is the median of its rounds' ratios.
DISK_ROUNDS = 5
GET_REPS = 9  # per contender and round (after one untimed)
PUT_REPS = 3  # per round, and as many taken apart: each needs fresh slots in the host tier
E2E_REPS = 2  # e2e puts and e2e gets per disk round
TOKEN_STRIDE = 1 << 24  # batch b's tokens start at b * TOKEN_STRIDE
DISK_HEADER_BYTES = 4096
SPEC = common.LLAMA_8B_KV  # pages of 8, 32 and 128 tokens


@dataclass(frozen=True, slots=True)
class SizePlan:
    page_bytes: int
    page_tokens: int
    num_pages: int  # pages in one batch (one put or get call)
    rounds: int  # host rounds
    disk_rounds: int
    disk_dir: str

    @property
    def batch_tokens(self) -> int:
        return self.num_pages * self.page_tokens

    @property
    def batch_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def num_e2e_gets(self) -> int:
        return self.disk_rounds * E2E_REPS


def plan_for(page_mib: int, quick: bool, disk_dir: str) -> SizePlan:
    page_bytes = page_mib * MiB
    page_tokens = page_bytes // SPEC.bytes_per_token
    assert SPEC.page_bytes(page_tokens) == page_bytes, f"{page_mib} MiB is not whole tokens"
    batch_bytes = QUICK_BATCH_BYTES if quick else BATCH_BYTES
    return SizePlan(page_bytes, page_tokens, max(1, batch_bytes // page_bytes),
                    harness.MIN_ROUNDS if quick else ROUNDS,
                    harness.MIN_ROUNDS if quick else DISK_ROUNDS, disk_dir)


def host_batches(plan: SizePlan) -> int:
    """Batch 0, a warm-up put, the timed puts, the puts taken apart (reserved and leased),
    one spare, and the free slots the client's lease may hold ahead of its puts: up to
    PUT_LEASE_BYTES (twice its largest put, more after bursts that ran it dry:
    cluster/core/lease_pool.py)."""
    return 3 + (plan.rounds + 2) * PUT_REPS + lease_batches(plan)


def lease_batches(plan: SizePlan) -> int:
    return -(-PUT_LEASE_BYTES // plan.batch_bytes)


# Leased puts (CacheConfig.put_lease_bytes, on by default at this size), stated here so the
# bench does not move with the default; host_batches() leaves the lease its room.
PUT_LEASE_BYTES = 256 * MiB


def _service_config(plan: SizePlan) -> CacheConfig:
    """device_bytes=0: the host tier is the top tier, of host_batches(plan). The disk tier holds
    what fill_host pushes down (num_e2e_gets + 1 batches, and a spare) and every e2e put's
    demotion (an e2e get moves as much up as down). Demotion ahead of need is off: each e2e put
    must pay its own demotion write and each e2e get its read beside the demotion it causes, the
    disk paths this benchmark sets against fio (ttft measures what the headroom saves)."""
    disk_pages = (2 * plan.num_e2e_gets + 3) * plan.num_pages
    return CacheConfig(page_tokens=plan.page_tokens, device_bytes=0,
                       host_bytes=host_batches(plan) * plan.batch_bytes,  # 4096-aligned pages
                       disk_bytes=disk_pages * (DISK_HEADER_BYTES + plan.page_bytes),
                       eviction="lru", disk_codec="none", put_lease_bytes=PUT_LEASE_BYTES,
                       demote_ahead=False,
                       disk_dir=os.path.join(plan.disk_dir, f"service-{plan.page_bytes // MiB}"))


def _tokens(plan: SizePlan, batch: int) -> np.ndarray:
    return np.arange(plan.batch_tokens, dtype=np.int64) + batch * TOKEN_STRIDE


def _gbps(plan: SizePlan, seconds: float) -> float:
    return plan.batch_bytes / seconds / 1e9


@dataclass(slots=True)
class Session:
    """The service for one page size, a client of it, one batch's kv and out tensors, and what
    the run found: figures whose path was not taken, figures taken alongside others."""

    plan: SizePlan
    client: object
    kv: object  # torch.Tensor [L, 2, H, batch_tokens, D]; page i holds page_pool's page i
    out: object  # a touched tensor of the same shape
    num_batches: int = 0  # batches put so far: batch b has tokens _tokens(plan, b)
    unmet: dict[str, str] = field(default_factory=dict)  # figure -> why its path was not taken
    side: dict[str, list[float]] = field(default_factory=dict)  # redis_set, ray_put per round

    def fresh_tokens(self) -> np.ndarray:
        self.num_batches += 1
        return _tokens(self.plan, self.num_batches - 1)

    def put_batch(self) -> None:
        """Put the next fresh batch; raise unless all its pages were stored."""
        stored = self.client.put(self.fresh_tokens(), self.kv)
        if stored != self.plan.batch_tokens:
            raise RuntimeError(f"put stored {stored} of {self.plan.batch_tokens} tokens")

    def host_room_batches(self) -> int:
        """Batches the host tier holds beyond those put so far (its size, host_batches(plan),
        counts every batch the run puts and the lease's room; --quick's smaller batches make
        that room more batches)."""
        return max(0, host_batches(self.plan) - self.num_batches)

    def put_settled(self) -> None:
        """put_batch, then wait for its background commit (and lease top-up) to answer."""
        self.put_batch()
        self.settle()

    def settle(self) -> None:
        """Wait for the client's leased puts' commits to be answered; raise if they are not."""
        if not self.client.puts.settle(self.client.timeout_s):
            raise RuntimeError("a put's commit was not answered in time")

    def get_batch(self, batch: int) -> None:
        num_tokens, _ = self.client.get(_tokens(self.plan, batch), out=self.out)
        if num_tokens != self.plan.batch_tokens:
            raise RuntimeError(f"get returned {num_tokens} of {self.plan.batch_tokens} tokens")

    def check_batch(self, batch: int) -> float:
        """Get a batch into a zeroed out, compare every byte with what was put; the get's s."""
        self.out.zero_()
        seconds, _ = common.timed(lambda: self.get_batch(batch))
        common.check_same(self.out, self.kv, f"batch {batch}")
        return seconds

    def forget(self, batch: int) -> None:
        """Drop the client's notes of where batch's pages are: its next get asks the node."""
        self.client.view.slabs.forget(self.client.keys(_tokens(self.plan, batch)))

    def expect(self, figure: str, taken: bool, why: str) -> None:
        if not taken:
            self.unmet.setdefault(figure, why)

    def node_stat(self, name: str) -> int:
        return self.client.stats()["node"][name]

    def disk_bytes_read(self) -> int:
        """Bytes read from this node's disk tier so far: the node's, and this client's own
        reads of its slab files (cluster/disk_direct.py)."""
        direct_pages = self.client.counters["disk_direct_pages"]
        return self.node_stat("disk_bytes_read") + direct_pages * self.client.geometry.page_bytes


def start_session(plan: SizePlan) -> Session:
    client = common.start_service(_service_config(plan), SPEC)
    if client.local is None:
        raise RuntimeError("the client does not map this node's slabs: no host tier path")
    kv = common.page_kv(SPEC, plan.page_tokens, plan.num_pages)
    return Session(plan, client, kv, common.touched_like(kv))
