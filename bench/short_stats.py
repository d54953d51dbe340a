"""The short-request benchmark's arithmetic: h2load's output in, per-run figures and the table out.

Pure (no processes, no clock, no files) so that what the table claims is tested with data
(``tests/test_bench_short_requests.py``); ``bench/short_requests.py`` runs the processes.

The figures, and why they are shaped so:

* **CPU µs per request** = the proxy's CPU seconds over the window / the requests h2load
  completed in it. Both come from the same window, measured as rates (CPU s per s, requests per
  s) so that a few milliseconds between h2load's window and the /proc samples cancel out.
* **requests/s per core** = 1e6 / CPU µs per request: what one core of this proxy would serve,
  whether or not the run saturated it. A run whose proxy used less than ``SATURATED`` of the
  cores it may use is flagged ⚠: the client or the backend set the pace, so its requests/s is
  not the proxy's ceiling (its CPU per request still is comparable).
* **latency**: one connection, one request at a time, no other load: per-request time from
  h2load's ``--log-file``; a proxy's added median over ``direct`` is what it adds to time to
  first byte (the answer is one read), compared with nginx's on the same client protocol.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SATURATED = 0.90
"""A proxy at this fraction of its cores or more is the limit of its run."""

REFERENCE = {"h1": "nginx", "h2": "nginx-h2"}
"""The variant each client protocol's ratios are taken against."""

_FINISHED = re.compile(r"^finished in ([0-9.]+)(us|ms|s), ([0-9.]+) req/s", re.MULTILINE)
_REQUESTS = re.compile(
    r"^requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
    r"(\d+) errored, (\d+) timeout",
    re.MULTILINE,
)
_STATUS = re.compile(r"^status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", re.MULTILINE)
_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


class H2loadOutputError(ValueError):
    """h2load printed no summary (it failed to connect, or was killed)."""


def parse_h2load(text: str) -> dict[str, float]:
    """The summary h2load prints at the end of a run (nghttp2 1.4x-1.6x format): ``seconds``
    and ``rps`` of the measured phase, request counts, status classes. H2loadOutputError when
    a line is missing."""
    finished = _FINISHED.search(text)
    requests = _REQUESTS.search(text)
    status = _STATUS.search(text)
    if finished is None or requests is None or status is None:
        tail = " | ".join(text.strip().splitlines()[-3:])
        raise H2loadOutputError(f"no h2load summary in its output ({tail or 'nothing'})")
    value, unit, rps = finished.groups()
    names = ("total", "started", "done", "succeeded", "failed", "errored", "timeout")
    out: dict[str, float] = {"seconds": float(value) * _UNIT_S[unit], "rps": float(rps)}
    out.update(zip(names, map(float, requests.groups()), strict=True))
    out.update(zip(("2xx", "3xx", "4xx", "5xx"), map(float, status.groups()), strict=True))
    return out


def parse_request_log(text: str, skip: int = 0) -> tuple[list[float], int]:
    """h2load's ``--log-file`` (start µs since the epoch, status, µs to the end of the answer;
    tab-separated, in order of completion with one thread): the times of the 2xx answers after
    the first ``skip`` rows (the warm-up), and how many of those rows were not 2xx."""
    times: list[float] = []
    bad = 0
    rows = [line.split("\t") for line in text.splitlines() if line.strip()]
    for row in rows[skip:]:
        if len(row) < 3:
            raise ValueError(f"not an h2load log row: {row!r}")
        if 200 <= int(row[1]) < 300:
            times.append(float(row[2]))
        else:
            bad += 1
    return times, bad


def quantile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank quantile (0 < q <= 1) of ``values``; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are there (None and NaN left out)."""
    present = sorted(v for v in values if v is not None and not math.isnan(v))
    if not present:
        return None
    mid = len(present) // 2
    return present[mid] if len(present) % 2 else (present[mid - 1] + present[mid]) / 2


def cpu_busy_pct(before: str, after: str, cpus: Iterable[int]) -> float:
    """How busy ``cpus`` were between two readings of /proc/stat, in % of one core (two CPUs
    fully busy: 200): everything but idle and iowait, whoever ran there."""

    def ticks(text: str) -> dict[int, tuple[int, int]]:
        out = {}
        for line in text.splitlines():
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                values = [int(f) for f in fields]
                out[int(name[3:])] = (sum(values[:8]), values[3] + values[4])
        return out

    first, second = ticks(before), ticks(after)
    busy = 0.0
    for cpu in cpus:
        total = second[cpu][0] - first[cpu][0]
        idle = second[cpu][1] - first[cpu][1]
        busy += 100.0 * (total - idle) / total if total > 0 else 0.0
    return busy


def load_figures(
    summary: Mapping[str, float],
    window_s: float,
    cpu_s: Mapping[str, float],
    cores: int,
    proxy_cpus_busy_pct: float | None = None,
) -> dict[str, Any]:
    """One load run's figures from h2load's ``summary`` and the CPU seconds each party
    (``proxy``, absent for ``direct``; ``backend``; ``client``) used over ``window_s``;
    ``proxy_cpus_busy_pct``: how busy the proxy's CPUs were (whoever ran there)."""
    rps = summary["rps"]
    out: dict[str, Any] = {
        "rps": rps,
        "done": summary["done"],
        "failed": summary["failed"] + summary["errored"] + summary["timeout"],
        "non_2xx": summary["3xx"] + summary["4xx"] + summary["5xx"],
        "window_s": window_s,
        "cpu_s": dict(cpu_s),
        "cpu_pct": {who: 100.0 * s / window_s for who, s in cpu_s.items()},
        "cores": cores,
        "proxy_cpus_busy_pct": proxy_cpus_busy_pct,
    }
    proxy = cpu_s.get("proxy")
    if proxy is not None and rps > 0:
        us = 1e6 * proxy / window_s / rps
        out["us_per_request"] = us
        out["per_core"] = 1e6 / us if us > 0 else None
        out["saturated"] = proxy / window_s >= SATURATED * cores
    return out


