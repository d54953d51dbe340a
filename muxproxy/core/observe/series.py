"""The measured series: their names, types, labels and buckets, the per-group record the
exchanges feed, and the snapshot format with its merge across workers.

Data only, like the rest of the core: no prometheus_client, no clock, no I/O. What fills these
records is elsewhere (``ssemeter.py`` per SSE chunk, ``measure.py`` per exchange and per
snapshot); the driver renders merged snapshots (``muxproxy.trio.metrics``).

Invariants:

- Labels stay bounded: ``group`` is a configured group name ("" when no route matched),
  ``server`` a configured or discovered server address ("" when no server was tried; never
  anything a request chose), ``status`` the
  status sent to the client as a number ("0" when none was: the client left first),
  ``protocol`` the client's HTTP version ("1.0", "1.1", "2"), ``outcome`` "complete" or
  "cut" (a status says how a response began, not whether it ended), ``reason``/``kind`` a retry
  condition of the configuration (``error``, ``timeout``, ``http_NNN``) or
  ``stale_connection`` / ``mid_stream``. Nothing per session, request or path.
- Buckets are fixed per series (``HEAD_BUCKETS`` and friends): every worker has the same, so
  snapshots merge by adding bucket counts; ``merge`` refuses snapshots that disagree.
- A histogram's buckets are not cumulative (``Histogram.counts``); the Prometheus
  exposition makes them so.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

PREFIX = "muxproxy_"

HEAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Seconds to the response head and to the first token: a prefill of a few ms to a queued
long-context request of a minute (``timeouts.response_head`` defaults to 60 s)."""
INTER_TOKEN_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.035,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
"""Seconds between events: decode steps take 5-50 ms; the top buckets catch stalls."""
DURATION_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
"""Seconds a stream lasts, from the request head to its end."""


class Histogram:
    """Fixed buckets: ``counts[i]`` observations ``<= bounds[i]`` and above the bound before
    (not cumulative; the last entry is above every bound, Prometheus's ``+Inf``)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # Prometheus buckets are "less than or equal" (le): the first bound >= value.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class TokenTimes:
    """Time to first token and the gaps between tokens, per server (labels ``group`` and
    ``server``): one object an SSE stream's meter holds and feeds in place."""

    __slots__ = ("inter_token", "ttft")

    def __init__(self) -> None:
        self.ttft = Histogram(HEAD_BUCKETS)
        self.inter_token = Histogram(INTER_TOKEN_BUCKETS)


class GroupStats:
    """What is measured per group (label ``group``), in one object an exchange holds."""

    __slots__ = (
        "bytes_received",
        "bytes_sent",
        "queue_wait",
        "reservations",
        "response_head",
        "sse_events",
        "stream_duration",
        "streams_without_token",
        "tokens_reserved",
        "tokens_used",
    )

    def __init__(self) -> None:
        self.bytes_received = 0
        self.bytes_sent = 0
        self.sse_events = 0
        self.streams_without_token = 0
        self.response_head = Histogram(HEAD_BUCKETS)
        self.stream_duration = Histogram(DURATION_BUCKETS)
        self.queue_wait = Histogram(HEAD_BUCKETS)
        self.reservations = 0
        """Budget reservations not yet settled (a gauge, kept here as the exchanges move it)."""
        self.tokens_reserved = 0
        self.tokens_used = 0


# -- the metrics, as exported ---------------------------------------------------------------

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"

METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "requests_total": (
        COUNTER,
        ("group", "server", "status", "protocol", "outcome"),
        "Requests answered; outcome: complete, or cut (the client did not get the whole"
        " response: a backend that failed mid-stream, a client that left, a stop's deadline)",
    ),
    "retries_total": (COUNTER, ("group", "reason"), "Requests sent again to another attempt"),
    "upstream_failures_total": (
        COUNTER,
        ("group", "server", "kind"),
        "Backend attempts that failed (connection error, timeout, retried status, mid-stream)",
    ),
    "bytes_received_total": (COUNTER, ("group",), "Request body bytes received from clients"),
    "bytes_sent_total": (COUNTER, ("group",), "Response body bytes sent to clients"),
    "sse_events_total": (COUNTER, ("group",), "SSE events relayed from backends"),
    "streams_without_token_total": (
        COUNTER,
        ("group",),
        "SSE responses that ended without an event carrying a token",
    ),
    "internal_errors_total": (COUNTER, (), "Connections ended by a bug in muxproxy"),
    "defences_total": (COUNTER, ("kind",), "Defensive actions against misbehaving clients"),
    "response_head_seconds": (
        HISTOGRAM,
        ("group",),
        "Seconds from the request head to the backend's response head",
    ),
    "time_to_first_token_seconds": (
        HISTOGRAM,
        ("group", "server"),
        "Seconds from the request head to the first SSE event carrying a token",
    ),
    "inter_token_seconds": (
        HISTOGRAM,
        ("group", "server"),
        "Seconds between backend reads that completed SSE events, after the first token",
    ),
    "stream_duration_seconds": (
        HISTOGRAM,
        ("group",),
        "Seconds from the request head to the end of an SSE response",
    ),
    "queue_wait_seconds": (
        HISTOGRAM,
        ("group",),
        "Seconds requests waited in the admission queue (admitted, timed out or gone)",
    ),
    "admissions_refused_total": (
        COUNTER,
        ("group", "reason"),
        "Requests the proxy refused itself, by reason (x-muxproxy-reason: queue_full,"
        " queue_timeout, rate_limited, budget, no_server)",
    ),
    "rate_limit_reserved_tokens_total": (
        COUNTER,
        ("group",),
        "Tokens reserved from tenants' budgets on admission",
    ),
    "rate_limit_used_tokens_total": (
        COUNTER,
        ("group",),
        "Tokens charged to tenants' budgets once their requests ended (the real usage)",
    ),
    "rate_limit_reservations": (GAUGE, ("group",), "Budget reservations not yet settled"),
    "resumes_total": (
        COUNTER,
        ("result",),
        "Requests with Last-Event-ID for a stream of ours: resumed, or refused by reason"
        " (unknown, evicted, invalid, unavailable)",
    ),
    "resume_store_errors_total": (
        COUNTER,
        (),
        "Appends to and reads of the shared resume store (Redis) that failed or were dropped",
    ),
    "fleet_budget_reservations_total": (
        COUNTER,
        ("outcome",),
        "Budget reservations asked of the fleet store, by its answer (reserved, refused, error:"
        " the store failed and on_store_error decided)",
    ),
    "fleet_budget_store_errors_total": (
        COUNTER,
        (),
        "Operations on the fleet store's budgets that failed or timed out (reservations,"
        " settles, lease renewals, the replica's announcements)",
    ),
    "extension_errors_total": (
        COUNTER,
        ("extension", "hook"),
        "Extension hooks that raised, timed out or answered what they may not (the request"
        " then followed the extension's on_error)",
    ),
    "fleet_replicas": (
        GAUGE,
        (),
        "Replicas (processes admitting requests) seen in the fleet store at the last heartbeat",
    ),
    "sessions_shared_total": (
        COUNTER,
        (),
        "Sessions remembered here and handed out to the other workers and replicas",
    ),
    "sessions_learned_total": (
        COUNTER,
        (),
        "Sessions remembered by another worker or replica and taken into this memory",
    ),
    "sessions_store_errors_total": (
        COUNTER,
        (),
        "Writes, reads and subscriptions of the shared session memory in the fleet store"
        " (Redis) that failed, and batches dropped while it was down",
    ),
    "sessions_remembered": (
        GAUGE,
        ("group",),
        "Session keys remembered with the server they were last sent to",
    ),
    "resumable_streams": (
        GAUGE,
        ("state",),
        "Resumable SSE streams kept: read by a client, lingering (nobody reads, backend"
        " running) or ended (events kept for linger)",
    ),
    "resumable_bytes": (GAUGE, (), "Memory held by resumable streams' kept events (bytes)"),
    "queue_length": (GAUGE, ("group",), "Requests waiting in the admission queue"),
    "server_load_tokens": (
        GAUGE,
        ("group", "server"),
        "Tokens the proxy's streams on the server are still expected to generate",
    ),
    "server_reported_running": (
        GAUGE,
        ("group", "server"),
        "Requests the engine reports running (fresh load reports only)",
    ),
    "server_reported_waiting": (
        GAUGE,
        ("group", "server"),
        "Requests the engine reports waiting in its own queue (fresh load reports only)",
    ),
    "server_reported_kv_cache": (
        GAUGE,
        ("group", "server"),
        "The engine's reported KV-cache usage, 0..1 (fresh load reports only)",
    ),
    "active_streams": (GAUGE, ("group", "server"), "Requests in flight per server"),
    "client_connections": (GAUGE, (), "Open client connections"),
    "upstream_connections": (GAUGE, (), "Open backend connections"),
    "server_up": (
        GAUGE,
        ("group", "server"),
        "1 unless the server is unhealthy or set down (a draining server is up)",
    ),
    "server_weight": (GAUGE, ("group", "server"), "The server's current weight"),
    "fleet_store_up": (
        GAUGE,
        (),
        "1 while the fleet store ([fleet] store) answers, 0 while it cannot be reached",
    ),
    "fleet_sync_age_seconds": (
        GAUGE,
        (),
        "Seconds since the runtime state last agreed with the fleet store",
    ),
    "fleet_state_version": (GAUGE, (), "Version of the fleet's runtime state applied here"),
}
"""Name (without ``PREFIX``) -> (type, label names, help)."""
DRIVER_MEASURED = frozenset({"fleet_store_up", "fleet_sync_age_seconds", "fleet_state_version"})
"""Gauges the driver measures, not the core (the fleet store's sync, one per replica): a
core's snapshot has no samples of them, the replica's ``/metrics`` adds its own."""

