"""The series (``muxproxy.core.observe.series``): bucket rules and the merge of hand-written
snapshots. Snapshots taken from a running core are merged in ``test_measure.py``."""

from __future__ import annotations

from typing import Any

import pytest

from muxproxy.core.observe.series import GAUGE, HISTOGRAM, SNAPSHOT_FORMAT, Histogram, merge


def test_an_observation_on_a_bound_falls_in_that_bucket_and_above_the_last_in_inf() -> None:
    hist = Histogram((0.1, 1.0))
    for value in (0.1, 0.5, 1.0, 2.0, 0.0):
        hist.observe(value)
    assert hist.counts == [2, 2, 1]  # <= 0.1, <= 1.0, +Inf; not cumulative
    assert hist.sum == pytest.approx(3.6)


def snapshot(**metrics: Any) -> dict[str, Any]:
    return {"format": SNAPSHOT_FORMAT, "metrics": metrics}


def gauge(how: str, *samples: Any) -> dict[str, Any]:
    return {"type": GAUGE, "help": "", "labels": ["server"], "merge": how, "samples": list(samples)}


def test_merge_takes_min_max_or_sum_of_a_gauge_as_it_says() -> None:
    a = snapshot(up=gauge("min", [["s1"], 1], [["s2"], 1]), w=gauge("max", [["s1"], 3]))
    b = snapshot(up=gauge("min", [["s1"], 0]), w=gauge("max", [["s1"], 5], [["s2"], 2]))
    merged = merge([a, b])["metrics"]
    assert merged["up"]["samples"] == [[["s1"], 0], [["s2"], 1]]
    assert merged["w"]["samples"] == [[["s1"], 5], [["s2"], 2]]


def test_merge_adds_histogram_buckets_and_sums_and_refuses_a_wrong_bucket_count() -> None:
    def hist(counts: list[int], total: float) -> dict[str, Any]:
        return {
            "type": HISTOGRAM,
            "help": "",
            "labels": [],
            "buckets": [1.0],
            "samples": [[[], counts, total]],
        }

    merged = merge([snapshot(h=hist([1, 0], 0.5)), snapshot(h=hist([2, 1], 3.0))])
    assert merged["metrics"]["h"]["samples"] == [[[], [3, 1], 3.5]]
    with pytest.raises(ValueError, match="h: a sample has the wrong bucket count"):
        merge([snapshot(h=hist([1, 0, 0], 0.5))])
