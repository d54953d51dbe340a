"""Measurements: the counters and histograms the core keeps, and their snapshot, read as data.

Pure like the rest of the core: no prometheus_client, no clock (times are ``ProxyCore.now``
differences), no I/O. The driver exports them (``muxproxy.trio.metrics``); tests read them.
Why here and not in prometheus_client: the per-token series are fed once per relayed SSE
chunk, where prometheus_client's multiprocess mode costs several microseconds a call; here
an observation is a ``bisect`` and two list updates (``docs/architecture.md``, "Metrics:
measured in the core, exported by the driver").

The parts, one job each: ``series.py`` names the series (types, labels, buckets), holds the
per-group record (``GroupStats``) and merges snapshots; ``ssemeter.py`` meters one SSE
response per chunk (events, first token, gaps: the rules are in its header); this module
keeps the per-request counters and takes a snapshot. It reads its owner through
``MeasuredCore``, the few things a snapshot needs, so it depends on no part of the proxy
but these two.

Invariants:

- Labels stay bounded (``series.py`` says what each label holds): nothing per session,
  request or path.
- Counters only grow. Per-exchange counts (requests, bytes, SSE events) are added to the
  totals when the exchange ends; ``snapshot`` adds those of the exchanges still running, so a
  scrape sees a long stream's events and bytes as they go, and totals never go back.
- Gauges are not kept: a snapshot reads them from the owner's state (connections, routers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sized
from typing import TYPE_CHECKING, Any, Protocol, cast

from muxproxy.core.observe.series import (
    COUNTER,
    DRIVER_MEASURED,
    DURATION_BUCKETS,
    GAUGE,
    GAUGE_MERGE,
    HEAD_BUCKETS,
    HISTOGRAM_ATTRS,
    INTER_TOKEN_BUCKETS,
    METRICS,
    PER_SERVER,
    PREFIX,
    SNAPSHOT_FORMAT,
    GroupStats,
    Histogram,
    Labels,
    TokenTimes,
    merge,
)
from muxproxy.core.observe.ssemeter import INSPECT_LIMIT, SseMeter, is_token_event

if TYPE_CHECKING:
    from muxproxy.config import Config, Upstream

# This module's own names, and those of series.py and ssemeter.py that were defined here
# before the split: imports of them from here (exchange.py's SseMeter) keep working.
__all__ = [
    "COUNTER",
    "DURATION_BUCKETS",
    "GAUGE",
    "HEAD_BUCKETS",
    "INSPECT_LIMIT",
    "INTER_TOKEN_BUCKETS",
    "GroupStats",
    "GroupStatus",
    "MeasuredCore",
    "Measurements",
    "RunningExchange",
    "SseMeter",
    "is_token_event",
    "merge",
]


class GroupStatus(Protocol):
    """What a snapshot reads of a group's routing state (``GroupRouter``)."""

    def status(self, now: float) -> Mapping[str, object]:
        """JSON-able; ``"servers"`` a list of dicts with ``address``, ``active``, ``state``
        ("up", "draining" or "down") and ``weight``."""
        ...


class RunningExchange(Protocol):
    """What a snapshot reads of an exchange still running (``Exchange``)."""

    @property
    def group(self) -> Upstream | None: ...
    @property
    def meter(self) -> SseMeter | None: ...
    @property
    def bytes_in(self) -> int: ...
    @property
    def bytes_out(self) -> int: ...


class MeasuredCore(Protocol):
    """What ``Measurements`` reads of its owner (``ProxyCore``), only when it takes a
    snapshot: the configured groups and their routers, the time, the open connections (how
    many), the exchanges still running and the plain counters."""

    @property
    def config(self) -> Config: ...
    @property
    def now(self) -> float: ...
    @property
    def counters(self) -> Mapping[str, int]: ...
    @property
    def clients(self) -> Sized: ...
    @property
    def upstreams(self) -> Sized: ...
    @property
    def exchanges(self) -> Mapping[int, RunningExchange]: ...
    @property
    def resumes(self) -> ResumeCounts: ...
    @property
    def sessions(self) -> SessionCounts: ...
    def router(self, group: Upstream) -> GroupStatus: ...


class SessionCounts(Protocol):
    """What ``Measurements`` reads of the shared memory of sessions (``SessionSharing``)."""

    shared: int
    learned: int
    store_errors: int


class ResumeCounts(Protocol):
    """What ``Measurements`` reads of the resumable streams (``resume.ResumeStore``)."""

    resumed: int
    refused: Mapping[str, int]
    store_errors: int

    held_bytes: int

    def states(self) -> Mapping[str, int]: ...


