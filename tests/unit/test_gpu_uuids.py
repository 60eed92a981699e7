"""GPUs named by UUID between processes (issue 15, finding 2): each process numbers the GPUs
it sees from 0 through its own CUDA_VISIBLE_DEVICES, so a descriptor's GPU is a UUID, which
each process maps to its own index, or to nothing (a miss)."""

from __future__ import annotations

import pytest

from cluster.core.tiers.gpus import format_uuid, local_index, visible_gpus

MACHINE = [(0, "GPU-aaaa0000-0000"), (1, "GPU-bbbb1111-1111"), (2, "GPU-cccc2222-2222"),
           (3, "GPU-cccc3333-3333")]
A, B, C, D = (uuid for _, uuid in MACHINE)


@pytest.mark.parametrize(("visible", "expected"), [
    (None, [A, B, C, D]),  # unset: every GPU, in index order
    ("", []),  # Ray's "no GPU for you"
    ("2", [C]),  # a vLLM worker pinned to one GPU: physical 2 is its cuda:0
    ("3,1", [D, B]),  # narrowed and reordered
    (" 1 , 0", [B, A]),
    ("GPU-bbbb", [B]),  # by a unique UUID prefix
    ("GPU-cccc3333-3333,0", [D, A]),  # UUIDs and indices mixed
    ("1,7,0", [B]),  # CUDA stops at the first entry that names no GPU
    ("GPU-cccc,1", []),  # an ambiguous prefix names none
    ("1,1,0", [B]),  # nor may a GPU be named twice
    ("-1,0", []),
])
def test_visible_gpus_follow_cuda_visible_devices(visible, expected):
    assert visible_gpus(visible, MACHINE) == expected


def test_a_chunk_is_mapped_on_the_process_own_index_of_its_gpu_or_not_at_all():
    node = visible_gpus("0,1,2,3", MACHINE)  # the node actor sees every GPU
    worker = visible_gpus("3,1", MACHINE)  # a replica that sees two, renumbered
    chunk_gpus = [node[c % 4] for c in range(4)]  # a descriptor names each chunk's GPU
    assert [local_index(uuid, worker) for uuid in chunk_gpus] == [None, 1, None, 0]
    assert [local_index(uuid, node) for uuid in chunk_gpus] == [0, 1, 2, 3]


def test_uuids_are_written_as_cuda_visible_devices_takes_them():
    raw = bytes(range(16))
    assert format_uuid(raw) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert visible_gpus(format_uuid(raw)[:12], [(0, format_uuid(raw))]) == [format_uuid(raw)]