def latency_figures(times_us: Sequence[float], bad: int) -> dict[str, Any]:
    return {
        "count": len(times_us),
        "non_2xx": bad,
        "p50_us": quantile(times_us, 0.5),
        "p99_us": quantile(times_us, 0.99),
        "mean_us": sum(times_us) / len(times_us) if times_us else None,
    }


def _dig(run: Mapping[str, Any], path: str) -> float | None:
    value: Any = run
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value if isinstance(value, int | float) else None


ROW_METRICS = {
    "rps": "rps",
    "proxy_pct": "cpu_pct.proxy",
    "us_per_request": "us_per_request",
    "backend_pct": "cpu_pct.backend",
    "client_pct": "cpu_pct.client",
    "proxy_cpus_busy_pct": "proxy_cpus_busy_pct",
}


def rows(runs: Sequence[Mapping[str, Any]], order: Sequence[str]) -> list[dict[str, Any]]:
    """One row per variant (in ``order``): the median over repeats of each load and latency
    figure, whether any of its load runs left the proxy short of ``SATURATED``, the failures,
    and the comparisons with ``direct`` and with ``REFERENCE`` of its client protocol."""
    out: dict[str, dict[str, Any]] = {}
    for name in order:
        load = [r for r in runs if r.get("variant") == name and r.get("kind") == "load"]
        lat = [r for r in runs if r.get("variant") == name and r.get("kind") == "latency"]
        if not load and not lat:
            continue
        first = (load or lat)[0]
        row: dict[str, Any] = {"variant": name, "label": first["label"], "proto": first["proto"]}
        for metric, path in ROW_METRICS.items():
            row[metric] = median(_dig(r, path) for r in load if "error" not in r)
        # The inverse of the median, not the median of the inverses: the two columns agree
        # with an even number of repeats too.
        us = row["us_per_request"]
        row["per_core"] = 1e6 / us if us else None
        row["p50_us"] = median(_dig(r, "p50_us") for r in lat if "error" not in r)
        row["p99_us"] = median(_dig(r, "p99_us") for r in lat if "error" not in r)
        row["short"] = any(r.get("saturated") is False for r in load)
        row["failed"] = sum((r.get("failed") or 0) + (r.get("non_2xx") or 0) for r in load + lat)
        row["errors"] = [str(r["error"]) for r in load + lat if "error" in r]
        row["repeats"] = len(load)
        out[name] = row
    direct = out.get("direct")
    for row in out.values():
        ref = out.get(REFERENCE.get(row["proto"], ""))
        row["cpu_ratio"] = ratio(row["us_per_request"], ref["us_per_request"] if ref else None)
        row["added_us"] = None
        if direct is not None and row is not direct:
            row["added_us"] = difference(row["p50_us"], direct["p50_us"])
    for row in out.values():
        ref = out.get(REFERENCE.get(row["proto"], ""))
        row["added_ratio"] = ratio(row["added_us"], ref["added_us"] if ref else None)
    return list(out.values())


def ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference <= 0:
        return None
    return value / reference


def difference(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None:
        return None
    return value - reference


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def times(value: float | None) -> str:
    """A ratio as ``3.2x``."""
    return "-" if value is None else f"{value:.1f}x"


COLUMNS = [
    "variant",
    "client",
    "req/s",
    "proxy CPU %",
    "CPU µs / request",
    "req/s per core",
    "CPU / request ÷ nginx's",
    "latency p50 / p99 (µs)",
    "added p50 vs direct (µs)",
    "added ÷ nginx's",
    "backend / client CPU %",
]


def table(table_rows: Sequence[Mapping[str, Any]]) -> str:
    """The markdown table, then a note per flagged or failed row."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    notes: list[str] = []
    for r in table_rows:
        flag = " ⚠" if r["short"] else ""
        if r["short"]:
            notes.append(
                f"⚠ {r['label']}: the proxy used {fmt(r['proxy_pct'], '.0f')} % CPU, under "
                f"{SATURATED:.0%} of its cores in a run (backend "
                f"{fmt(r['backend_pct'], '.0f')} %, client {fmt(r['client_pct'], '.0f')} %, "
                f"the proxy's CPUs busy {fmt(r['proxy_cpus_busy_pct'], '.0f')} % with whatever "
                "ran there): the load or other processes, not the proxy, set its req/s; its "
                "CPU per request still compares"
            )
        if r["failed"]:
            notes.append(f"⚠ {r['label']}: {r['failed']:.0f} requests failed or were not 2xx")
        notes += [f"ERROR {r['label']}: {e}" for e in r["errors"]]
        cells = [
            r["label"],
            "HTTP/1.1" if r["proto"] == "h1" else "h2c",
            f"{fmt(r['rps'], ',.0f')}{flag}",
            fmt(r["proxy_pct"], ".0f"),
            fmt(r["us_per_request"], ".1f"),
            fmt(r["per_core"], ",.0f"),
            times(r["cpu_ratio"]),
            f"{fmt(r['p50_us'], '.0f')} / {fmt(r['p99_us'], '.0f')}",
            fmt(r["added_us"], "+.0f"),
            times(r["added_ratio"]),
            f"{fmt(r['backend_pct'], '.0f')} / {fmt(r['client_pct'], '.0f')}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", *notes]) if notes else "\n".join(lines)
