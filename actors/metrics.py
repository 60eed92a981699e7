"""raykv's metrics, through ray.util.metrics: Ray's Prometheus endpoint serves them (with a
`ray_` prefix) on every node. The names, kinds and tags come from cluster/core/metric_names.py,
which the Grafana dashboard is built from too.

A node actor publishes its store's figures on each heartbeat: counters as the change since
the last one, gauges as they are. Clients observe their own latencies.
"""

from __future__ import annotations

from ray.util import metrics as ray_metrics

from cluster.core.metric_names import COUNTER, GAUGE, METRICS

LATENCY_BOUNDARIES_S = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                        5.0, 10.0]
TIERS = ("device", "host", "disk")


def _make(metric):
    if metric.kind == COUNTER:
        return ray_metrics.Counter(metric.name, metric.description, tag_keys=metric.tag_keys)
    if metric.kind == GAUGE:
        return ray_metrics.Gauge(metric.name, metric.description, tag_keys=metric.tag_keys)
    return ray_metrics.Histogram(metric.name, metric.description, LATENCY_BOUNDARIES_S,
                                 tag_keys=metric.tag_keys)


class Metrics:
    """Every raykv metric of this process, tagged with its node."""

    def __init__(self, node_id: str):
        self.node = node_id[:12]
        self._metrics = {metric.name: _make(metric) for metric in METRICS}

    def count(self, name: str, value: float, **tags: str) -> None:
        if value > 0:
            self._metrics[name].inc(value, tags={"node": self.node, **tags})

    def gauge(self, name: str, value: float, **tags: str) -> None:
        self._metrics[name].set(value, tags={"node": self.node, **tags})

    def observe(self, name: str, seconds: float) -> None:
        self._metrics[name].observe(seconds, tags={"node": self.node})


class NodePublisher:
    """A node's store figures as metrics: counter deltas since the last publish, gauges."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self._last: dict[str, float] = {}

    def _delta(self, key: str, value: float) -> float:
        delta = value - self._last.get(key, 0.0)
        self._last[key] = value
        return delta

    def publish(self, stats: dict) -> None:
        m = self.metrics
        for tier in TIERS:
            m.count("raykv_hits", self._delta(f"hits_{tier}", stats.get(f"hits_{tier}", 0)),
                    tier=tier)
            m.count("raykv_evictions", self._delta(f"evicted_{tier}",
                                                   stats.get("evictions", {}).get(tier, 0)),
                    tier=tier)
            memory = stats["memory"]["tiers"][tier]
            m.gauge("raykv_tier_used_bytes", memory["held_bytes"], tier=tier)
            m.gauge("raykv_tier_capacity_bytes", memory["capacity_bytes"], tier=tier)
        m.count("raykv_misses", self._delta("misses", stats.get("misses_pages", 0)))
        for path, key in (("disk_read", "disk_bytes_read"), ("disk_write", "disk_bytes_written")):
            m.count("raykv_bytes_moved", self._delta(key, stats.get(key, 0)), path=path)
        for model, held in stats.get("models", {}).items():
            m.gauge("raykv_quota_used_bytes", held, model=model, namespace="*")
        by_namespace: dict[str, int] = {}
        for tier in TIERS:
            for namespace, held in stats["memory"]["tiers"][tier]["namespaces"].items():
                by_namespace[namespace or "-"] = by_namespace.get(namespace or "-", 0) + held
        for namespace, held in by_namespace.items():
            m.gauge("raykv_quota_used_bytes", held, model="*", namespace=namespace)
        m.gauge("raykv_paging_tax_us_per_token", stats.get("disk_read_us_per_token", 0.0))
