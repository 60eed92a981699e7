"""GPUs named by UUID between processes, and the VRAM budget the engines must leave to raykv.

Every process numbers the GPUs it sees from 0, through its own CUDA_VISIBLE_DEVICES: the node
actor may see GPUs 0-7 while a vLLM worker sees only physical GPU 5, as its cuda:0. So
descriptors name a GPU by its UUID, and each process maps a UUID to its own index, or to
nothing (a GPU it cannot see: the chunks there are misses for it).

    machine:  (0, GPU-aa) (1, GPU-bb) (2, GPU-cc)
    CUDA_VISIBLE_DEVICES=2,0   ->  cuda:0 = GPU-cc, cuda:1 = GPU-aa, GPU-bb unseen

The node actor's VRAM is outside the engines' accounting (it asks Ray for no GPU), so it is
budgeted here: per GPU, `device_bytes` of chunks plus one CUDA context. An engine started after
raykv on that GPU may use at most `max_gpu_memory_utilization` of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MiB = 1 << 20
# What one CUDA context with torch and cupy loaded costs on a GPU (measured 300-600 MiB on
# recent GPUs and drivers); vLLM's gpu_memory_utilization cannot see it.
CUDA_CONTEXT_BYTES = 512 * MiB
VISIBLE = "CUDA_VISIBLE_DEVICES"


def visible_gpus(visible_env: str | None, machine: list[tuple[int, str]]) -> list[str]:
    """The UUIDs of the GPUs a process sees, in its own index order (its cuda:0 first).

    `visible_env` is its CUDA_VISIBLE_DEVICES (None: unset, every GPU in index order);
    `machine` is (physical index, UUID) per GPU. Entries are indices or (unique prefixes of)
    UUIDs; as CUDA does, parsing stops at the first entry that names no GPU, or one already
    named.
    """
    if visible_env is None:
        return [uuid for _, uuid in sorted(machine)]
    by_index = dict(machine)
    seen: list[str] = []
    for entry in visible_env.split(","):
        uuid = _resolve(entry.strip(), by_index)
        if uuid is None or uuid in seen:
            break
        seen.append(uuid)
    return seen


def _resolve(entry: str, by_index: dict[int, str]) -> str | None:
    if entry.isdigit():
        return by_index.get(int(entry))
    if entry.startswith("GPU-"):
        matches = [uuid for uuid in by_index.values() if uuid.startswith(entry)]
        return matches[0] if len(matches) == 1 else None
    return None


def local_index(uuid: str, visible: list[str]) -> int | None:
    """This process's index of the GPU named `uuid`; None when it cannot see it."""
    return visible.index(uuid) if uuid in visible else None


def format_uuid(raw: bytes) -> str:
    """16 UUID bytes as nvidia-smi and CUDA_VISIBLE_DEVICES write them: GPU-8-4-4-4-12.

    Raises ValueError for any other length: cupy's getDeviceProperties hands the UUID over
    as a C string (Cython stops at the first zero byte), so about one GPU in 16 comes back
    short from it, and a short UUID must never name a GPU."""
    text = bytes(raw).hex()
    if len(text) != 32:
        raise ValueError(f"a GPU UUID is 16 bytes, got {len(bytes(raw))}")
    return f"GPU-{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def local_gpu_uuids() -> list[str]:
    """The UUIDs of the GPUs this process sees, in its index order ([] without CUDA): the
    process's own view, whatever its CUDA_VISIBLE_DEVICES says.

    Asks torch first: its UUID is formatted from all 16 bytes. cupy's (the fallback, for a
    torch without CUDA) is cut at a zero byte, and such a GPU raises ValueError from
    format_uuid rather than being named wrong."""
    import torch

    if torch.cuda.is_available():
        return [_torch_uuid(i) for i in range(torch.cuda.device_count())]
    try:
        import cupy

        runtime = cupy.cuda.runtime
        raw = [runtime.getDeviceProperties(i)["uuid"] for i in range(runtime.getDeviceCount())]
    except (ImportError, KeyError):  # no cupy, or one too old to report UUIDs
        return []
    except RuntimeError:  # no driver, or no device visible
        return []
    return [format_uuid(one) for one in raw]


def _torch_uuid(index: int) -> str:
    import torch

    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith("GPU-") else "GPU-" + uuid


# ---- the VRAM budget ----------------------------------------------------------------------


class VramBudgetError(ValueError):
    """A GPU lacks the free memory raykv's device tier was configured to take."""


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """One GPU's memory as this process sees it (free: after this process's own context)."""

    uuid: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True, slots=True)
class VramShare:
    """What raykv takes of one GPU, and what that leaves the engines."""

    uuid: str
    device_bytes: int
    context_bytes: int
    total_bytes: int

    @property
    def max_gpu_memory_utilization(self) -> float:
        """The largest vLLM gpu_memory_utilization an engine started after raykv may use on
        this GPU (floored to 2 decimals; vLLM refuses to start when its share of the
        total exceeds the free memory it finds)."""
        left = self.total_bytes - self.device_bytes - self.context_bytes
        return max(0.0, math.floor(100 * left / self.total_bytes) / 100)


def vram_budget(device_bytes: int, gpus: list[GpuMemory],
                context_bytes: int = CUDA_CONTEXT_BYTES) -> list[VramShare]:
    """raykv's share of each GPU: `device_bytes` (per GPU) of chunks and one CUDA context.

    Raises VramBudgetError, naming each GPU, its free memory and the fixes, when
    `device_bytes` exceeds a GPU's free memory (engines already hold it).
    """
    short = [gpu for gpu in gpus if device_bytes > gpu.free_bytes]
    if short:
        utilization = min(_share(device_bytes, g, context_bytes).max_gpu_memory_utilization
                          for g in short)
        raise VramBudgetError(
            "raykv's device tier needs device_bytes="
            f"{device_bytes / MiB:.0f} MiB on every GPU, but "
            + ", ".join(f"{g.uuid} has {g.free_bytes / MiB:.0f} MiB free of "
                        f"{g.total_bytes / MiB:.0f} MiB" for g in short)
            + ". Lower CacheConfig.device_bytes (raykv start --device-bytes) to at most "
            f"{min(g.free_bytes for g in short) / MiB:.0f} MiB, or start raykv before the "
            "engines and give them a gpu_memory_utilization of at most "
            f"{utilization}.")
    return [_share(device_bytes, gpu, context_bytes) for gpu in gpus]


def _share(device_bytes: int, gpu: GpuMemory, context_bytes: int) -> VramShare:
    return VramShare(gpu.uuid, device_bytes, context_bytes, gpu.total_bytes)


def describe_budget(shares: list[VramShare]) -> str:
    """One line: what raykv takes per GPU and the engines' largest gpu_memory_utilization."""
    if not shares:
        return "no GPU"
    worst = min(share.max_gpu_memory_utilization for share in shares)
    first = shares[0]
    return (f"{len(shares)} GPU(s), each {first.device_bytes / MiB:.0f} MiB of chunks + "
            f"~{first.context_bytes / MiB:.0f} MiB CUDA context: engines on these GPUs must "
            f"use gpu_memory_utilization <= {worst}")


def measure_gpus() -> list[GpuMemory]:
    """Each visible GPU's memory, through torch (creates this process's context on each)."""
    import torch

    uuids = local_gpu_uuids()
    gpus = []
    for index, uuid in enumerate(uuids):
        free_bytes, total_bytes = torch.cuda.mem_get_info(index)
        gpus.append(GpuMemory(uuid, int(total_bytes), int(free_bytes)))
    return gpus
