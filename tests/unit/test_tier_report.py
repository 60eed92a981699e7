"""The node's startup line says which tiers are real: VRAM on which GPUs, or a CPU stand-in
and why; host shared memory; disk."""

from __future__ import annotations

from cluster.core.pool import PoolLimits
from cluster.core.tiers.report import describe_tiers

MiB = 1 << 20


def test_a_gpu_node_names_its_vram_pools():
    limits = PoolLimits(2 * 256 * MiB, 1024 * MiB, 0, use_cuda=True, num_devices=2)
    line = describe_tiers(limits, "/d", ("0", "1"))
    assert line == ("tiers device=VRAM on GPUs 0,1 (2 x 256 MiB, cupy), "
                    "host=/dev/shm 1024 MiB, disk=none")


def test_a_cpu_node_says_the_device_tier_is_a_stand_in_and_why():
    limits = PoolLimits(64 * MiB, 128 * MiB, 4096 * MiB)
    assert "CPU stand-in" in describe_tiers(limits, "/d", ()) and "no GPU visible" in \
        describe_tiers(limits, "/d", ())
    assert "GPUs seen but no CUDA" in describe_tiers(limits, "/d", ("0",))
    assert describe_tiers(limits, "/d", ()).endswith("disk=/d 4096 MiB")
    assert describe_tiers(PoolLimits(0, 0, 0), "/d", ()) == \
        "tiers device=none, host=none, disk=none"
