"""A simulated multi-node Ray cluster on this machine (one raylet per node, each a kv node),
raykv on it, and the Serve app over HTTP on loopback: what the demo and `raykv bench serve`
run on."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from cluster.core.config import MiB

OBJECT_STORE_BYTES = 160 * MiB


@contextmanager
def simulated_cluster(num_nodes: int, cpus_per_node: int = 1,
                      resources: dict[str, float] | None = None):
    """A connected `ray.cluster_utils.Cluster` of `num_nodes` kv nodes, each with `resources`
    too; torn down after (raykv stopped first, so node actors unlink their shared memory)."""
    import ray
    from ray.cluster_utils import Cluster

    if num_nodes < 1:
        raise ValueError(f"num_nodes must be at least 1, got {num_nodes}")
    if ray.is_initialized():
        raise RuntimeError("a simulated cluster needs this process off Ray; ray.shutdown() first")
    node_args = {"num_cpus": cpus_per_node, "resources": {"kv_node": 1, **(resources or {})},
                 "object_store_memory": OBJECT_STORE_BYTES}
    # Metrics reach Ray's Prometheus endpoints every 2 s rather than 10 (the demo shows them).
    head_args = {**node_args, "include_dashboard": False,
                 "_system_config": {"metrics_report_interval_ms": 2000}}
    cluster = Cluster(initialize_head=True, head_node_args=head_args)
    try:
        for _ in range(num_nodes - 1):
            cluster.add_node(**node_args)
        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        _teardown(cluster)


def _teardown(cluster) -> None:
    import ray
    from ray import serve

    from cluster import stop

    try:
        if ray.is_initialized():
            serve.shutdown()
            stop()
    finally:
        ray.shutdown()
        cluster.shutdown()


def start_serve(port: int) -> str:
    """Serve's HTTP proxy on 127.0.0.1:`port`, on the head node only (simulated nodes share
    the host's ports); returns the base URL."""
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly",
                logging_config={"log_level": logging.WARNING})
    return f"http://127.0.0.1:{port}"


def deploy(app_args: dict) -> None:
    """(Re)deploy the raykv Serve app with these AppArgs; returns once it is healthy."""
    from ray import serve

    from cluster.serving.app import build_app

    serve.run(build_app(app_args), name="raykv", route_prefix="/")


def metric_lines() -> Iterator[str]:
    """Every line of every live node's Prometheus endpoint (a node that does not answer is
    skipped)."""
    import urllib.request

    import ray

    for node in ray.nodes():
        if not node["Alive"] or not node.get("MetricsExportPort"):
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                text = reply.read().decode()
        except OSError:
            continue
        yield from text.splitlines()


def scrape_metric(series_name: str, label: str) -> dict[str, float]:
    """Sum of a metric series over every node's Prometheus endpoint, by one label."""
    totals: dict[str, float] = {}
    for line in metric_lines():
        if line.startswith(series_name + "{") and f'{label}="' in line:
            key = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals
