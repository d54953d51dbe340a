"""The access record of an exchange and its share of the totals, request ids, the session hash.

Request ids (the ``X-Request-ID`` field, a de facto standard shared by nginx, Heroku and most
tracing setups): a client's id is kept when it is sane — one field, 1 to ``MAX_REQUEST_ID``
bytes of ``[A-Za-z0-9._:-]`` (UUIDs, W3C trace ids, nginx's ``$request_id`` and ours fit;
nothing a log line, a header, a shell or a log query could be split or fooled by) — and
replaced otherwise, with a ``request_id_replaced`` log record that holds what the client
sent, truncated and escaped (``escaped_id``); a request without one gets one. Generated ids
are ``<prefix>-<counter>``: the prefix is 12 hex digits from ``os.urandom`` read once when
the ``ProxyCore`` is built (the core reads no clock and uses no ``random``; this is its one
read of the OS, at construction), the counter counts the process's requests. So ids are
unique within a process, and across workers and restarts with the probability of two 48-bit
random prefixes differing. The id goes to the backend and back to the client in
``X-Request-ID``, and into every log record of the exchange.

The session field is a short hash of the session key (``blake2b``, 8 bytes, as 16 hex
digits), personalised for muxproxy: logs can correlate the requests of one conversation
without holding the cookie, header or body value the key came from.

With ``[telemetry]`` configured, the backend's request also gets the proxy's
``traceparent`` (``backend_ids``, ``tracecontext.py``) and the record four more fields:
``trace_id``, ``span_id``, ``parent_span_id`` and ``trace_sampled``, from which the driver
exports the exchange's span (``muxproxy/trio/telemetry.py``). Without it neither is looked at
beyond one attribute per request.

The record (and what the exchange adds to the totals of ``measure.py``) is read from a
finished exchange through ``Finished``, the fields it needs and no more, so this module imports
no part of the proxy (``Exchange`` has them by its shape).
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any, Protocol

from muxproxy.core.commands import Log
from muxproxy.core.http.headers import header_value
from muxproxy.core.observe.tracecontext import TraceContext, trace_context, with_traceparent

if TYPE_CHECKING:
    from muxproxy.config import Config, Upstream
    from muxproxy.core.messages import Headers, RequestHead
    from muxproxy.core.observe.measure import Measurements
    from muxproxy.core.observe.ssemeter import SseMeter

MAX_REQUEST_ID = 128
"""Longest client request id kept: UUIDs (36), trace ids (32-55) and nginx's $request_id
(32) fit with room to spare; a longer one is replaced, not truncated (a truncated id would
match nothing upstream)."""
LOGGED_ID = 64
"""Bytes of a replaced client id the log record shows (escaped), at most."""

REQUEST_ID = b"x-request-id"


class RequestIds:
    """Request ids for one process (see the module)."""

    __slots__ = ("count", "prefix")

    def __init__(self, prefix: bytes | None = None) -> None:
        """``prefix``: the random part (tests); default 12 hex digits from ``os.urandom``."""
        self.prefix = prefix if prefix is not None else os.urandom(6).hex().encode("ascii")
        self.count = 0

    def new(self) -> bytes:
        self.count += 1
        return b"%s-%d" % (self.prefix, self.count)

    def for_request(self, headers: Headers, log: _Log | None = None, client: str = "") -> bytes:
        """The client's id if it sent exactly one sane one, otherwise a new one; a client's
        id replaced is logged (``request_id_replaced``) through ``log``, with the address
        of the ``client``."""
        value = header_value(headers, REQUEST_ID)
        if value is None:
            return self.new()
        if is_sane_id(value) and sum(1 for name, _ in headers if name == REQUEST_ID) == 1:
            return value
        ours = self.new()
        if log is not None:
            fields = {
                "request_id": ours.decode("ascii"),
                "client_request_id": escaped_id(value),
                "client": client,
            }
            log.emit(Log(event="request_id_replaced", fields=fields))
        return ours


def is_sane_id(value: bytes) -> bool:
    """1 to ``MAX_REQUEST_ID`` bytes, each of ``[A-Za-z0-9._:-]``."""
    if not 0 < len(value) <= MAX_REQUEST_ID:
        return False
    # Deleting every allowed byte leaves nothing.
    return not value.translate(None, _ID_BYTES)


_ID_BYTES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-"


def escaped_id(value: bytes) -> str:
    """A client's id for a log record: its first ``LOGGED_ID`` bytes, each byte outside
    ``[A-Za-z0-9._:-]`` as ``\\xNN`` (so no byte of it can end or forge a line), then
    ``...(N bytes)`` when it was longer."""
    shown = "".join(
        chr(byte) if byte in _ID_BYTES else f"\\x{byte:02x}" for byte in value[:LOGGED_ID]
    )
    if len(value) > LOGGED_ID:
        shown += f"...({len(value)} bytes)"
    return shown


def with_request_id(headers: Headers, request_id: bytes) -> Headers:
    """``headers`` with ``request_id`` as its one X-Request-ID."""
    out = [field for field in headers if field[0] != REQUEST_ID]
    out.append((REQUEST_ID, request_id))
    return out


def session_hash(key: bytes | None) -> str | None:
    """The session field of the access record: 16 hex digits, None without a key."""
    if key is None:
        return None
    return hashlib.blake2b(key, digest_size=8, person=b"muxproxy-sess").hexdigest()


def _seconds(at: float | None, start: float) -> float | None:
    return None if at is None else round(at - start, 6)


class _Log(Protocol):
    def emit(self, command: Log) -> None: ...


class _Clock(Protocol):
    @property
    def now(self) -> float: ...
    @property
    def config(self) -> Config: ...


class _Ids(Protocol):
    @property
    def request_ids(self) -> RequestIds: ...


class Traced(Protocol):
    """What the trace context of an exchange is derived from (``tracecontext.py``)."""

    @property
    def fx(self) -> _Clock: ...
    @property
    def host(self) -> _Ids: ...
    @property
    def ident(self) -> int: ...
    @property
    def head(self) -> RequestHead: ...
    @property
    def request_id(self) -> bytes: ...


def exchange_trace(exchange: Traced) -> TraceContext | None:
    """The exchange's trace context, None without ``[telemetry]``."""
    telemetry = exchange.fx.config.telemetry
    if telemetry is None:
        return None
    prefix = exchange.host.request_ids.prefix
    return trace_context(
        exchange.head.headers, prefix=prefix, ident=exchange.ident, ratio=telemetry.sample_ratio
    )


