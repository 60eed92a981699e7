"""CacheConfig: the service's settings, validated once at start()."""

from __future__ import annotations

import os
import tempfile
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MiB = 1 << 20
GiB = 1 << 30


def default_disk_dir() -> str:
    """A per-user directory on the real disk (O_DIRECT does not work on tmpfs); created 0700,
    and refused if another user owns it. RAYKV_DISK_DIR overrides it."""
    return (os.environ.get("RAYKV_DISK_DIR")
            or os.path.join(tempfile.gettempdir(), f"raykv-{os.getuid()}", "disk"))


class CacheConfig(BaseModel):
    """Settings for one raykv service on a Ray cluster. Capacities are per node, except
    `device_bytes`, which is per GPU.

    `device_bytes` is the VRAM each GPU of a node gives raykv's device tier (a node with 8
    GPUs holds 8 x device_bytes; a node without a GPU holds one CPU stand-in of
    device_bytes in shared memory). The node actor asks Ray for no GPU, so this VRAM, and
    its CUDA context (~512 MiB per GPU), are outside vLLM's accounting: at start the node
    refuses when a GPU has less free memory than device_bytes, and logs the largest
    `gpu_memory_utilization` the engines on its GPUs may then use (also in `raykv status`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    page_tokens: int = Field(256, gt=0, le=65536, description="tokens per page")
    device_bytes: int = Field(256 * MiB, ge=0, description="device (VRAM) tier per GPU; a "
                              "CPU stand-in of this size on a node without GPUs")
    host_bytes: int = Field(1 * GiB, ge=0, description="host DRAM (shared memory) per node")
    disk_bytes: int = Field(4 * GiB, ge=0, description="NVMe slab bytes per node")
    disk_dir: str = Field(default_factory=default_disk_dir)
    eviction: Literal["lru", "s3fifo", "recfreq", "putdepth"] = "putdepth"
    disk_codec: Literal["none", "fp8", "int8"] = "none"
    namespaces: tuple[str, ...] = ("default",)
    num_directory_shards: int = Field(1, ge=1, le=64)
    redis_url: str | None = Field(default_factory=lambda: os.environ.get("RAYKV_REDIS_URL")
                                  or None, description="write-behind of the directory "
                                  "(default: RAYKV_REDIS_URL)")
    redis_key_space: str = Field(
        default_factory=lambda: os.environ.get("RAY_external_storage_namespace", ""),
        description="the directory's keys in Redis are raykv:<ray_namespace>[:<this>]:dir<N>. "
        "Default: RAY_external_storage_namespace, which KubeRay sets on a head with GCS fault "
        "tolerance, one per RayCluster: two clusters on one Redis (a RayService's old and new "
        "cluster during an upgrade) keep apart, and a head restarted in the same cluster "
        "finds its own")
    node_resource: str = "kv_node"
    pin_lease_s: float = Field(30.0, gt=0, description="a read lease's life (pins of a get)")
    reserve_lease_s: float = Field(30.0, gt=0, description="a put's reservation life: a client "
                                   "that dies between reserve and commit loses its slots after it")
    put_lease_bytes: int = Field(256 * MiB, ge=0, description="free slots a client leases "
                                 "ahead of its puts (twice its largest put, a put more each time"
                                 " puts ran it dry, at most a quarter of the top tier), so that"
                                 " a put makes no call: it copies in "
                                 "and commits in the background, and other clients see it once "
                                 "the commit lands (0: every put reserves and commits through "
                                 "the node). A lease takes only free room: the node takes "
                                 "unused leased slots back before it demotes any page")
    call_timeout_s: float = Field(10.0, gt=0, description="every Ray call a client makes; a "
                                  "call past it is a miss")
    max_geometries: int = Field(16, ge=1, le=256, description="page geometries (models) a "
                                "node accepts; they share the tier budgets")
    chunk_bytes: int = Field(64 * MiB, ge=4096, description="the unit in which the tiers' "
                             "budgets are handed to models (smaller in a small tier)")
    idle_shrink_s: float = Field(60.0, gt=0, description="a model unused this long gives its "
                                 "memory back, down to its quota's min")
    max_pinned_fraction: float = Field(0.5, gt=0, le=1, description="the share of each "
                                       "node's memory (device + host) that operators' pins "
                                       "(raykv pin) may hold; a pin past it is refused whole")
    demote_ahead: bool = Field(True, description="between requests, demote the host tier's "
                               "coldest pages to disk so that the largest recent batch that "
                               "found it full (a read-up from disk, a put) lands in free slots, "
                               "not behind demotion writes; learned from the batches, at most a "
                               "quarter of the tier (cluster/core/demote_ahead.py)")
    event_flush_s: float = Field(0.05, gt=0)
    heartbeat_s: float = Field(1.0, gt=0)
    node_timeout_s: float = Field(4.0, gt=0)
    disk_threads: int = Field(4, ge=1, le=64)
    disk_durability: Literal["durable", "volatile"] = Field(
        "durable", description="durable: each batch of pages written to disk is fdatasynced "
        "before the node reports them on disk, so a power cut loses no page reported there; "
        "volatile: no fdatasync (faster writes), a power cut may lose pages written shortly "
        "before it (a process crash loses none either way; never wrong bytes)")
    transport: Literal["tcp", "nixl"] = Field(
        "tcp", description="how pages move between nodes: tcp, or nixl (RDMA / shared memory "
        "through UCX where NIXL is installed, else TCP; cluster/core/dataplane/transport.py)")
    page_port: int = Field(7460, ge=0, le=65535 - 15, description="the data plane's port: "
                           "a node actor takes the first free one of [page_port, page_port "
                           "+ 16) on its node's address (several simulated nodes share a "
                           "host); 0: any free port")
    ray_namespace: str = "raykv"
    rebalance: bool = Field(True, description="run the control loop: hot prefixes replicated, "
                            "cold pages moved off hot nodes, kv nodes requested")
    rebalance_period_s: float = Field(0.5, gt=0, description="the control loop's period")
    min_kv_nodes: int = Field(1, ge=1, description="scale-in floor of the kv nodes requested")
    max_kv_nodes: int = Field(0, ge=0, description="scale-out ceiling of the kv nodes "
                              "requested from the autoscaler (0: never request)")

    @field_validator("namespaces")
    @classmethod
    def _namespaces_valid(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value or any(not isinstance(n, str) or not n for n in value):
            raise ValueError("namespaces must be a non-empty tuple of non-empty strings")
        return value
