"""The names of raykv's metrics: one list that the code recording them (ray.util.metrics) and the
Grafana dashboard in manifests/ both read, so the two cannot drift apart.

Ray's Prometheus endpoint exports each with a `ray_` prefix; see cluster/tools/grafana.py for
the series names a counter, gauge and histogram become. Pure: no Ray.
"""

from __future__ import annotations

from typing import NamedTuple

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"


class MetricName(NamedTuple):
    """One metric: (name, kind, description, tag keys)."""

    name: str
    kind: str  # COUNTER, GAUGE or HISTOGRAM
    description: str
    tag_keys: tuple[str, ...]


METRICS: list[MetricName] = [
    MetricName("raykv_hits", COUNTER, "Pages served, per tier.", ("tier", "node")),
    MetricName("raykv_misses", COUNTER, "Pages asked for and not found.", ("node",)),
    MetricName("raykv_bytes_moved", COUNTER,
               "Bytes moved, per path: get_local, get_remote, put, disk_read, disk_write.",
               ("path", "node")),
    MetricName("raykv_get_latency_s", HISTOGRAM, "Seconds per client get.", ("node",)),
    MetricName("raykv_put_latency_s", HISTOGRAM, "Seconds per client put.", ("node",)),
    MetricName("raykv_fetch_latency_s", HISTOGRAM, "Seconds per fetch of remote pages.",
               ("node",)),
    MetricName("raykv_evictions", COUNTER, "Pages evicted out of a tier.", ("tier", "node")),
    MetricName("raykv_tier_used_bytes", GAUGE, "Bytes of a tier in use.", ("tier", "node")),
    MetricName("raykv_tier_capacity_bytes", GAUGE, "Bytes a tier holds.", ("tier", "node")),
    MetricName("raykv_quota_used_bytes", GAUGE, "Bytes a model and namespace hold.",
               ("model", "namespace", "node")),
    MetricName("raykv_paging_tax_us_per_token", GAUGE,
               "Microseconds per decoded token that pages on disk add.", ("node",)),
]
METRICS_BY_NAME: dict[str, MetricName] = {metric.name: metric for metric in METRICS}
