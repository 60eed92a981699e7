"""Which GPUs the node actor sees.

The node actor asks Ray for no GPU, so that every GPU stays schedulable for the engines. Ray
versions that hide all GPUs from such an actor (CUDA_VISIBLE_DEVICES="") would then leave the
device tier a CPU stand-in on a GPU node; this gives the actor back the GPUs its raylet was
started with, before anything initializes CUDA. Its VRAM pools are small next to the engines'.
"""

from __future__ import annotations

import logging
import os

import ray

log = logging.getLogger("raykv.node")
VISIBLE = "CUDA_VISIBLE_DEVICES"


def expose_node_gpus() -> tuple[str, ...]:
    """The GPU ids this process may use (CUDA_VISIBLE_DEVICES set back if Ray emptied it)."""
    visible = os.environ.get(VISIBLE)
    if visible is None:
        return tuple(str(i) for i in range(_node_gpu_count()))
    if visible:
        return tuple(visible.split(","))
    ids = _raylet_gpu_ids()
    if ids:
        os.environ[VISIBLE] = ",".join(ids)
        log.info("node actor sees the node's GPUs %s (Ray had hidden them)", ids)
    return tuple(ids)


def _raylet_gpu_ids() -> list[str]:
    """The GPU ids this worker's raylet had, else 0..GPUs-1 of this Ray node."""
    from ray._private.worker import global_worker

    original = getattr(global_worker, "original_visible_accelerator_ids", None) or {}
    ids = original.get("GPU") or range(_node_gpu_count())
    return [str(i) for i in ids]


def _node_gpu_count() -> int:
    """GPUs the Ray node offers (0 on CPU nodes)."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return int(node["Resources"].get("GPU", 0))
    return 0
