"""`make gpu-check`: the device tier, CUDA IPC and the connector's layouts on a real GPU.

A GPU test machine may hold only torch (CUDA), cupy, numpy and pyarrow: no Ray, vLLM, Redis
or pydantic, and no way to install them. So this imports torch, numpy, cupy and the pure core
only (tests/unit/test_gpu_check.py runs it with `import ray` blocked). One line per check:

    PASS|FAIL|SKIP <check>: <detail>
    {"checks": {...}, "ratios": {...}, "figures": {...}, "failed": N}     the last line

It exits non-zero on any FAIL; without CUDA every check is a SKIP and it exits 0.

    chunks_ipc        VRAM chunks mapped by a second process through CUDA IPC, under a
                      CUDA_VISIBLE_DEVICES narrowed to one GPU named by UUID; a process that
                      sees no GPU maps nothing (its pages are misses)
    regrant_remap     grant, release and grant again: the second process remaps the new
                      allocation, and its old mapping is never written; the old allocation,
                      still viewed there, stays retired, and is freed once the view is gone
    stream_copies     host<->VRAM page moves in the copy thread on a CUDA stream, off the loop
    vram_budget       the node's start-up check on these GPUs: the engines' largest
                      gpu_memory_utilization next to raykv's default device_bytes
    device_get        a get from mapped VRAM chunks into a KV tensor, against one cudaMemcpy
                      of the same bytes (torch copy), as a ratio
    connector/<name>  cluster.core.kv_layout_check.selfcheck("cuda"): gather/scatter per layout
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

from cluster.core.tiers.chunks import Share, TierBudget
from cluster.core.tiers.device_copy import TierCopies
from cluster.core.tiers.gpus import (
    VISIBLE,
    describe_budget,
    local_gpu_uuids,
    measure_gpus,
    visible_gpus,
    vram_budget,
)
from cluster.core.tiers.memory import ArenaDescriptor, ArenaMapping, ArenaOptions, MappedArena

SLOT_BYTES = 4 << 20
SLOTS_PER_CHUNK = 4
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIN_GET_VS_MEMCPY = 0.25  # a get moves pages one strided copy each: allow 4x a flat memcpy


@dataclass
class Report:
    """The lines printed so far and the summary they add up to."""

    checks: dict[str, str] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    figures: dict[str, object] = field(default_factory=dict)

    def line(self, verdict: str, name: str, detail: str) -> None:
        self.checks[name] = verdict
        print(f"{verdict} {name}: {detail}", flush=True)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.line("PASS" if ok else "FAIL", name, detail)

    def summary(self) -> dict:
        failed = sum(verdict == "FAIL" for verdict in self.checks.values())
        return {"checks": self.checks, "ratios": self.ratios, "figures": self.figures,
                "failed": failed}


# ---- a second process: maps the arena's descriptor and does what it is told ----------------


class Peer:
    """A child process (`--child`) with its own CUDA_VISIBLE_DEVICES, driven over pipes."""

    def __init__(self, visible: str | None):
        path = REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
        env = dict(os.environ, PYTHONPATH=path)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        self.process = subprocess.Popen([sys.executable, "-m", "cluster.tools.gpu_check",
                                         "--child"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env, cwd=REPO_ROOT)

    def ask(self, *command) -> object:
        _send(self.process.stdin, command)
        reply = _receive(self.process.stdout)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def close(self) -> None:
        _send(self.process.stdin, ("exit",))
        self.process.wait(timeout=60)


def _send(stream, message: object) -> None:
    data = pickle.dumps(message)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream) -> object:
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError("the peer process ended")
    return pickle.loads(stream.read(struct.unpack("<Q", header)[0]))


class _Child:
    """The peer's side: one mapping of one arena, updated as descriptors arrive."""

    def __init__(self):
        self.mapping: ArenaMapping | None = None
        self.kept: torch.Tensor | None = None  # a view through an older mapping

    def uuids(self) -> list[str]:
        return local_gpu_uuids()

    def map(self, descriptor: ArenaDescriptor) -> dict[int, int]:
        if self.mapping is None:
            self.mapping = ArenaMapping(descriptor)
        else:
            self.mapping.update(descriptor)
        return self.mapping.device.mapped_chunks

    def read(self, slot: int) -> list[int] | None:
        """The slot's first and last bytes (None: not mapped here)."""
        view = self.mapping.view(slot)
        return None if view is None else [int(view[0]), int(view[-1])]

    def write(self, slot: int, value: int) -> bool:
        view = self.mapping.view(slot)
        if view is None:
            return False
        view.fill_(value)
        if view.is_cuda:
            torch.cuda.synchronize(view.device)
        return True

    def keep(self, slot: int) -> bool:
        """Hold a view of the slot through the current mapping (to look at it after a remap)."""
        self.kept = self.mapping.view(slot)
        return self.kept is not None

    def kept_byte(self) -> int:
        return int(self.kept[0])

    def let_go(self) -> bool:
        """Drop the kept view: this process's poller then closes the old mapping, no call."""
        self.kept = None
        return True

    def get(self, slots: list[int], rounds: int) -> dict:
        return time_device_get(self.mapping, slots, rounds)