class Measurements:
    """The core's measurements; ``snapshot()`` turns them into JSON-able data.

    Fed by the exchanges (``exchange_finished``, ``retry``, ``failure``, per-group
    ``GroupStats``); gauges are read from the core's state when a snapshot is taken.
    """

    def __init__(self, core: MeasuredCore) -> None:
        self.core = core
        self.groups: dict[str, GroupStats] = {}
        self.requests: dict[Labels, int] = {}
        self.retries: dict[Labels, int] = {}
        self.failures: dict[Labels, int] = {}
        self.refusals: dict[Labels, int] = {}
        self.servers: dict[Labels, TokenTimes] = {}
        """(group, server) -> its token times: servers are configured or discovered."""
        self.fleet_reservations: dict[Labels, int] = {}
        """(outcome,) -> answers of the fleet store to budget reservations (``fleetadmit``)."""
        self.extension_errors: dict[Labels, int] = {}
        """(extension, hook) -> hooks that raised, timed out or answered wrong (``hooked.py``)."""
        self.extension_logged: dict[Labels, float] = {}
        """(extension, hook) -> when its last ``extension_error`` line was logged."""
        self.fleet_store_errors = 0
        """Operations on the fleet store's budgets that failed (counted by the driver)."""
        self.fleet_replicas = 0
        """The replicas the driver last saw in the fleet store (0: none asked yet)."""

    def group(self, name: str) -> GroupStats:
        stats = self.groups.get(name)
        if stats is None:
            stats = self.groups[name] = GroupStats()
        return stats

    def token_times(self, group: str, server: str) -> TokenTimes:
        """Where an SSE stream from ``server`` of ``group`` records its token times."""
        times = self.servers.get((group, server))
        if times is None:
            times = self.servers[(group, server)] = TokenTimes()
        return times

    def request(self, group: str, server: str, status: int, protocol: str, outcome: str) -> None:
        key = (group, server, str(status), protocol, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1

    def retry(self, group: str, reason: str) -> None:
        key = (group, reason)
        self.retries[key] = self.retries.get(key, 0) + 1

    def failure(self, group: str, server: str, kind: str) -> None:
        key = (group, server, kind)
        self.failures[key] = self.failures.get(key, 0) + 1

    def admission(self, group: str, reason: str) -> None:
        """A request the proxy refused itself, by ``reason`` (``exchange/refusal.py``)."""
        key = (group, reason)
        self.refusals[key] = self.refusals.get(key, 0) + 1

    def fleet_budget(self, outcome: str) -> None:
        """A fleet store's answer to a reservation: ``reserved``, ``refused`` or ``error``."""
        key = (outcome,)
        self.fleet_reservations[key] = self.fleet_reservations.get(key, 0) + 1

    # -- snapshot ----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Every metric, as ``{"format": 1, "metrics": {name: metric}}`` (names with
        ``PREFIX``), where a metric is ``{"type", "help", "labels": [names], "samples"}`` and
        for a gauge also ``"merge"`` ("sum", "min" or "max"), for a histogram ``"buckets"``
        (the upper bounds, without +Inf). A counter's or gauge's sample is ``[[label
        values], value]``; a histogram's ``[[label values], [count per bucket, +Inf last,
        not cumulative], sum]``. JSON-able; ``merge`` combines those of several workers."""
        core = self.core
        events: dict[str, int] = {}
        sent: dict[str, int] = {}
        received: dict[str, int] = {}
        gap_sums: dict[int, float] = {}
        for exchange in core.exchanges.values():
            # Still running: their counts so far (added to the totals when they end).
            name = exchange.group.name if exchange.group is not None else ""
            meter = exchange.meter
            if meter is not None:
                events[name] = events.get(name, 0) + meter.events
                fed = id(meter.stats)  # the server's ``TokenTimes`` it feeds
                gap_sums[fed] = gap_sums.get(fed, 0.0) + meter.gap_sum
            sent[name] = sent.get(name, 0) + exchange.bytes_out
            received[name] = received.get(name, 0) + exchange.bytes_in
        groups = self.groups
        names = sorted(set(groups) | set(events) | set(sent) | set(received))
        empty = GroupStats()

        def per_group(attr: str, live: Mapping[str, int]) -> list[Any]:
            return [
                [[g], getattr(groups.get(g, empty), attr) + live.get(g, 0)]
                for g in names
                if g in groups or live.get(g)
            ]

        def histograms(attr: str) -> list[Any]:
            out = []
            for g in sorted(groups):
                hist: Histogram = getattr(groups[g], attr)
                out.append([[g], list(hist.counts), hist.sum])
            return out

        def per_server(attr: str) -> list[Any]:
            out = []
            for labels, times in sorted(self.servers.items()):
                hist: Histogram = getattr(times, attr)
                live = gap_sums.get(id(times), 0.0) if attr == "inter_token" else 0.0
                out.append([list(labels), list(hist.counts), hist.sum + live])
            return out

        counters: dict[str, list[Any]] = {
            "requests_total": _samples(self.requests),
            "retries_total": _samples(self.retries),
            "upstream_failures_total": _samples(self.failures),
            "bytes_received_total": per_group("bytes_received", received),
            "bytes_sent_total": per_group("bytes_sent", sent),
            "sse_events_total": per_group("sse_events", events),
            "streams_without_token_total": per_group("streams_without_token", {}),
            "admissions_refused_total": _samples(self.refusals),
            "rate_limit_reserved_tokens_total": per_group("tokens_reserved", {}),
            "rate_limit_used_tokens_total": per_group("tokens_used", {}),
            "internal_errors_total": [[[], core.counters.get("internal_errors", 0)]],
            "resumes_total": [
                [["resumed"], core.resumes.resumed],
                *([[why], n] for why, n in sorted(core.resumes.refused.items())),
            ],
            "resume_store_errors_total": [[[], core.resumes.store_errors]],
            "fleet_budget_reservations_total": _samples(self.fleet_reservations),
            "fleet_budget_store_errors_total": [[[], self.fleet_store_errors]],
            "extension_errors_total": _samples(self.extension_errors),
            "sessions_shared_total": [[[], core.sessions.shared]],
            "sessions_learned_total": [[[], core.sessions.learned]],
            "sessions_store_errors_total": [[[], core.sessions.store_errors]],
            "defences_total": [
                [[kind], value]
                for kind, value in sorted(core.counters.items())
                if kind != "internal_errors"
            ],
        }
        active: list[Any] = []
        up: list[Any] = []
        weight: list[Any] = []
        load: list[Any] = []
        reported: dict[str, list[Any]] = {"running": [], "waiting": [], "kv_cache": []}
        queues: list[Any] = []
        reservations: list[Any] = []
        remembered: list[Any] = []
        for name, group in sorted(core.config.upstreams.items()):
            # What routing reports (``GroupRouter.status``): up unless unhealthy or set down
            # by the operator; the weight in force (the operator's or the configured one).
            status = core.router(group).status(core.now)
            servers = cast("list[dict[str, Any]]", status["servers"])
            for server in servers:
                labels = [name, server["address"]]
                active.append([labels, server["active"]])
                up.append([labels, 0 if server["state"] == "down" else 1])
                weight.append([labels, server["weight"]])
                load.append([labels, server["work"]])
                report = server["reported"]
                if report is not None and report["fresh"]:
                    for key, samples in reported.items():
                        if report[key] is not None:
                            samples.append([labels, report[key]])
            queue = cast("dict[str, int]", status["queue"])
            queues.append([[name], queue["waiting"]])
            remembered.append([[name], status["remembered_sessions"]])
            if name in groups:
                reservations.append([[name], groups[name].reservations])
        gauges: dict[str, list[Any]] = {
            "resumable_streams": [
                [[state], n] for state, n in sorted(core.resumes.states().items())
            ],
            "resumable_bytes": [[[], core.resumes.held_bytes]],
            "fleet_replicas": [[[], self.fleet_replicas]] if self.fleet_replicas else [],
            "sessions_remembered": remembered,
            "queue_length": queues,
            "rate_limit_reservations": reservations,
            "server_load_tokens": load,
            "server_reported_running": reported["running"],
            "server_reported_waiting": reported["waiting"],
            "server_reported_kv_cache": reported["kv_cache"],
            "active_streams": active,
            "client_connections": [[[], len(core.clients)]],
            "upstream_connections": [[[], len(core.upstreams)]],
            "server_up": up,
            "server_weight": weight,
        }
        metrics: dict[str, Any] = {}
        for name, (kind, label_names, help_text) in METRICS.items():
            metric: dict[str, Any] = {
                "type": kind,
                "help": help_text,
                "labels": list(label_names),
            }
            if kind == COUNTER:
                metric["samples"] = counters[name]
            elif kind == GAUGE:
                metric["merge"] = GAUGE_MERGE.get(name, "sum")
                metric["samples"] = [] if name in DRIVER_MEASURED else gauges[name]
            else:
                attr = HISTOGRAM_ATTRS[name]
                source = TokenTimes() if name in PER_SERVER else empty
                metric["buckets"] = list(getattr(source, attr).bounds)
                metric["samples"] = (per_server if name in PER_SERVER else histograms)(attr)
            metrics[PREFIX + name] = metric
        return {"format": SNAPSHOT_FORMAT, "metrics": metrics}


def _samples(counts: Mapping[Labels, int]) -> list[Any]:
    return [[list(labels), value] for labels, value in sorted(counts.items())]
