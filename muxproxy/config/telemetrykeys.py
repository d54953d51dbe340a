"""Validation of ``[telemetry]``; the record is in :mod:`.telemetry`.

The endpoint is an ``http``/``https`` URL with a host and no query or fragment (the paths
``/v1/traces`` and ``/v1/metrics`` are appended to it, OTLP/HTTP's defaults). Header names
are tokens (RFC 9110 §5.1) and values visible ASCII (§5.5), so no header can smuggle a line
break into the collector request. The table needs the optional extra ``otel``: without it
the configuration is refused, with the command that installs it, instead of a proxy that
starts and exports nothing.
"""

from __future__ import annotations

import importlib.util
import re
import urllib.parse
from typing import Any

from muxproxy.config.checker import Checker, Key, describe
from muxproxy.config.telemetry import OTEL_EXTRA, TelemetrySettings

__all__ = ["TELEMETRY_KEYS", "telemetry_settings"]

_TOKEN = re.compile(r"\A[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
_VALUE = re.compile(r"\A[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?\Z")

OTEL_MODULES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
"""What the export imports: the SDK and its OTLP/HTTP exporter."""


def _endpoint(check: Checker, value: Any, path: str) -> str | None:
    expected = 'an http(s) URL such as "http://collector:4318"'
    if not isinstance(value, str):
        check.add(path, f"expected {expected}, got {describe(value)}")
        return None
    try:
        url = urllib.parse.urlsplit(value)
        url.port  # noqa: B018 (raises ValueError for a port out of range)
    except ValueError:
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.hostname:
        check.add(path, f"expected {expected}, got {describe(value)}")
        return None
    if url.query or url.fragment:
        check.add(path, f"expected {expected} without a query or fragment, got {value!r}")
        return None
    return value.rstrip("/")


def _service_name(check: Checker, value: Any, path: str) -> str | None:
    text = check.string(value, path)
    if text is not None and not text.strip():
        check.add(path, "expected a service name, got an empty string")
        return None
    return text


def _headers(check: Checker, value: Any, path: str) -> tuple[tuple[str, str], ...] | None:
    if not isinstance(value, dict):
        check.add(path, f"expected a table of header names to values, got {describe(value)}")
        return None
    out: list[tuple[str, str]] = []
    for name, text in value.items():
        if not _TOKEN.match(name):
            check.add(f"{path}.{name}", "expected a header name (letters, digits, -)")
            return None
        if not isinstance(text, str) or not _VALUE.match(text):
            # The value is a credential as often as not: never shown.
            check.add(f"{path}.{name}", "expected a value of visible ASCII characters")
            return None
        out.append((name, text))
    return tuple(out)


def _ratio(check: Checker, value: Any, path: str) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        check.add(path, f"expected a number from 0 to 1, got {describe(value)}")
        return None
    return float(value)


TELEMETRY_KEYS = {
    "otlp_endpoint": Key(_endpoint, required='a URL such as "http://collector:4318"'),
    "service_name": Key(_service_name),
    "export_interval": Key(Checker.seconds),
    "headers": Key(_headers),
    "sample_ratio": Key(_ratio),
}


def otel_installed() -> bool:
    """Whether the optional extra ``otel`` is installed (its modules found, not imported)."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in OTEL_MODULES)
    except ImportError:  # a parent package missing
        return False


def telemetry_settings(check: Checker, value: Any) -> TelemetrySettings | None:
    """The ``[telemetry]`` table (``value``, None when the file has none). None: no export."""
    if value is None:
        return None
    settings: TelemetrySettings | None = check.record(
        TelemetrySettings, value, "telemetry", TELEMETRY_KEYS
    )
    if settings is not None and not otel_installed():
        check.add(
            "telemetry",
            "OpenTelemetry export needs the optional extra otel (opentelemetry-sdk and"
            f" opentelemetry-exporter-otlp-proto-http): {OTEL_EXTRA}",
        )
        return None
    return settings
