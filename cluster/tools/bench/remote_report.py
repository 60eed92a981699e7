"""The tables and notes of `raykv bench remote`."""

from __future__ import annotations

from cluster.tools.bench import common

GBPS_ROWS = [("raykv", "raykv remote get (A -> B's out)"),
             ("replication", "raykv replication pull (A -> B's host tier)"),
             ("tcp", "raw TCP, same connections and threads"),
             ("tcp_rows", "  the same into out's rows"),
             ("dataplane", "raykv's transport alone (A's page server -> out)"),
             ("ray", "Ray objects: ray.get + copy")]
MS_ROWS = [("control_s", "get's control plane: acquire + match"),
           ("adopt_s", "B pulls what the get read (off its path)")]


def print_report(result: dict) -> None:
    per_size = result["per_size"]
    sizes = list(per_size)
    header = ["", *(f"{size} pages" for size in sizes)]
    mib = result["config"]["prompt_bytes"] >> 20
    lanes = "/".join(str(per_size[size]["lanes"]) for size in sizes)
    common.print_tables([
        common.table(f"a {mib} MiB prompt between nodes over {lanes} lanes, GB/s (medians)",
                     header, ([label, *(f"{per_size[s]['gbps'][key]:.2f}" for s in sizes)]
                              for key, label in GBPS_ROWS)),
        common.table("phases, ms (medians)", header,
                     ([label, *(f"{per_size[s]['phases_ms'][key]:.1f}" for s in sizes)]
                      for key, label in MS_ROWS)),
        _nixl_table(result["nixl"], mib)])


def _nixl_table(nixl: dict, mib: int):
    if "skipped" in nixl:
        return common.table("NIXL against TCP", ["", "not run"], [["why", nixl["skipped"]]])
    return common.table(f"A's page server -> out, {mib} MiB prompt, {nixl['page_mib']} MiB "
                        "pages, GB/s (medians)", ["read over", "GB/s"],
                        [[name, f"{nixl['gbps'][name]:.2f}"] for name in ("tcp", "nixl")])


NOTES = [
    "three simulated nodes on one machine (ray.cluster_utils.Cluster, one raylet and object "
    "store each); every A -> B move crosses loopback TCP: raykv's data plane, the raw "
    "streams and Ray's object manager alike (no same-host shortcut is taken by any of them)",
    "lanes: raykv's TCP reader splits a read of >= 8 MiB into 2 runs of pages on 2 "
    "connections received in parallel threads (cluster/core/dataplane/reader.py LANES); the "
    "raw TCP baseline uses the same count (per_size.*.lanes), the same split and the same "
    "threads (lane 0 on the caller, the others on a thread each), and the data plane's own "
    "receive routine",
    "each ratio is the median over rounds of (raykv GB/s / baseline GB/s), both taken in the "
    "same round, rounds in rotating order (harness.interleave), after an untimed warm-up "
    "call of each contender; spread holds every round's value",
    "remote_get_vs_tcp: client.get on B of a fresh prompt held only on A (keys, B's acquire "
    "and the directory match, the data plane into out's strided page slices) against the "
    "raw TCP streams into a touched contiguous buffer; it fails unless every get read all "
    "its pages from A (client counter remote_pages)",
    "replication_vs_tcp: B's node actor pulls a fresh prompt from A (NodeCacheActor.pull, "
    "as the control loop's replication calls it, namespace asked of A), timed from the call "
    "to its return, when the pages are committed to B's host tier; GB/s = pages it moved x "
    "page bytes / seconds. It fails unless every pull moved all the pages and a get on B "
    "then found all of them there (client counter local_pages), with the bytes put",
    "remote_get_vs_ray: against what a user would run instead, ray.get on B of pages "
    "ray.put on A beforehand (the put untimed, as raykv's put is) + np.copyto of each into "
    "a touched buffer",
    "diagnostics without goals: dataplane_vs_tcp (raykv's transport alone, no Ray call), "
    "tcp_rows_vs_tcp (what out's layout alone costs the raw stream), "
    "remote_get_vs_dataplane (what the get's control calls cost); phases_ms: control = B's "
    "acquire (a miss) and the directory match sent together, adopt = from the get's return "
    "until B's node reports the pages pulled (polled every 2 ms, off the get's path)",
    "the machine has 2 cores shared by the three raylets, the actors and both ends of every "
    "transfer; other jobs ran on it too (see machine.loadavg_*)",
    "nixl_vs_tcp (no goal): the service restarted with transport=nixl at 4 MiB pages; B "
    "reads the same prompt from A's page server into out over TCP and over NIXL (A writes "
    "into B's registered staging, B copies into out's rows), interleaved; it is reported "
    "only when every timed NIXL read was pushed over NIXL. UCX picks the path: on this "
    "one-host cluster shared memory (CMA), not RDMA",
]