def backend_ids(headers: Headers, exchange: Traced) -> Headers:
    """``headers`` for the backend with the exchange's X-Request-ID and, with
    ``[telemetry]``, its ``traceparent`` (the proxy's span as the parent)."""
    headers = with_request_id(headers, exchange.request_id)
    context = exchange_trace(exchange)
    return headers if context is None else with_traceparent(headers, context)


class _Peer(Protocol):
    @property
    def peer_ip(self) -> str: ...


class Finished(Traced, Protocol):
    """What the access record reads of a finished exchange (``Exchange``): its request,
    where it went, when things happened, what it carried. ``fx.now`` is the end."""

    @property
    def client(self) -> _Peer: ...
    @property
    def session_key(self) -> bytes | None: ...
    @property
    def group(self) -> Upstream | None: ...
    @property
    def server_address(self) -> str: ...
    @property
    def server_id(self) -> str | None: ...
    @property
    def upstream_version(self) -> str | None: ...
    @property
    def tries(self) -> int: ...
    @property
    def status(self) -> int: ...
    @property
    def started(self) -> float: ...
    @property
    def head_at(self) -> float | None: ...
    @property
    def meter(self) -> SseMeter | None: ...
    @property
    def usage(self) -> UsageCounts | None: ...
    @property
    def upload(self) -> NamedModels: ...
    @property
    def bytes_in(self) -> int: ...
    @property
    def bytes_out(self) -> int: ...


