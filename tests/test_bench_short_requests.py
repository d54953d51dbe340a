"""Tests of the short-request benchmark's arithmetic (``bench/short_stats.py``): h2load's output
read right, CPU per request from the same window as the requests, the ⚠ where the proxy was
not the limit, and the comparisons with direct and nginx on the same protocol. Pure: no
processes, no sockets, no clock.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from short_requests import KEEPALIVE_REQUESTS, nginx_proxy_conf
from short_stats import (
    H2loadOutputError,
    cpu_busy_pct,
    latency_figures,
    load_figures,
    parse_h2load,
    parse_request_log,
    quantile,
    rows,
    table,
)

H2LOAD_OUTPUT = """\
starting benchmark...
spawning thread #0: 16 total client(s). Timing-based test with 1s of warm-up time and 3s of main \
duration for measurements.
Warm-up phase is over for thread #0.
Main benchmark duration is over for thread #0. Stopping all clients.

finished in 4.00s, 1371.00 req/s, 390.95KB/s
requests: 4113 total, 4113 started, 4110 done, 4100 succeeded, 3 failed, 2 errored, 1 timeout
status codes: 4100 2xx, 0 3xx, 7 4xx, 3 5xx
traffic: 1.15MB (1200996) total, 952.18KB (975033) headers (space savings 0.00%), 323.05KB \
(330803) data
                     min         max         mean         sd        +/- sd
