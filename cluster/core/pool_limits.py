"""The byte budgets and knobs of one pool (cluster/core/pool.py).

Its own module so that what reads the limits without a pool (tiers/report.py) does not
import the pool, which imports the tiers: no cycle between cluster.core.tiers and the pool.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PoolLimits:
    """Per-tier byte budgets and the knobs of one pool."""

    device_bytes: int
    host_bytes: int
    disk_bytes: int
    eviction: str = "putdepth"
    disk_codec: str = "none"
    use_cuda: bool = False
    shm_prefix: str = "raykv"
    num_devices: int = 1  # GPUs the device tier spreads over (device_bytes is their total)
