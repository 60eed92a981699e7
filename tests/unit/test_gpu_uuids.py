"""GPUs named by UUID between processes (issue 15, finding 2): each process numbers the GPUs
it sees from 0 through its own CUDA_VISIBLE_DEVICES, so a descriptor's GPU is a UUID, which
each process maps to its own index, or to nothing (a miss)."""

from __future__ import annotations

import pytest

from cluster.core.tiers.gpus import format_uuid, local_gpu_uuids, local_index, visible_gpus

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


def test_a_uuid_cut_short_names_no_gpu():
    """cupy's getDeviceProperties gives the UUID as a C string: Cython stops at the first
    zero byte, so about one GPU in 16 came back short, and format_uuid's assert was raised
    through the node actor's start and a client's mapping. A short UUID is a ValueError."""
    with pytest.raises(ValueError, match="16 bytes, got 2"):
        format_uuid(b"\x8f\x1c")


def test_uuids_are_asked_of_torch_first(monkeypatch):
    """torch formats the UUID from all 16 bytes; cupy is asked only where torch has no CUDA
    (and there, a short UUID raises rather than naming a GPU wrong)."""
    import sys
    import types

    import torch

    whole = "GPU-8f1c0000-0000-4000-8000-000000000001"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(uuid=whole[4:]))
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1,
                                    getDeviceProperties=lambda i: {"uuid": b"\x8f\x1c"})
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    assert local_gpu_uuids() == [whole]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError):
        local_gpu_uuids()


def test_a_gpu_this_process_cannot_name_is_a_miss_not_an_error(monkeypatch):
    """A client whose GPUs' UUIDs cannot be read maps none of the device chunks: its gets
    of them miss."""
    import cluster.core.tiers.device_chunks as device_chunks
    from cluster.core.tiers.device_chunks import ChunkHandle, DeviceLayout, DeviceMaps

    def short():
        raise ValueError("a GPU UUID is 16 bytes, got 2")

    monkeypatch.setattr(device_chunks, "local_gpu_uuids", short)
    handle = ChunkHandle(0, 1, 0, 8192, "GPU-aaaa", ipc_handle=b"\0" * 64)
    maps = DeviceMaps(DeviceLayout(1, 8192, (handle,)))
    assert maps.mapped_chunks == {} and maps.view(0, 4096) is None
