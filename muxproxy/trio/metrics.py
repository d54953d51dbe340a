"""The Prometheus exposition of the core's measurements: ``render(snapshots) -> bytes``.

The core measures (``muxproxy.core.observe.measure``: plain counters and fixed-bucket histograms)
and hands out snapshots as data; each worker's snapshot reaches whoever serves ``/metrics``, which
merges them (``series.merge``: sums, and min / max for the gauges that say so) and renders
the result here with prometheus_client's public API: a ``Collector`` yielding metric families
into a private ``CollectorRegistry``, written by ``generate_latest`` in the text format
(version 0.0.4). prometheus_client's multiprocess mode is not used: it would put its own
``observe`` (a few microseconds each in that mode) on the per-token path, see
``docs/architecture.md``, "Metrics: measured in the core, exported by the driver".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from muxproxy.core.observe.series import COUNTER, GAUGE, merge

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Content-Type of what ``render`` returns (Prometheus text format 0.0.4)."""


class SnapshotCollector(Collector):
    """Yields the metric families of one (merged) snapshot."""

    def __init__(self, snapshot: Mapping[str, Any]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        for name, metric in self.snapshot["metrics"].items():
            yield family(name, metric)


def family(name: str, metric: Mapping[str, Any]) -> Metric:
    """One metric of a snapshot as a prometheus_client metric family."""
    kind = metric["type"]
    labels = list(metric["labels"])
    help_text = metric["help"]
    if kind == COUNTER:
        counter = CounterMetricFamily(name, help_text, labels=labels)
        for values, value in metric["samples"]:
            counter.add_metric(values, value)
        return counter
    if kind == GAUGE:
        gauge = GaugeMetricFamily(name, help_text, labels=labels)
        for values, value in metric["samples"]:
            gauge.add_metric(values, value)
        return gauge
    histogram = HistogramMetricFamily(name, help_text, labels=labels)
    bounds = [repr(float(b)) for b in metric["buckets"]] + ["+Inf"]
    for values, counts, total in metric["samples"]:
        # The snapshot's counts are per bucket; Prometheus's are cumulative ("le").
        buckets = list(zip(bounds, accumulate(counts), strict=True))
        histogram.add_metric(values, buckets, total)
    return histogram


def render(snapshots: Sequence[Mapping[str, Any]]) -> bytes:
    """The Prometheus text exposition of ``snapshots`` (one per worker), merged.

    Raises ``ValueError`` (from ``series.merge``) when the snapshots disagree on a metric."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(merge(snapshots)))
    return generate_latest(registry)
