"""The Grafana dashboard of manifests/grafana/raykv-dashboard.json, built from the metric list
in cluster/core/metric_names.py:

    python -m cluster.tools.grafana manifests/grafana/raykv-dashboard.json

Ray's Prometheus endpoint prefixes every metric with `ray_`. In Ray 2.60 (its OpenTelemetry
exporter, and the older OpenCensus one alike) a counter is the series `ray_<name>_total`, a gauge
`ray_<name>`, and a histogram `ray_<name>_bucket`, `_sum` and `_count`. Like Ray's own
dashboards, every query is filtered by the `SessionName` and `Cluster` (`ray_io_cluster`, which
KubeRay's PodMonitor sets) template variables; a `Node` variable narrows to raykv nodes.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from cluster.core.metric_names import COUNTER, GAUGE, HISTOGRAM, METRICS_BY_NAME

PREFIX = "ray_"
SERIES_SUFFIXES = {COUNTER: ("_total",), GAUGE: ("",), HISTOGRAM: ("_bucket", "_sum", "_count")}
FILTERS = 'SessionName=~"$SessionName",ray_io_cluster=~"$Cluster",node=~"$Node"'
RATE_WINDOW = "[5m]"
VARIABLE_METRIC = "raykv_tier_capacity_bytes"  # a gauge every node actor sets from its start
UID = "raykvDashboard"


def series(name: str, suffix: str | None = None) -> str:
    """The exported series of metric `name` (KeyError for a metric that is not defined)."""
    suffixes = SERIES_SUFFIXES[METRICS_BY_NAME[name].kind]
    chosen = suffixes[0] if suffix is None else suffix
    assert chosen in suffixes, f"{name} has no series {chosen!r}"
    return PREFIX + name + chosen


def rate_by(name: str, labels: str) -> str:
    return f"sum by ({labels}) (rate({series(name)}{{{FILTERS}}}{RATE_WINDOW}))"


def total_rate(name: str) -> str:
    return f"sum(rate({series(name)}{{{FILTERS}}}{RATE_WINDOW}))"


def quantile(q: float, name: str) -> str:
    buckets = f"rate({series(name, '_bucket')}{{{FILTERS}}}{RATE_WINDOW})"
    return f"histogram_quantile({q}, sum by (le) ({buckets}))"


def gauge_by(name: str, labels: str) -> str:
    return f"sum by ({labels}) ({series(name)}{{{FILTERS}}})"


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    description: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)


def _latency_panel(name: str, what: str) -> Panel:
    return Panel(f"{what} latency", f"p50 and p99 of {what.lower()} seconds, all nodes.", "s",
                 ((quantile(0.5, name), "p50"), (quantile(0.99, name), "p99")))


PANELS: tuple[Panel, ...] = (
    Panel("Hit ratio", "Pages served over pages asked for.", "percentunit",
          ((f"{total_rate('raykv_hits')} / ({total_rate('raykv_hits')} + "
            f"{total_rate('raykv_misses')})", "hit ratio"),)),
    Panel("Hits per tier", "Pages served per second, by the tier they came from.", "ops",
          ((rate_by("raykv_hits", "tier"), "{{tier}}"),
           (rate_by("raykv_misses", "node"), "misses {{node}}"))),
    Panel("Bytes moved", "Bytes per second, by path.", "Bps",
          ((rate_by("raykv_bytes_moved", "path"), "{{path}}"),)),
    Panel("Tier use", "Bytes in use against each tier's capacity, all nodes.", "bytes",
          ((gauge_by("raykv_tier_used_bytes", "tier"), "used {{tier}}"),
           (gauge_by("raykv_tier_capacity_bytes", "tier"), "capacity {{tier}}"))),
    _latency_panel("raykv_get_latency_s", "Get"),
    _latency_panel("raykv_put_latency_s", "Put"),
    _latency_panel("raykv_fetch_latency_s", "Remote fetch"),
    Panel("Evictions", "Pages evicted per second, by tier.", "ops",
          ((rate_by("raykv_evictions", "tier"), "{{tier}}"),)),
    Panel("Quota use", "Bytes held per model and namespace.", "bytes",
          ((gauge_by("raykv_quota_used_bytes", "model, namespace"), "{{model}} / {{namespace}}"),)),
    Panel("Paging tax", "Microseconds per decoded token that pages on disk add, per node.", "µs",
          ((gauge_by("raykv_paging_tax_us_per_token", "node"), "{{node}}"),)),
)


def _panel_json(panel: Panel, panel_id: int) -> dict:
    return {
        "id": panel_id, "type": "timeseries", "title": panel.title,
        "description": panel.description, "datasource": "${datasource}",
        "gridPos": {"h": 8, "w": 12, "x": 12 * ((panel_id - 1) % 2),
                    "y": 8 * ((panel_id - 1) // 2)},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"}},
        "targets": [{"expr": expr, "legendFormat": legend, "refId": chr(ord("A") + index)}
                    for index, (expr, legend) in enumerate(panel.targets)],
    }


def _query_variable(name: str, label: str, description: str, selector: str = "") -> dict:
    query = f"label_values({PREFIX}{VARIABLE_METRIC}{{{selector}}}, {label})"
    return {"name": name, "type": "query", "datasource": "${datasource}",
            "definition": query, "query": {"query": query, "refId": "StandardVariableQuery"},
            "description": description, "includeAll": True, "allValue": ".*", "multi": False,
            "refresh": 1, "sort": 2, "hide": 0, "current": {"selected": False}, "options": []}


def _variables() -> list[dict]:
    datasource = {"name": "datasource", "type": "datasource", "query": "prometheus",
                  "hide": 0, "current": {"selected": False}, "options": [], "refresh": 1}
    node = _query_variable("Node", "node", "raykv nodes to show.",
                           'SessionName=~"$SessionName",ray_io_cluster=~"$Cluster"')
    node["multi"] = True
    return [datasource,
            _query_variable("SessionName", "SessionName", "Filter queries to a Ray session."),
            _query_variable("Cluster", "ray_io_cluster", "Filter queries to a Ray cluster "
                            "(the ray_io_cluster label KubeRay's PodMonitor sets)."),
            node]


def build_dashboard() -> dict:
    """The dashboard as a dict, ready for json.dump."""
    return {
        "title": "raykv", "uid": UID, "description": "raykv: hits, bytes moved, latency, tier "
        "use, evictions, quotas and the paging tax, from Ray's Prometheus metrics.",
        "tags": ["raykv", "ray"], "editable": True, "schemaVersion": 27, "version": 1,
        "time": {"from": "now-30m", "to": "now"}, "refresh": "30s", "timezone": "",
        "graphTooltip": 1, "templating": {"list": _variables()},
        "panels": [_panel_json(panel, index + 1) for index, panel in enumerate(PANELS)],
        "annotations": {"list": []}, "links": [],
    }


def render() -> str:
    return json.dumps(build_dashboard(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m cluster.tools.grafana OUT.json")
    from cluster.tools.outputs import write_text_atomic

    write_text_atomic(sys.argv[1], render())
