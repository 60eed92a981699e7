"""One line that says which tiers are real on a node (the node actor logs it at start)."""

from __future__ import annotations

from cluster.core.pool_limits import PoolLimits
from cluster.core.tiers.memory import SHM_DIR

MiB = 1 << 20


def describe_tiers(limits: PoolLimits, disk_dir: str, gpu_ids: tuple[str, ...]) -> str:
    """e.g. 'device=VRAM on GPUs 0,1 (2 x 256 MiB, cupy) host=/dev/shm 1024 MiB disk=...'."""
    if limits.device_bytes == 0:
        device = "device=none"
    elif limits.use_cuda:
        per_gpu = limits.device_bytes // max(1, limits.num_devices) // MiB
        device = (f"device=VRAM on GPUs {','.join(gpu_ids) or '?'} "
                  f"({limits.num_devices} x {per_gpu} MiB, cupy)")
    else:
        why = "no GPU visible" if not gpu_ids else "GPUs seen but no CUDA in torch, or no cupy"
        device = f"device=CPU stand-in in {SHM_DIR} ({limits.device_bytes // MiB} MiB; {why})"
    host = f"host={SHM_DIR} {limits.host_bytes // MiB} MiB" if limits.host_bytes else "host=none"
    disk = f"disk={disk_dir} {limits.disk_bytes // MiB} MiB" if limits.disk_bytes else "disk=none"
    return f"tiers {device}, {host}, {disk}"