DISCOVERY_METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "discovery_lookups_total": (
        COUNTER,
        ("group", "result"),
        "DNS lookups of a discovering group; result: ok, empty, nxdomain, timeout, error",
    ),
    "discovery_servers": (GAUGE, ("group",), "Servers in a discovering group's last good set"),
    "discovery_last_success_age_seconds": (
        GAUGE,
        ("group",),
        "Seconds since a discovering group's last good lookup",
    ),
}
"""Discovery's metrics (``trio/discovery.py``), as :data:`METRICS`: measured where the lookups
run (the process, or the supervisor of ``--workers``), not in the core."""

HISTOGRAM_ATTRS = {
    "response_head_seconds": "response_head",
    "time_to_first_token_seconds": "ttft",
    "inter_token_seconds": "inter_token",
    "stream_duration_seconds": "stream_duration",
    "queue_wait_seconds": "queue_wait",
}
"""A histogram metric's name -> the ``GroupStats`` attribute that holds it (the
``TokenTimes`` one for the per-server histograms, :data:`PER_SERVER`)."""
PER_SERVER = frozenset({"time_to_first_token_seconds", "inter_token_seconds"})
"""Histograms kept per server (``TokenTimes``): a new release on one server shows in them."""

GAUGE_MERGE = {
    "fleet_replicas": "max",
    "sessions_remembered": "max",
    "server_up": "min",
    "server_weight": "max",
    "server_reported_running": "max",
    "server_reported_waiting": "max",
    "server_reported_kv_cache": "max",
}
"""How a gauge merges across workers when it is not summed: ``server_up`` is 1 only where
every worker can use the server (health is judged per worker); ``server_weight`` is the same
in every worker (runtime state is applied to all), ``max`` hides a moment between updates;
an engine's reports are the same engine's whichever worker polled it (``max``: the latest
of them, near enough, rather than a sum that would count the engine once per worker);
``sessions_remembered``: every worker holds the host's memory (its own keys and those the
supervisor relays), so a sum would count each key once per worker."""

SNAPSHOT_FORMAT = 1

Labels = tuple[str, ...]


def merge(snapshots: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One snapshot from several (one per worker): counters, histograms and most gauges
    summed per label set, ``server_up`` / ``server_weight`` by their ``merge`` (min, max).

    Raises ``ValueError`` naming the metric when two snapshots disagree on its type, labels
    or buckets, or a snapshot is not of this format."""
    merged: dict[str, dict[str, Any]] = {}
    values: dict[str, dict[Labels, Any]] = {}
    for snapshot in snapshots:
        if snapshot.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(
                f"metrics snapshot: format {snapshot.get('format')!r}, expected {SNAPSHOT_FORMAT}"
            )
        for name, metric in snapshot["metrics"].items():
            into = merged.get(name)
            if into is None:
                into = merged[name] = {k: v for k, v in metric.items() if k != "samples"}
                values[name] = {}
            else:
                for key in ("type", "labels", "buckets", "merge"):
                    if into.get(key) != metric.get(key):
                        raise ValueError(f"metrics snapshot: {name}: {key} differs between workers")
            _merge_samples(values[name], metric, name)
    out: dict[str, Any] = {}
    for name, metric in merged.items():
        if metric["type"] == HISTOGRAM:
            samples = [[list(k), v[0], v[1]] for k, v in sorted(values[name].items())]
        else:
            samples = [[list(k), v] for k, v in sorted(values[name].items())]
        out[name] = {**metric, "samples": samples}
    return {"format": SNAPSHOT_FORMAT, "metrics": out}


def _merge_samples(into: dict[Labels, Any], metric: Mapping[str, Any], name: str) -> None:
    kind = metric["type"]
    how = metric.get("merge", "sum")
    for sample in metric["samples"]:
        labels = tuple(sample[0])
        if len(labels) != len(metric["labels"]):
            raise ValueError(f"metrics snapshot: {name}: a sample has the wrong label count")
        if kind == HISTOGRAM:
            counts, total = sample[1], sample[2]
            if len(counts) != len(metric["buckets"]) + 1:
                raise ValueError(f"metrics snapshot: {name}: a sample has the wrong bucket count")
            have = into.get(labels)
            if have is None:
                into[labels] = (list(counts), total)
            else:
                into[labels] = (
                    [a + b for a, b in zip(have[0], counts, strict=True)],
                    have[1] + total,
                )
            continue
        value = sample[1]
        have = into.get(labels)
        if have is None:
            into[labels] = value
        elif how == "min":
            into[labels] = min(have, value)
        elif how == "max":
            into[labels] = max(have, value)
        else:
            into[labels] = have + value
