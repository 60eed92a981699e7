"""The Grafana dashboard: generated from cluster/core/metric_names.py, every query on a defined
metric under the series name Ray 2.60's Prometheus exporter gives it, filtered by Ray's
SessionName and Cluster variables as Ray's own dashboards are."""

from __future__ import annotations

import json
import re

import pytest

from cluster.core.metric_names import COUNTER, GAUGE, HISTOGRAM, METRICS, MetricName
from cluster.tools import grafana
from tests.manifests._manifests import MANIFESTS

DASHBOARD = MANIFESTS / "grafana" / "raykv-dashboard.json"
SERIES = re.compile(r"\b(ray_[a-z0-9_]+)\{")  # a series is followed by its selector


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def exprs() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel["targets"]]


def test_the_committed_dashboard_is_the_generated_one():
    assert DASHBOARD.read_text() == grafana.render(), (
        "regenerate it: python -m cluster.tools.grafana manifests/grafana/raykv-dashboard.json")


def test_every_query_is_on_a_defined_metric():
    defined = {grafana.PREFIX + m.name + suffix for m in METRICS
               for suffix in grafana.SERIES_SUFFIXES[m.kind]}
    for expr in exprs():
        used = set(SERIES.findall(expr))
        assert used and used <= defined, f"{expr}: {used - defined}"


def test_every_metric_is_on_the_dashboard():
    used = {name for expr in exprs() for name in SERIES.findall(expr)}
    for metric in METRICS:
        assert any(series.startswith(grafana.PREFIX + metric.name) for series in used), metric


def test_queries_use_only_the_metrics_tags_and_rays_labels():
    by_series = {grafana.PREFIX + m.name + s: m for m in METRICS
                 for s in grafana.SERIES_SUFFIXES[m.kind]}
    for expr in exprs():
        for series, selector in re.findall(r"(ray_[a-z0-9_]+)\{([^}]*)\}", expr):
            labels = set(re.findall(r"(\w+)\s*=~?", selector))
            allowed = {*by_series[series].tag_keys, "SessionName", "ray_io_cluster"}
            assert labels <= allowed, f"{series}: {labels - allowed}"
        for by in re.findall(r"by \(([^)]*)\)", expr):
            labels = {label.strip() for label in by.split(",")} - {"le"}
            assert any(labels <= set(m.tag_keys) for m in METRICS), by


def test_it_has_rays_session_and_cluster_variables():
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert {"datasource", "SessionName", "Cluster"} <= set(variables)
    assert variables["SessionName"]["query"]["query"].endswith(", SessionName)")
    assert variables["Cluster"]["query"]["query"].endswith(", ray_io_cluster)")
    for expr in exprs():
        assert 'SessionName=~"$SessionName"' in expr and 'ray_io_cluster=~"$Cluster"' in expr


def test_panels_have_unique_ids_and_the_datasource_variable():
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert all(p["datasource"] == "${datasource}" for p in panels)


@pytest.fixture
def exported_names():
    """What Ray 2.60's metrics agent serves for a counter, a gauge and a histogram: it registers
    `ray_<name>` instruments with unit "1" on OpenTelemetry's PrometheusMetricReader
    (ray/_private/telemetry/open_telemetry_metric_recorder.py); read the exposition back."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.metrics import Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import REGISTRY, generate_latest

    reader = PrometheusMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    meter = provider.get_meter("raykv-test")
    attributes = {"tier": "host", "node": "n1"}
    meter.create_observable_counter("ray_raykv_test_count", unit="1",
                                    callbacks=[lambda _: [Observation(3.0, attributes)]])
    meter.create_observable_gauge("ray_raykv_test_used_bytes", unit="1",
                                  callbacks=[lambda _: [Observation(5.0, attributes)]])
    meter.create_histogram("ray_raykv_test_latency_s", unit="1").record(0.2, attributes)
    try:
        text = generate_latest(REGISTRY).decode()
    finally:
        provider.shutdown()  # unregisters the reader's collector
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line.startswith("ray_raykv_test")}


def test_series_names_follow_rays_exporter(exported_names):
    for kind, name in ((COUNTER, "raykv_test_count"), (GAUGE, "raykv_test_used_bytes"),
                       (HISTOGRAM, "raykv_test_latency_s")):
        metric = MetricName(name, kind, "", ())
        expected = {grafana.PREFIX + name + suffix for suffix in grafana.SERIES_SUFFIXES[kind]}
        assert expected <= exported_names, (metric, exported_names)
