"""Measurements: plain counters and fixed-bucket histograms the core keeps, read as data.

Pure like the rest of the core: no prometheus_client, no clock (times are ``ProxyCore.now``
differences), no I/O. The driver exports them (``muxproxy.trio.metrics``); tests read them.
Why here and not in prometheus_client: the per-token series are fed once per relayed SSE
chunk, where prometheus_client's multiprocess mode costs several microseconds a call; here
an observation is a ``bisect`` and two list updates (``docs/architecture.md``, "Metrics:
measured in the core, exported by the driver").

Invariants:

- Labels stay bounded: ``group`` is a configured group name ("" when no route matched),
  ``server`` a configured server address ("" when no server was tried), ``status`` the
  status sent to the client as a number ("0" when none was: the client left first),
  ``protocol`` the client's HTTP version ("1.0", "1.1", "2"), ``reason``/``kind`` a retry
  condition of the configuration (``error``, ``timeout``, ``http_NNN``) or
  ``stale_connection`` / ``mid_stream``. Nothing per session, request or path.
- Nothing on the per-chunk path allocates or builds a dict: a stream's ``SseMeter`` holds
  its group's ``GroupStats`` and histograms once, and a chunk costs a ``bytes.count`` of one
  byte, an ``endswith`` and, when it completed an event, one bucket increment.
- Counters only grow. Per-exchange counts (requests, bytes, SSE events) are added to the
  totals when the exchange ends; ``snapshot`` adds those of the exchanges still running, so a
  scrape sees a long stream's events and bytes as they go, and totals never go back.

SSE events (WHATWG HTML §9.2.6). An event ends at an empty line: two line ends in a row.
Lines end with LF, CRLF or CR; a stream's line end is taken from its first line (the first
CR or LF seen, a CR followed by LF being CRLF), and its events are counted as occurrences of
that line end twice (``\\n\\n``, ``\\r\\n\\r\\n``, ``\\r\\r``), also when the two halves come in
different chunks. A stream that mixes line ends (the specification allows it; no server
does) is counted by its first one. Comment-only blocks (``: ping``) count as events too.

Tokens. Time to first token is measured to the chunk that completed the first event that
carries a token, not to the first byte. Only events up to that one are inspected, by byte
patterns (``TOKEN_FIELD`` and friends, compiled once; never a JSON parse); after it events
are only counted. An event carries a token unless:

1. it has no ``data:`` line (a comment, ``event:``, ``id:`` or ``retry:`` lines only); or
2. its data is ``[DONE]`` (the OpenAI end marker); or
3. its data is a JSON object (``data:`` then optional spaces then ``{``) in which none of the
   fields ``content``, ``reasoning_content``, ``reasoning``, ``text``, ``tool_calls``,
   ``token`` has a non-empty value (a non-empty string, array or object, or a number/literal
   other than ``null``). So an OpenAI role-only first chunk
   (``{"choices":[{"delta":{"role":"assistant","content":""}}]}``), a finish chunk with an
   empty delta, a usage chunk and an error object are not tokens; an OpenAI content or tool
   call delta, a completions ``text``, a vLLM ``reasoning_content`` delta, TGI's ``token``
   and Anthropic's ``text_delta`` are.

Any other data (plain text) is a token. The patterns look at field names, so a token whose
text is the string ``"content":""`` escaped inside another value cannot fool them (its quotes
are escaped ``\\"``). An event larger than ``INSPECT_LIMIT`` without an end is taken as a
token (the inspection buffer stays bounded).

Inter-token gaps: after the first token, every backend chunk that completes at least one
event adds one observation, the time since the previous such chunk (events that arrive in
one read were produced together as far as the proxy can tell).
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from .proxy import ProxyCore

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

INSPECT_LIMIT = 64 * 1024
"""Most bytes of not-yet-complete events held to classify them, before the first token."""

_CR = 0x0D
_LF = 0x0A

TOKEN_FIELD = re.compile(
    rb'"(?:content|reasoning_content|reasoning|text|tool_calls|token)"\s*:\s*'
    rb'(?:"[^"]|\[\s*[^\]\s]|\{\s*[^}\s]|[-0-9tf])'
)
"""A token-carrying field with a non-empty value (see the module's rules)."""
_JSON_DATA = re.compile(rb"(?:\A|[\r\n])data: ?\s*\{")
_DATA_LINE = re.compile(rb"(?:\A|[\r\n])data:")
_DONE = re.compile(rb"(?:\A|[\r\n])data: ?\[DONE\]\s*\Z")


def is_token_event(event: bytes) -> bool:
    """Whether one SSE event (its bytes up to, not including, the empty line) carries a
    token, by the module's rules."""
    if _DATA_LINE.search(event) is None:
        return False
    if _DONE.search(event) is not None:
        return False
    if TOKEN_FIELD.search(event) is not None:
        return True
    return _JSON_DATA.search(event) is None


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


class GroupStats:
    """What is measured per group (label ``group``), in one object an exchange holds."""

    __slots__ = (
        "bytes_received",
        "bytes_sent",
        "inter_token",
        "response_head",
        "sse_events",
        "stream_duration",
        "streams_without_token",
        "ttft",
    )

    def __init__(self) -> None:
        self.bytes_received = 0
        self.bytes_sent = 0
        self.sse_events = 0
        self.streams_without_token = 0
        self.response_head = Histogram(HEAD_BUCKETS)
        self.ttft = Histogram(HEAD_BUCKETS)
        self.inter_token = Histogram(INTER_TOKEN_BUCKETS)
        self.stream_duration = Histogram(DURATION_BUCKETS)


class SseMeter:
    """One SSE response's events, first token and gaps (see the module's rules)."""

    __slots__ = (
        "bounds",
        "buffer",
        "carry",
        "events",
        "first_token_at",
        "gaps",
        "last",
        "last_event_at",
        "partials",
        "sep",
        "started",
        "stats",
    )

    def __init__(self, stats: GroupStats, started: float) -> None:
        self.stats = stats
        hist = stats.inter_token
        self.bounds = hist.bounds
        self.gaps = hist.counts
        """The group's inter-token bucket counts, fed in place. Their sum is not added per
        chunk: a stream's gaps add up to ``last_event_at - first_token_at``, which
        ``gap_sum`` gives when the stream ends (and ``snapshot`` while it runs)."""
        self.started = started
        """When the request head came: time to first token counts from here."""
        self.sep = b""
        """Two line ends: the stream's event terminator; empty until its first line end."""
        self.last = _LF
        """``sep``'s last byte: LF, or CR for a stream of CR line ends."""
        self.partials: tuple[bytes, ...] = ()
        """``sep``'s proper prefixes, longest last: what a chunk can end in mid-terminator."""
        self.carry = 0
        """How many bytes of ``sep`` the last chunk ended with (0: none)."""
        self.buffer = b""
        """Before the first token: the bytes of events not yet complete."""
        self.events = 0
        self.first_token_at: float | None = None
        self.last_event_at = 0.0

    def feed(self, data: bytes, now: float) -> None:
        """One chunk of the response body, as the backend sent it."""
        if self.first_token_at is None:
            self._inspect(data, now)
            return
        # The counting path, once per chunk: a few C calls and no allocation (but for a
        # chunk after one that ended mid-terminator, which is rare).
        if self.carry:
            data = self.partials[self.carry] + data
            self.carry = 0
        sep = self.sep
        # Counting one byte is a simpler loop than searching for two or four: a chunk with
        # fewer than two of the terminator's last byte holds no terminator, and one with
        # exactly two that ends with the terminator holds just that one (the common case,
        # one event per read). Only other chunks are searched.
        ends = data.count(self.last)
        if ends < 2:
            n = 0
            self.carry = _carry(data, self.partials)
        elif ends == 2 and data.endswith(sep):
            n = 1
        else:
            n = data.count(sep)
            if not data.endswith(sep):
                self.carry = _carry(data, self.partials)
        if n:
            self.events += n
            self.gaps[bisect_left(self.bounds, now - self.last_event_at)] += 1
            self.last_event_at = now

    @property
    def gap_sum(self) -> float:
        """The sum of the inter-token gaps observed so far."""
        if self.first_token_at is None:
            return 0.0
        return self.last_event_at - self.first_token_at

    def _inspect(self, data: bytes, now: float) -> None:
        """Before the first token: split the events out and classify each."""
        buffer = self.buffer + data
        if not self.sep:
            sep = _terminator(buffer)
            if sep is None and len(buffer) <= INSPECT_LIMIT:
                self.buffer = buffer
                return
            # None here: no line end in the first ``INSPECT_LIMIT`` bytes, not an SSE
            # stream anyone writes; counted as LF from here on.
            self._set_terminator(sep or b"\n\n")
        sep = self.sep
        start = 0
        while True:
            end = buffer.find(sep, start)
            if end < 0:
                break
            self.events += 1
            token = is_token_event(buffer[start:end])
            start = end + len(sep)
            if token:
                self._token(now)
                rest = buffer[start:]
                self.events += rest.count(sep)
                self.carry = 0 if rest.endswith(sep) else _carry(rest, self.partials)
                self.buffer = b""
                return
        self.buffer = buffer[start:]
        if len(self.buffer) > INSPECT_LIMIT:
            # Bounded: an event this large is not a role-only chunk.
            self.carry = _carry(self.buffer, self.partials)
            self.buffer = b""
            self._token(now)

    def _set_terminator(self, sep: bytes) -> None:
        self.sep = sep
        self.last = sep[-1]
        self.partials = tuple(sep[:k] for k in range(len(sep)))

    def _token(self, now: float) -> None:
        self.first_token_at = now
        self.last_event_at = now
        self.stats.ttft.observe(now - self.started)


def _terminator(data: bytes) -> bytes | None:
    """The event terminator of a stream starting with ``data``; None while no line end is
    known (no CR or LF yet, or a CR as the last byte, which may be the start of a CRLF)."""
    lf = data.find(b"\n")
    cr = data.find(b"\r")
    if cr < 0:
        return None if lf < 0 else b"\n\n"
    if 0 <= lf < cr:
        return b"\n\n"
    if cr + 1 == len(data):
        return None
    return b"\r\n\r\n" if data[cr + 1] == _LF else b"\r\r"


def _carry(data: bytes, partials: tuple[bytes, ...]) -> int:
    """The longest proper prefix of the terminator that ``data`` ends with (its length)."""
    if not data or (data[-1] != _LF and data[-1] != _CR):
        return 0
    for k in range(len(partials) - 1, 0, -1):
        if data.endswith(partials[k]):
            return k
    return 0


# -- the metrics, as exported ---------------------------------------------------------------

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"

METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "requests_total": (COUNTER, ("group", "server", "status", "protocol"), "Requests answered"),
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
        ("group",),
        "Seconds from the request head to the first SSE event carrying a token",
    ),
    "inter_token_seconds": (
        HISTOGRAM,
        ("group",),
        "Seconds between backend reads that completed SSE events, after the first token",
    ),
    "stream_duration_seconds": (
        HISTOGRAM,
        ("group",),
        "Seconds from the request head to the end of an SSE response",
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
}
"""Name (without ``PREFIX``) -> (type, label names, help)."""

