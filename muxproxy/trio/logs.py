"""Where the core's ``Log`` records go: the access log and the error log.

The access log (``[log] access``, on by default): one line per exchange, on stderr, appended
to a file (line-buffered, so each line is written whole when the exchange ends), or off. Two
formats (``[log] format``):

- ``text``: the timestamp, then ``key=value`` for every field in ``access.FIELDS`` order; a
  missing value is ``-``; a value with anything but visible ASCII (a space, a quote, a
  control byte, non-ASCII) is written as a JSON string, so one line is always one record::

    2026-05-01T12:00:00.123Z request_id=3f2a9c01d4e5-17 client=10.0.0.7 method=POST ...

- ``json``: one JSON object per line, ``{"time": ..., <the fields>}``.

The timestamp is the driver's (the core reads no clock): ISO 8601, UTC, milliseconds, when
the line is written, which is when the exchange ended.

The error log is Python ``logging``, logger ``muxproxy``: what goes wrong or changes (health
changes, retries, refused reloads, admin changes, internal errors, defences), at a level per
event (``LEVELS``), each as ``event key=value ...``. Its level is ``[log] level``
(``muxproxy serve --log-level`` overrides it). ``configure_error_log`` gives the logger a
stderr handler unless the process configured logging itself (an embedder's, or pytest's,
handlers win).

With ``[telemetry]``, each access record also goes to the OpenTelemetry export
(``telemetry.py``, built here when configured; without the extra ``otel`` the export is off
with a ``telemetry_error`` line, and the logs go on).

Writes are blocking, like nginx's unbuffered ``access_log``: a line is a few hundred bytes
per exchange, never per chunk; a log on a stalled disk stalls the process as it would stall
nginx's worker.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import sys
import threading
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any

from muxproxy.config import LogSettings
from muxproxy.config.telemetry import OTEL_EXTRA, TelemetrySettings
from muxproxy.core.commands import Log
from muxproxy.core.observe.access import FIELDS
from muxproxy.core.observe.defencelog import KINDS as DEFENCE_KINDS

if TYPE_CHECKING:
    from muxproxy.trio.telemetry import Telemetry

error_log = logging.getLogger("muxproxy")
"""The error log. Driver code that has something to say (a refused reload, an admin change)
logs here, preferably through ``LogSink.event`` so the line has the same shape."""

LEVELS: dict[str, int] = {
    "internal_error": logging.ERROR,
    "health": logging.WARNING,
    "retry": logging.WARNING,
    "retry_skipped": logging.INFO,
    "reload_refused": logging.ERROR,
    "reload": logging.INFO,
    "config_changed": logging.DEBUG,  # also the first event at start; "reload" says more
    "admin_change": logging.INFO,
    "upstream_goaway": logging.INFO,
    "upstream_start_timeout": logging.WARNING,
    "upstream_ping_timeout": logging.WARNING,
    "upstream_stream_ids_used": logging.INFO,
    "websocket_handshake_failed": logging.WARNING,
    "client_protocol_error": logging.INFO,
    "request_refused": logging.INFO,
    "send_timeout": logging.INFO,
    "client_closed": logging.DEBUG,
    "tunnel_opened": logging.DEBUG,
    "resume_store_bad_record": logging.WARNING,
    "fleet_budget_store_error": logging.WARNING,
    "fleet_sessions_store_error": logging.WARNING,
    "extension_error": logging.WARNING,
    "kv_events": logging.WARNING,
    "telemetry_error": logging.ERROR,
    **dict.fromkeys(DEFENCE_KINDS, logging.WARNING),
}
"""The error log's level per event; an event not listed is INFO. A server coming back up
(``health`` with ``up`` true) is INFO."""

LEVEL_NAMES = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def timestamp(wall: float) -> str:
    """ISO 8601 in UTC with milliseconds: ``2026-05-01T12:00:00.123Z``.

    The text of the whole second is kept from the last call (lines come many per second, and
    the calendar and ``strftime`` are most of a stamp's cost); the microseconds are rounded
    as ``datetime.fromtimestamp`` rounds them (half to even, a carry into the next second),
    so the text is the same as that of the datetime of ``wall``."""
    fraction, whole = math.modf(wall)
    micro = round(fraction * 1e6)
    if micro >= 1_000_000:
        whole, micro = whole + 1.0, micro - 1_000_000
    elif micro < 0:
        whole, micro = whole - 1.0, micro + 1_000_000
    second, text = _last_second.pair
    if whole != second:
        moment = datetime.datetime.fromtimestamp(whole, datetime.UTC)
        text = moment.strftime("%Y-%m-%dT%H:%M:%S.")
        # One tuple, set at once: the error log's handler may stamp from another thread.
        _last_second.pair = (whole, text)
    return f"{text}{micro // 1000:03d}Z"


class _LastSecond:
    """The last whole second ``timestamp`` wrote, and its text up to the fraction."""

    __slots__ = ("pair",)

    def __init__(self) -> None:
        self.pair: tuple[float, str] = (math.nan, "")  # NaN equals no second


_last_second = _LastSecond()


def _plain(text: str) -> bool:
    return text.isascii() and text.isprintable() and " " not in text and '"' not in text


def text_value(value: Any) -> str:
    """One field's value in a text line (see the module)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value)
    if text and _plain(text):
        return text
    return json.dumps(text)


def text_fields(fields: Mapping[str, Any], order: tuple[str, ...] = ()) -> str:
    """``key=value`` for each field, those named in ``order`` first."""
    keys = [key for key in order if key in fields]
    if len(keys) < len(fields):  # fields ``order`` does not name: after, as they come
        named = set(order)
        keys += [key for key in fields if key not in named]
    return " ".join([f"{key}={text_value(fields[key])}" for key in keys])


_ACCESS_KEYS = tuple((key, key + "=") for key in FIELDS)
_ABSENT = object()


def access_text(fields: Mapping[str, Any]) -> str:
    """``text_fields(fields, FIELDS)``, the same text, made the cheaper way for the line of
    every exchange: each name's ``key=`` made once, text values taken as they are and the
    whole line checked once for what ``text_value`` would have quoted (a space beyond the
    separators, a quote, a byte outside visible ASCII, an empty text); a line that has any
    is made again by ``text_fields``."""
    parts: list[str] = []
    empty = False
    for key, prefix in _ACCESS_KEYS:
        value = fields.get(key, _ABSENT)
        if value is _ABSENT:
            continue
        kind = type(value)
        if kind is str:
            parts.append(prefix + value)
            empty = empty or not value
        elif value is None:
            parts.append(prefix + "-")
        elif kind is int or kind is float:
            parts.append(prefix + repr(value))
        else:
            parts.append(prefix + text_value(value))
    line = " ".join(parts)
    if (
        len(parts) < len(fields)  # fields the order does not name: after, as they come
        or empty
        or not _plain_line(line, len(parts))
    ):
        return text_fields(fields, FIELDS)
    return line


def _plain_line(line: str, fields: int) -> bool:
    """Whether each of the line's ``fields`` is ``_plain``: the separators its only spaces."""
    return (
        line.isascii()
        and line.isprintable()
        and line.count(" ") == max(fields - 1, 0)
        and '"' not in line
    )


class LogSink:
    """Carries out ``Log`` commands for a ``Driver`` (``ProxyServer`` installs one)."""

    def __init__(
        self,
        settings: LogSettings,
        *,
        stderr: IO[str] | None = None,
        telemetry: TelemetrySettings | None = None,
    ) -> None:
        """``stderr``: where ``access = "stderr"`` writes (default ``sys.stderr`` at each
        write, so a test's capture sees it); ``telemetry``: where access records are exported
        too. Opens the access file: raises ``OSError``."""
        self._stderr = stderr
        self.settings = settings
        self._file: IO[str] | None = None
        self._open(settings)
        self.telemetry: Telemetry | None = None
        self.telemetry_settings: TelemetrySettings | None = None
        self.export_to(telemetry)

    def export_to(self, settings: TelemetrySettings | None) -> None:
        """Export access records as ``settings`` say (None: not at all). The same settings
        again keep the exporters; others replace them, the old ones flushed in a thread of
        their own (a slow collector must not hold the event loop)."""
        if settings == self.telemetry_settings:
            return
        old, self.telemetry, self.telemetry_settings = self.telemetry, None, settings
        if old is not None:
            threading.Thread(target=old.shutdown, name="telemetry-shutdown", daemon=True).start()
        if settings is None:
            return
        try:
            from muxproxy.trio.telemetry import Telemetry

            self.telemetry = Telemetry(settings)
        except ImportError as exc:
            # The configuration check refuses [telemetry] without the extra; an embedder
            # that built the settings itself gets the logs without the export.
            reason = f"{exc}; install the optional extra: {OTEL_EXTRA}"
            log_event("telemetry_error", {"reason": reason})

    def _open(self, settings: LogSettings) -> None:
        if settings.access not in ("stderr", "off"):
            self._file = open(settings.access, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def reconfigure(self, settings: LogSettings) -> None:
        """Apply new settings (a reload). The access file is opened again even when its path
        did not change, so a reload after log rotation writes to the new file. Raises
        ``OSError`` and keeps the old settings if the new file cannot be opened."""
        old = self._file
        self._file = None
        try:
            self._open(settings)
        except OSError:
            self._file = old
            raise
        if old is not None:
            old.close()
        self.settings = settings

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.telemetry is not None:
            self.telemetry.shutdown()  # the last spans and metrics: bounded by its timeout
            self.telemetry = self.telemetry_settings = None

    def __call__(self, record: Log, wall: float) -> None:
        """One record of the core, at wall-clock time ``wall`` (``time.time()``)."""
        if record.event == "access":
            self.access(record.fields, wall)
            if self.telemetry is not None:
                self._export(record.fields, wall)
        else:
            self.event(record.event, record.fields)

    def _export(self, fields: Mapping[str, Any], wall: float) -> None:
        telemetry = self.telemetry
        assert telemetry is not None
        try:
            telemetry.record(fields, wall)
        except Exception as exc:  # the SDK's failure: the export stops, not the proxy
            # The exporter's state is unknown after it raised: it is dropped, not reused;
            # the proxy and its logs go on without the export until the next reload.
            self.telemetry = None
            log_event("telemetry_error", {"reason": f"export stopped: {exc!r}"})
            threading.Thread(target=telemetry.shutdown, daemon=True).start()

    def access(self, fields: Mapping[str, Any], wall: float) -> None:
        settings = self.settings
        if settings.access == "off":
            return
        stamp = timestamp(wall)
        if settings.format == "json":
            line = json.dumps({"time": stamp, **fields}, default=str)
        else:
            line = f"{stamp} {access_text(fields)}"
        out = self._file
        if out is None:
            out = self._stderr or sys.stderr
        out.write(line + "\n")
        if out is not self._file:
            out.flush()

    def event(self, event: str, fields: Mapping[str, Any], level: int | None = None) -> None:
        """One error-log line (``log_event``)."""
        log_event(event, fields, level)


def log_event(event: str, fields: Mapping[str, Any], level: int | None = None) -> None:
    """One error-log line: ``event key=value ...`` at ``level`` (default: ``LEVELS``)."""
    if level is None:
        level = LEVELS.get(event, logging.INFO)
        if event == "health" and fields.get("up"):
            level = logging.INFO
    if not error_log.isEnabledFor(level):
        return
    trace = fields.get("traceback")
    shown = {k: v for k, v in fields.items() if k != "traceback"}
    message = f"{event} {text_fields(shown)}".rstrip()
    if trace:
        message += "\n" + str(trace).rstrip()
    error_log.log(level, message)


class _UtcFormatter(logging.Formatter):
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return timestamp(record.created)


def configure_error_log(level: str, *, stream: IO[str] | None = None) -> None:
    """Set the error log's level (``LEVEL_NAMES``), and give it a stderr handler (lines
    ``<timestamp> <LEVEL> <message>``) unless logging is configured already: a handler on
    the root logger or on ``muxproxy``. Safe to call again (a reload): the level changes."""
    error_log.setLevel(LEVEL_NAMES[level])
    if error_log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_UtcFormatter("%(asctime)s %(levelname)s %(message)s"))
    error_log.addHandler(handler)
    error_log.propagate = False


def drop_access(record: Log, wall: float) -> None:
    """A ``Driver``'s sink until one is installed: access records are dropped, the others go
    to the error log."""
    if record.event != "access":
        log_event(record.event, record.fields)