def child_main() -> None:
    """Serve commands from the parent until told to exit (stdout carries only replies)."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the reply stream
    child = _Child()
    while True:
        name, *args = _receive(stdin)
        if name == "exit":
            return
        try:
            reply = getattr(child, name)(*args)
        except Exception as error:  # noqa: BLE001 - sent back, raised in the parent
            reply = RuntimeError(f"{name}: {type(error).__name__}: {error}")
        _send(stdout, reply)


# ---- the checks -----------------------------------------------------------------------------


def device_arena(device: str, num_chunks: int = 3, num_gpus: int = 1,
                 budget_chunks: int | None = None) -> MappedArena:
    """A device arena of `num_chunks` chunks (the last one short) over `num_gpus` GPUs,
    budget for all of them (or `budget_chunks`)."""
    chunk_bytes = SLOTS_PER_CHUNK * SLOT_BYTES
    num_slots = (num_chunks - 1) * SLOTS_PER_CHUNK + 1
    share = Share(TierBudget((budget_chunks or num_chunks) * chunk_bytes), "gpu-check",
                  chunk_bytes)
    options = ArenaOptions(use_cuda=device == "cuda", shm_prefix="raykvgpucheck", share=share,
                           num_devices=num_gpus)
    return MappedArena("device", num_slots * SLOT_BYTES, SLOT_BYTES, options)


def peer_visibility(device: str, gpu: int = 0) -> tuple[str | None, list[str]]:
    """The narrowed CUDA_VISIBLE_DEVICES for the peer (this process's GPU `gpu` (-1: the
    last), named by a UUID prefix) and the UUIDs the peer should then see, by visible_gpus
    over this process's GPUs."""
    if device != "cuda":
        return None, []
    mine = local_gpu_uuids()
    inherited = os.environ.get(VISIBLE, "")
    if "MIG-" in inherited:  # a MIG instance has no GPU- name to narrow to: the peer is given
        return inherited, mine  # this process's own view
    narrowed = mine[gpu][:12]  # a unique UUID prefix, as CUDA_VISIBLE_DEVICES allows
    return narrowed, visible_gpus(narrowed, list(enumerate(mine)))


