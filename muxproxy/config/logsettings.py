"""The ``[log]`` section's record: where the access log goes, its format, the error log's level.

A module of its own, beside :mod:`.records` (which holds it in ``Config.log``), so that the
records of the proxy's parts each fit one file; :mod:`.logs` checks it.
"""

from __future__ import annotations

import attrs

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")


@attrs.frozen(kw_only=True)
class LogSettings:
    """The ``[log]`` section (``muxproxy.trio.logs`` carries it out)."""

    access: str = "stderr"
    """Where access lines go: ``"stderr"``, ``"off"``, or a file path (appended to)."""
    format: str = "text"
    """One of :data:`LOG_FORMATS`: ``key=value`` fields after a timestamp, or one JSON object
    per line."""
    level: str = "info"
    """One of :data:`LOG_LEVELS`: the error log's level (``muxproxy serve --log-level`` wins)."""