class NamedModels(Protocol):
    """The models a request's body names, where the proxy read them (``exchange/upload.py``):
    the client's, and the alias's target it was rewritten to."""

    @property
    def model(self) -> str | None: ...
    @property
    def served_model(self) -> str | None: ...


class UsageCounts(Protocol):
    """The token counts the backend reported (``admit.UsageScan``), None where not seen."""

    @property
    def input_tokens(self) -> int | None: ...
    @property
    def output_tokens(self) -> int | None: ...


def access_fields(exchange: Finished, outcome: str) -> dict[str, Any]:
    """The fields of the ``access`` record of a finished exchange (``docs/architecture.md``
    lists them)."""
    head = exchange.head
    now = exchange.fx.now
    meter, usage = exchange.meter, exchange.usage
    group = exchange.group
    fields: dict[str, Any] = {
        "request_id": exchange.request_id.decode("ascii"),
        "client": exchange.client.peer_ip,
        "method": head.method.decode("latin-1"),
        "target": head.target.decode("latin-1"),
        "version": head.http_version.decode("latin-1"),
        "upstream_version": exchange.upstream_version,
        "status": exchange.status,
        "group": group.name if group is not None else None,
        "server": exchange.server_address or None,
        "server_id": exchange.server_id,
        "tries": exchange.tries,
        "model": exchange.upload.model,
        "served_model": exchange.upload.served_model,
        "ttfh": _seconds(exchange.head_at, exchange.started),
        "ttft": None if meter is None else _seconds(meter.first_token_at, exchange.started),
        "duration": round(now - exchange.started, 6),
        "events": None if meter is None else meter.events,
        "tokens": None if meter is None else meter.tokens,
        "input_tokens": None if usage is None else usage.input_tokens,
        "output_tokens": None if usage is None else usage.output_tokens,
        "bytes_in": exchange.bytes_in,
        "bytes_out": exchange.bytes_out,
        "outcome": outcome,
        "session": session_hash(exchange.session_key),
    }
    context = exchange_trace(exchange)
    if context is not None:
        fields["trace_id"] = context.trace_id
        fields["span_id"] = context.span_id
        fields["parent_span_id"] = context.parent_span_id
        fields["trace_sampled"] = context.sampled
    return fields


def add_to_totals(measurements: Measurements, exchange: Finished, *, cut: bool) -> None:
    """Add what a finished ``exchange`` measured to the totals; ``cut``: its client did not
    get the whole response (``requests_total``'s ``outcome``)."""
    group = exchange.group.name if exchange.group is not None else ""
    version = exchange.head.http_version.decode("latin-1")
    outcome = "cut" if cut else "complete"
    measurements.request(group, exchange.server_address, exchange.status, version, outcome)
    stats = measurements.group(group)
    stats.bytes_sent += exchange.bytes_out
    stats.bytes_received += exchange.bytes_in
    meter = exchange.meter
    if meter is not None:
        stats.sse_events += meter.events
        meter.stats.inter_token.sum += meter.gap_sum
        if meter.first_token_at is None:
            stats.streams_without_token += 1
        stats.stream_duration.observe(exchange.fx.now - exchange.started)


FIELDS = (
    "request_id",
    "client",
    "method",
    "target",
    "version",
    "upstream_version",
    "status",
    "group",
    "server",
    "server_id",
    "tries",
    "model",
    "served_model",
    "ttfh",
    "ttft",
    "duration",
    "events",
    "tokens",
    "input_tokens",
    "output_tokens",
    "bytes_in",
    "bytes_out",
    "outcome",
    "session",
    "trace_id",
    "span_id",
    "parent_span_id",
    "trace_sampled",
)
"""The access record's fields, in the order the text log writes them."""