time for request:     4.42ms     50.43ms     11.70ms      5.98ms    81.89%
"""


def test_h2load_summary_is_read_with_its_counts_and_status_classes() -> None:
    summary = parse_h2load(H2LOAD_OUTPUT)
    assert summary["seconds"] == 4.0
    assert summary["rps"] == 1371.0
    assert (summary["done"], summary["succeeded"], summary["failed"]) == (4110, 4100, 3)
    assert (summary["errored"], summary["timeout"]) == (2, 1)
    assert (summary["2xx"], summary["4xx"], summary["5xx"]) == (4100, 7, 3)


@pytest.mark.parametrize(("shown", "seconds"), [("581us", 581e-6), ("49.39ms", 0.04939)])
def test_h2load_durations_in_every_unit_become_seconds(shown: str, seconds: float) -> None:
    text = H2LOAD_OUTPUT.replace("finished in 4.00s", f"finished in {shown}")
    assert parse_h2load(text)["seconds"] == pytest.approx(seconds)


def test_h2load_output_without_a_summary_says_what_it_printed() -> None:
    with pytest.raises(H2loadOutputError, match="-D: value error"):
        parse_h2load("-D: value error 1.5\n")


def test_request_log_skips_the_warm_up_rows_and_counts_what_was_not_2xx() -> None:
    log = "1700000000000000\t200\t900\n1700000000001000\t200\t120\n"
    log += "1700000000002000\t502\t80\n1700000000003000\t200\t100\n"
    times, bad = parse_request_log(log, skip=1)
    assert times == [120.0, 100.0]
    assert bad == 1


def test_request_log_rejects_a_row_that_is_not_h2load_s() -> None:
    with pytest.raises(ValueError, match="not an h2load log row"):
        parse_request_log("garbage\n")


def test_quantiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert quantile(values, 0.5) == 50.0
    assert quantile(values, 0.99) == 99.0
    assert quantile([7.0], 0.99) == 7.0
    assert quantile([], 0.5) is None
    assert latency_figures([3.0, 1.0, 2.0], 0)["p50_us"] == 2.0


def summary(rps: float) -> dict[str, float]:
    counts = dict.fromkeys(("done", "failed", "errored", "timeout", "3xx", "4xx", "5xx"), 0.0)
    return {**counts, "rps": rps, "done": rps * 6}


def test_cpu_per_request_is_the_proxy_cpu_rate_over_the_request_rate() -> None:
    # 0.9 CPU s per s at 3,000 requests/s: 300 µs a request, 3,333 a second per core.
    run = load_figures(summary(3000), 4.0, {"proxy": 3.6, "backend": 0.4, "client": 0.2}, 1)
    assert run["us_per_request"] == pytest.approx(300.0)
    assert run["per_core"] == pytest.approx(1e6 / 300)
    assert run["cpu_pct"] == pytest.approx({"proxy": 90.0, "backend": 10.0, "client": 5.0})
    assert run["saturated"] is True


def test_a_proxy_under_90_percent_of_its_cores_is_not_the_limit() -> None:
    one_core = load_figures(summary(3000), 4.0, {"proxy": 3.2, "backend": 1.0, "client": 1.0}, 1)
    assert one_core["saturated"] is False
    two_workers = load_figures(summary(5000), 4.0, {"proxy": 7.0, "backend": 1, "client": 1}, 2)
    assert two_workers["saturated"] is False
    assert load_figures(summary(5000), 4.0, {"backend": 1.0}, 1).get("saturated") is None


def test_proxy_cpus_busy_counts_every_tick_but_idle_and_iowait() -> None:
    before = "cpu  0 0 0 0 0 0 0 0 0 0\ncpu0 100 0 0 100 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0 0 0\n"
    # cpu0: 150 ticks busy (user, system, softirq), 40 idle, 10 iowait.
    after = "cpu0 200 0 30 140 10 0 20 0 0 0\ncpu1 100 0 0 100 0 0 0 0 0 0\n"
    assert cpu_busy_pct(before, after, [0]) == pytest.approx(75.0)
    assert cpu_busy_pct(before, after, [0, 1]) == pytest.approx(125.0)


def load(name: str, proto: str, rps: float, proxy_s: float | None) -> dict[str, object]:
    cpu = {"backend": 1.0, "client": 1.0} | ({"proxy": proxy_s} if proxy_s is not None else {})
    run = load_figures(summary(rps), 4.0, cpu, 1)
    return {"variant": name, "label": name, "proto": proto, "kind": "load", **run}


def latency(name: str, proto: str, p50: float) -> dict[str, object]:
    run = latency_figures([p50, p50, p50 * 3], 0)
    return {"variant": name, "label": name, "proto": proto, "kind": "latency", **run}


RUNS: list[dict[str, object]] = [
    load("direct", "h1", 40000, None),
    latency("direct", "h1", 30.0),
    load("nginx", "h1", 20000, 2.0),  # 25 µs a request
    latency("nginx", "h1", 130.0),  # +100
    load("nginx-h2", "h2", 20000, 2.4),  # 30 µs
    latency("nginx-h2", "h2", 180.0),  # +150
    load("muxproxy-h1", "h1", 3000, 3.6),  # 300 µs: 12x nginx's
    load("muxproxy-h1", "h1", 2000, 3.6),  # 450 µs, a second repeat
    latency("muxproxy-h1", "h1", 530.0),  # +500: 5x nginx's
    load("muxproxy-h2", "h2", 2500, 3.0),  # 300 µs: 10x nginx-h2's, under 90 %: ⚠
    latency("muxproxy-h2", "h2", 630.0),  # +600: 4x nginx-h2's
]


def test_rows_compare_cpu_with_nginx_and_latency_with_direct_on_the_same_protocol() -> None:
    by_name = {
        r["variant"]: r
        for r in rows(RUNS, ["direct", "nginx", "nginx-h2", "muxproxy-h1", "muxproxy-h2"])
    }
    mux1, mux2 = by_name["muxproxy-h1"], by_name["muxproxy-h2"]
    assert mux1["us_per_request"] == pytest.approx(375.0)  # the median of 300 and 450
    assert mux1["repeats"] == 2
    assert mux1["cpu_ratio"] == pytest.approx(15.0)
    assert mux1["added_us"] == pytest.approx(500.0)
    assert mux1["added_ratio"] == pytest.approx(5.0)
    assert mux2["cpu_ratio"] == pytest.approx(10.0)
    assert mux2["added_ratio"] == pytest.approx(4.0)
    assert by_name["nginx"]["cpu_ratio"] == pytest.approx(1.0)
    assert by_name["direct"]["added_us"] is None
    assert (mux1["short"], mux2["short"]) == (False, True)


def test_table_flags_the_rows_the_proxy_did_not_limit_and_reports_errors() -> None:
    runs: list[dict[str, object]] = [
        *RUNS,
        {
            "variant": "h2-relay",
            "label": "h2-relay",
            "proto": "h2",
            "kind": "load",
            "error": "did not start: port in use",
        },
    ]
    text = table(
        rows(runs, ["direct", "nginx", "nginx-h2", "muxproxy-h1", "muxproxy-h2", "h2-relay"])
    )
    lines = text.splitlines()
    mux2 = next(line for line in lines if line.startswith("| muxproxy-h2 |"))
    assert "| 2,500 ⚠ |" in mux2
    assert "| 10.0x |" in mux2 and "| +600 | 4.0x |" in mux2
    mux1 = next(line for line in lines if line.startswith("| muxproxy-h1 |"))
    assert "⚠" not in mux1 and "| 375.0 | 2,667 | 15.0x |" in mux1
    assert any(line.startswith("⚠ muxproxy-h2: the proxy used 75 % CPU") for line in lines)
    assert "ERROR h2-relay: did not start: port in use" in lines


def test_nginx_keeps_client_and_backend_connections_alive_past_1000_requests() -> None:
    conf = nginx_proxy_conf()
    assert conf.count(KEEPALIVE_REQUESTS) == 2
    http, upstream = conf.index("http {"), conf.index("upstream sse_backend {")
    assert http < conf.index(KEEPALIVE_REQUESTS) < upstream < conf.rindex(KEEPALIVE_REQUESTS)
