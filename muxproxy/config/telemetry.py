"""The record of ``[telemetry]``: OpenTelemetry export over OTLP/HTTP (``docs/telemetry.md``).

A leaf module (no import from the rest of :mod:`muxproxy.config`), so :mod:`.records` can name
it in :class:`~muxproxy.config.records.Config`; the checks are in :mod:`.telemetrykeys`, the
export in ``muxproxy.trio.telemetry``. The collector's request headers often hold a
credential: they are left out of the record's ``repr`` and never logged.
"""

from __future__ import annotations

import attrs

__all__ = ["OTEL_EXTRA", "TelemetrySettings"]

OTEL_EXTRA = "pip install 'muxproxy[otel]'"
"""The command that installs the optional extra ``otel`` the export needs."""


@attrs.frozen(kw_only=True)
class TelemetrySettings:
    """``[telemetry]``: where spans and GenAI metrics go, and how often."""

    otlp_endpoint: str
    """The collector's OTLP/HTTP base URL (``http://collector:4318``): spans are posted to
    ``/v1/traces`` under it, metrics to ``/v1/metrics``."""
    service_name: str = "muxproxy"
    """The ``service.name`` resource attribute of everything exported."""
    export_interval: float = 10.0
    """Seconds between metric exports (spans go in batches as they end, at least this often)."""
    headers: tuple[tuple[str, str], ...] = attrs.field(default=(), repr=False)
    """Request headers for the collector (an ``Authorization``, an API key); never logged."""
    sample_ratio: float = 1.0
    """The share of new traces whose spans are exported, 0 to 1; a client's ``traceparent``
    decides for its own trace (its sampled flag). Metrics count every request."""