GAUGE_MERGE = {"server_up": "min", "server_weight": "max"}
"""How a gauge merges across workers when it is not summed: ``server_up`` is 1 only where
every worker can use the server (health is judged per worker); ``server_weight`` is the same
in every worker (runtime state is applied to all), ``max`` hides a moment between updates."""

SNAPSHOT_FORMAT = 1

_Labels = tuple[str, ...]


class Measurements:
    """The core's measurements; ``snapshot()`` turns them into JSON-able data.

    Fed by the exchanges (``exchange_finished``, ``retry``, ``failure``, per-group
    ``GroupStats``); gauges are read from the core's state when a snapshot is taken.
    """

    def __init__(self, core: ProxyCore) -> None:
        self.core = core
        self.groups: dict[str, GroupStats] = {}
        self.requests: dict[_Labels, int] = {}
        self.retries: dict[_Labels, int] = {}
        self.failures: dict[_Labels, int] = {}

    def group(self, name: str) -> GroupStats:
        stats = self.groups.get(name)
        if stats is None:
            stats = self.groups[name] = GroupStats()
        return stats

    def request(self, group: str, server: str, status: int, protocol: str) -> None:
        key = (group, server, str(status), protocol)
        self.requests[key] = self.requests.get(key, 0) + 1

    def retry(self, group: str, reason: str) -> None:
        key = (group, reason)
        self.retries[key] = self.retries.get(key, 0) + 1

    def failure(self, group: str, server: str, kind: str) -> None:
        key = (group, server, kind)
        self.failures[key] = self.failures.get(key, 0) + 1

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
        gap_sums: dict[str, float] = {}
        for exchange in core.exchanges.values():
            # Still running: their counts so far (added to the totals when they end).
            name = exchange.group.name if exchange.group is not None else ""
            meter = exchange.meter
            if meter is not None:
                events[name] = events.get(name, 0) + meter.events
                gap_sums[name] = gap_sums.get(name, 0.0) + meter.gap_sum
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
                total = hist.sum + (gap_sums.get(g, 0.0) if attr == "inter_token" else 0.0)
                out.append([[g], list(hist.counts), total])
            return out

        counters: dict[str, list[Any]] = {
            "requests_total": _samples(self.requests),
            "retries_total": _samples(self.retries),
            "upstream_failures_total": _samples(self.failures),
            "bytes_received_total": per_group("bytes_received", received),
            "bytes_sent_total": per_group("bytes_sent", sent),
            "sse_events_total": per_group("sse_events", events),
            "streams_without_token_total": per_group("streams_without_token", {}),
            "internal_errors_total": [[[], core.counters.get("internal_errors", 0)]],
            "defences_total": [
                [[kind], value]
                for kind, value in sorted(core.counters.items())
                if kind != "internal_errors"
            ],
        }
        active: list[Any] = []
        up: list[Any] = []
        weight: list[Any] = []
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
        gauges: dict[str, list[Any]] = {
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
                metric["samples"] = gauges[name]
            else:
                attr = _HISTOGRAM_ATTRS[name]
                metric["buckets"] = list(getattr(empty, attr).bounds)
                metric["samples"] = histograms(attr)
            metrics[PREFIX + name] = metric
        return {"format": SNAPSHOT_FORMAT, "metrics": metrics}


_HISTOGRAM_ATTRS = {
    "response_head_seconds": "response_head",
    "time_to_first_token_seconds": "ttft",
    "inter_token_seconds": "inter_token",
    "stream_duration_seconds": "stream_duration",
}


def _samples(counts: Mapping[_Labels, int]) -> list[Any]:
    return [[list(labels), value] for labels, value in sorted(counts.items())]


def merge(snapshots: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One snapshot from several (one per worker): counters, histograms and most gauges
    summed per label set, ``server_up`` / ``server_weight`` by their ``merge`` (min, max).

    Raises ``ValueError`` naming the metric when two snapshots disagree on its type, labels
    or buckets, or a snapshot is not of this format."""
    merged: dict[str, dict[str, Any]] = {}
    values: dict[str, dict[_Labels, Any]] = {}
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


def _merge_samples(into: dict[_Labels, Any], metric: Mapping[str, Any], name: str) -> None:
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