def check_chunks_ipc(report: Report, device: str) -> None:
    """The chunks spread over every GPU; the peer sees only the last one (renumbered as its
    cuda:0), maps the chunks there and sees the node's bytes, and the node sees the peer's;
    the chunks on the other GPUs are misses for it."""
    num_gpus = len(local_gpu_uuids()) if device == "cuda" else 1
    arena = device_arena(device, num_chunks=max(3, num_gpus), num_gpus=num_gpus)
    narrowed, expected = peer_visibility(device, -1)
    peer = Peer(narrowed)
    try:
        slots = [arena.alloc() for _ in range(arena.num_slots)]
        for slot in slots:
            arena.view(slot).fill_(slot + 1)
        _sync_all(arena, slots)  # the fills are queued on a stream: done before the peer reads
        layout = arena.descriptor().device_layout
        short = layout.chunks[-1]
        sizes_ok = (short.nbytes == SLOT_BYTES
                    and short.offset_bytes == (len(layout.chunks) - 1) * arena.chunk_bytes)
        seen_chunks = {c.chunk for c in layout.chunks if device == "cpu" or c.gpu_uuid in expected}
        mapped = peer.ask("map", arena.descriptor())
        reads = [peer.ask("read", slot) for slot in slots]
        mine = [slot for slot in slots if slot // SLOTS_PER_CHUNK in seen_chunks]
        wrote = peer.ask("write", mine[-1], 0x5A)
        _sync(arena.view(mine[-1]))
        seen = int(arena.view(mine[-1])[0]) == 0x5A and wrote
        uuids = peer.ask("uuids")
        expected_reads = [[slot + 1, slot + 1] if slot in mine else None for slot in slots]
        ok = (sizes_ok and set(mapped) == seen_chunks and seen and reads == expected_reads
              and uuids == expected)
        report.check(f"chunks_ipc[{device}]", ok,
                     f"{len(mapped)} of {len(layout.chunks)} chunks mapped by a peer with "
                     "CUDA_VISIBLE_DEVICES="
                     f"{narrowed}, sees {uuids} (expected {expected}); short last chunk "
                     f"{short.nbytes} bytes at {short.offset_bytes}; peer's write seen: {seen}")
        if device == "cuda":
            check_blind_peer(report, arena, slots)
    finally:
        peer.close()
        arena.close()


def check_blind_peer(report: Report, arena: MappedArena, slots: list[int]) -> None:
    """A process that sees no GPU maps none of the chunks: its reads are misses, not errors."""
    peer = Peer("")
    try:
        mapped = peer.ask("map", arena.descriptor())
        reads = [peer.ask("read", slot) for slot in slots]
        report.check("chunks_unseen_gpu_miss", mapped == {} and reads == [None] * len(slots),
                     f"mapped {mapped}, reads {set(map(str, reads))}")
    finally:
        peer.close()


def check_regrant_remap(report: Report, device: str) -> None:
    """Grant, release, grant again: the peer remaps and never writes the old allocation,
    which stays retired (allocated) while the peer views it and is freed once it lets go."""
    arena = device_arena(device, num_chunks=1, budget_chunks=2)  # the old one stays a while
    peer = Peer(peer_visibility(device)[0])
    try:
        slot = arena.alloc()
        arena.view(slot).fill_(1)
        _sync(arena.view(slot))
        before = peer.ask("map", arena.descriptor())
        peer.ask("keep", slot)  # a view through the old mapping, past the release
        version = arena.layout_version
        arena.free(slot)
        arena.slots.release_empty()
        retired = arena.retired_bytes  # the peer still maps it: not freed
        again = arena.alloc()
        arena.view(again).fill_(2)
        _sync(arena.view(again))
        after = peer.ask("map", arena.descriptor())
        read = peer.ask("read", again)
        peer.ask("write", again, 3)
        _sync(arena.view(again))
        landed = int(arena.view(again)[0])
        stale = peer.ask("kept_byte")  # the old allocation's byte: still there to read
        peer.ask("let_go")
        freed_s = _wait_reaped(arena)
        ok = (again == slot and arena.layout_version > version and before != after
              and read == [2, 2] and landed == 3 and stale == 1 and retired > 0
              and freed_s is not None)
        report.check(f"regrant_remap[{device}]", ok,
                     f"grants {before} -> {after}, version {version} -> "
                     f"{arena.layout_version}; peer read {read}, its write landed: {landed}, "
                     f"old allocation untouched: {stale == 1}, retired while viewed: "
                     f"{retired} bytes, freed {freed_s} s after the view went")
    finally:
        peer.close()
        arena.close()


def _wait_reaped(arena: MappedArena, timeout_s: float = 10.0) -> float | None:
    """Seconds until the arena's retired chunks are freed (the peer's poller caught up, with
    no call); None if they were not within timeout_s."""
    started_s = time.monotonic()
    while time.monotonic() - started_s < timeout_s:
        arena.reap_retired()
        if arena.retired_bytes == 0:
            return round(time.monotonic() - started_s, 2)
        time.sleep(0.05)
    return None


def check_stream_copies(report: Report) -> None:
    """Host<->VRAM moves on the copy thread's stream, while the event loop keeps running."""
    arena = device_arena("cuda", num_chunks=2)
    copies = TierCopies()
    try:
        slots = [arena.alloc() for _ in range(arena.num_slots)]
        host = [torch.full((SLOT_BYTES,), i + 1, dtype=torch.uint8) for i in range(len(slots))]
        up = [(arena.view(slot), page) for slot, page in zip(slots, host, strict=True)]
        ticks, seconds = asyncio.run(_copy_while_ticking(copies, up))
        back = [torch.empty(SLOT_BYTES, dtype=torch.uint8) for _ in slots]
        copies.copy_now([(out, arena.view(slot)) for out, slot in zip(back, slots, strict=True)])
        ok = all(torch.equal(a, b) for a, b in zip(back, host, strict=True)) and ticks > 0
        gbps = len(slots) * SLOT_BYTES / seconds / 1e9
        report.figures["host_to_vram_GBps"] = round(gbps, 2)
        report.check("stream_copies", ok, f"{len(slots)} pages up and back, byte for byte; "
                     f"event loop ticked {ticks} times during the upload ({gbps:.1f} GB/s)")
    finally:
        copies.close()
        arena.close()


async def _copy_while_ticking(copies: TierCopies, pairs: list) -> tuple[int, float]:
    ticks = 0
    done = asyncio.ensure_future(copies.copy(pairs))
    start_s = time.perf_counter()
    while not done.done():
        ticks += 1
        await asyncio.sleep(0)
    await done
    return ticks, time.perf_counter() - start_s


def time_device_get(mapping: ArenaMapping, slots: list[int], rounds: int) -> dict:
    """A get's copies (cluster/fetch.py: page by page from the mapped slots into a KV tensor
    of [layers, 2, heads, tokens, head_dim]) against one flat copy of the same bytes."""
    layers, heads, tokens, dim = 8, 4, SLOT_BYTES // (8 * 2 * 4 * 2 * 128), 128
    pages = [mapping.view(slot).view(torch.bfloat16).view(layers, 2, heads, tokens, dim)
             for slot in slots]
    device = pages[0].device
    out = torch.empty(layers, 2, heads, tokens * len(pages), dim, dtype=torch.bfloat16,
                      device=device)
    flat_src = torch.empty(len(pages) * SLOT_BYTES, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)
    get_s, memcpy_s = [], []
    for _ in range(rounds):
        get_s.append(_timed(lambda: [out[:, :, :, i * tokens : (i + 1) * tokens].copy_(page)
                                     for i, page in enumerate(pages)], device))
        memcpy_s.append(_timed(lambda: flat_dst.copy_(flat_src), device))
    ok = all(torch.equal(out[:, :, :, i * tokens : (i + 1) * tokens], page)
             for i, page in enumerate(pages))
    return {"get_s": sorted(get_s)[rounds // 2], "memcpy_s": sorted(memcpy_s)[rounds // 2],
            "bytes": len(pages) * SLOT_BYTES, "equal": ok}


def _timed(fn, device: torch.device) -> float:
    torch.cuda.synchronize(device)
    start_s = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start_s


def check_device_get(report: Report) -> None:
    """The get runs in the peer, through its IPC mappings, as a client's would."""
    arena = device_arena("cuda", num_chunks=4)
    peer = Peer(peer_visibility("cuda")[0])
    try:
        slots = [arena.alloc() for _ in range(arena.num_slots)]
        for slot in slots:
            arena.view(slot).random_(0, 256)
        torch.cuda.synchronize()
        peer.ask("map", arena.descriptor())
        timing = peer.ask("get", slots, 7)
        ratio = timing["memcpy_s"] / timing["get_s"]
        report.ratios["device_get_vs_memcpy"] = round(ratio, 3)
        report.figures["device_get_GBps"] = round(timing["bytes"] / timing["get_s"] / 1e9, 1)
        report.check("device_get", timing["equal"] and ratio >= MIN_GET_VS_MEMCPY,
                     f"{len(slots)} pages of {SLOT_BYTES >> 20} MiB: get "
                     f"{timing['get_s'] * 1e3:.2f} ms, memcpy {timing['memcpy_s'] * 1e3:.2f} ms, "
                     f"ratio {ratio:.2f} (>= {MIN_GET_VS_MEMCPY}), bytes equal: "
                     f"{timing['equal']}")
    finally:
        peer.close()
        arena.close()


def check_connector_layouts(report: Report, device: str) -> None:
    try:
        from cluster.core.kv_layout_check import selfcheck
    except ImportError:
        report.line("SKIP", "connector layouts", "cluster.core.kv_layout_check not present")
        return
    for name, ok, detail in selfcheck(device):
        report.check(f"connector/{name}", ok, detail)


def check_vram_budget(report: Report) -> None:
    """The node's start-up check on this machine's GPUs, with the default device_bytes."""
    gpus = measure_gpus()
    shares = vram_budget(256 << 20, gpus)
    report.figures["max_gpu_memory_utilization"] = [s.max_gpu_memory_utilization
                                                    for s in shares]
    ok = bool(shares) and all(0 < s.max_gpu_memory_utilization < 1 for s in shares)
    report.check("vram_budget", ok, describe_budget(shares))


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def _sync_all(arena: MappedArena, slots: list[int]) -> None:
    """Wait for the work queued on every GPU the slots lie on."""
    for device in {arena.view(slot).device for slot in slots}:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


CUDA_CHECKS = ("vram_budget", "chunks_ipc[cuda]", "regrant_remap[cuda]", "stream_copies",
               "device_get", "connector layouts")


def run_checks(report: Report) -> None:
    """Every check on CUDA; without it, a SKIP line per check."""
    if not torch.cuda.is_available():
        for name in CUDA_CHECKS:
            report.line("SKIP", name, "no CUDA device here")
        return
    steps = (lambda: check_vram_budget(report), lambda: check_chunks_ipc(report, "cuda"),
             lambda: check_regrant_remap(report, "cuda"),
             lambda: check_stream_copies(report), lambda: check_device_get(report),
             lambda: check_connector_layouts(report, "cuda"))
    for name, step in zip(CUDA_CHECKS, steps, strict=True):
        try:
            step()
        except Exception as error:  # noqa: BLE001 - one broken check must not hide the rest
            report.check(name, False, f"raised {type(error).__name__}: {error}")


def main() -> int:
    if sys.argv[1:] == ["--child"]:
        child_main()
        return 0
    report = Report()
    report.figures["gpus"] = local_gpu_uuids() if torch.cuda.is_available() else []
    run_checks(report)
    summary = report.summary()
    print(json.dumps(summary), flush=True)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
