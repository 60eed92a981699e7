"""The tables and notes of `raykv bench remote`."""

from __future__ import annotations

from cluster.tools.bench import common

GBPS_ROWS = [("remote_get", "raykv remote get (A->B)"),
             ("dataplane", "  its data plane alone (A's page server -> out)"),
             ("tcp", "raw TCP stream, sendall -> recv_into"),
             ("tcp_rows", "raw TCP stream into out's rows (recvmsg_into)"),
             ("sendfile", "raw TCP stream, sendfile from /dev/shm"),
             ("ray", "Ray objects: ray.get + copy (A->B)"), ("ray_fetch", "  of which ray.get"),
             ("replicated_get", "replicated prefix read on B"),
             ("local_get", "the same prefix read on A (local)"), ("memcpy", "memcpy on B")]
MS_ROWS = [("remote_get", "raykv remote get"), ("control", "  control: acquire + match"),
           ("dataplane", "  data plane alone"), ("pull", "B pulls what it read (off path)"),
           ("tcp", "raw TCP"), ("tcp_rows", "raw TCP into out's rows"),
           ("sendfile", "raw TCP, sendfile"), ("ray", "Ray objects")]


def print_report(result: dict) -> None:
    sizes = list(result["per_size"])
    header = ["contender", *(f"{size} page" for size in sizes)]
    per_size = result["per_size"]
    mib = result["config"]["prompt_bytes"] >> 20
    common.print_tables([
        common.table(f"cross-node read of a {mib} MiB prompt, GB/s (medians)", header,
                     ([label, *(f"{per_size[s]['gbps'][key]:.2f}" for s in sizes)]
                      for key, label in GBPS_ROWS)),
        common.table("where the time goes, ms per prompt (medians)", header,
                     ([label, *(f"{per_size[s]['ms'][key]:.1f}" for s in sizes)]
                      for key, label in MS_ROWS)),
        *_nixl_tables(result.get("nixl", {}), mib)])


def _nixl_tables(nixl: dict, mib: int) -> list:
    if "nixl_vs_tcp" not in nixl:
        return [common.table("NIXL against TCP", ["", "skipped"],
                             [["why", nixl.get("skipped", "not measured")]])]
    rows = [[name, f"{nixl['gbps'][name]:.2f}"] for name in ("tcp", "nixl")]
    rows.append(["nixl_vs_tcp (median of rounds)", f"{nixl['nixl_vs_tcp']:.3f}"])
    return [common.table(f"A's page server -> out, {mib} MiB prompt, {nixl['page_mib']} MiB "
                         f"pages, {nixl['rounds']} rounds: GB/s (medians)",
                         ["read over", "GB/s"], rows)]


NOTES = [
    "three simulated nodes on one machine (ray.cluster_utils.Cluster, one raylet and object "
    "store each); every A -> B move crosses loopback TCP: raykv's data plane, the raw "
    "streams and Ray's object manager alike (no same-host shortcut is taken by any of them)",
    "remote_get_vs_tcp: median over repetitions of (raw TCP seconds / raykv remote get "
    "seconds) for the same bytes, taken in the same repetition, at 4 MiB pages (1 MiB "
    "suffixed); raw TCP = sendall of the pages from A's process memory, recv_into a touched "
    "contiguous buffer on B (MSG_WAITALL), one connection reused; raykv's get lands the "
    "bytes in out's strided page slices (512 rows per page) and includes B's control RPCs",
    "remote_get_vs_ray: the same against ray.get on B of pages ray.put on A beforehand "
    "(the put untimed, as raykv's put is) + np.copyto of each into a touched buffer",
    "replicated_get_vs_local_get: the hot prompt pulled to B by B's node actor (the "
    "replication path), then read REPLICA_READS times on B and on A alternately after a "
    "warm-up each; median over pairs of (A's seconds / B's seconds)",
    "tcp_rows: the raw stream (no raykv code) scattered with recvmsg_into into out's page "
    "slices, the layout raykv's get fills: what the layout alone costs against raw TCP",
    "dataplane: TcpTransport.read of the prompt from A's page server into out, without the "
    "client's control calls; control: B's acquire (a miss) and the directory match sent "
    "together and both awaited",
    "pull: from the get's return until B's node actor reports the pages pulled (polled every "
    "2 ms; off the critical path, waited for so it does not overlap the next measurement)",
    "the machine has 2 cores shared by the three raylets, the actors and both ends of every "
    "transfer; other engineers' jobs ran on it too (see machine.loadavg_*)",
    f"kv geometry: {common.LLAMA_8B_KV.name}, bf16, 128 KiB per token",
    "nixl_vs_tcp: the service restarted with transport=nixl at 4 MiB pages; B reads the same "
    "prompt from A's page server into out over TCP and over NIXL (A writes it into B's "
    "registered staging, B copies it into out's rows), in pairs whose order flips every "
    "round, after a warm-up pair; the median of the rounds' (TCP seconds / NIXL seconds). "
    "UCX chooses NIXL's path: on this one-host cluster shared memory (CMA), not RDMA",
]
