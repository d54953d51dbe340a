"""The ``[log]`` section: where the access log goes, its format, the error log's level.

Internal to :mod:`muxproxy.config`, like :mod:`.upstreams`: one section's checks, each
problem named by its key (``log.format``) with what is expected.
"""

from __future__ import annotations

from typing import Any

from muxproxy.config.checker import Checker, Key, describe
from muxproxy.config.logsettings import LOG_FORMATS, LOG_LEVELS, LogSettings

__all__ = ["log_settings"]


def _access(check: Checker, value: Any, path: str) -> str | None:
    """``"stderr"``, ``"off"``, or a file path whose directory exists (the file is created,
    appended to, when the proxy starts)."""
    if not isinstance(value, str) or not value:
        check.add(path, f'expected "stderr", "off" or a file path, got {describe(value)}')
        return None
    if value in ("stderr", "off"):
        return value
    return check.file_to_write(
        value,
        path,
        missing_directory='create it or choose another path ("stderr" and "off" are the'
        " alternatives)",
    )


def _format(check: Checker, value: Any, path: str) -> str | None:
    return check.one_of(value, path, LOG_FORMATS)


def _level(check: Checker, value: Any, path: str) -> str | None:
    return check.one_of(value, path, LOG_LEVELS)


_LOG_KEYS = {"access": Key(_access), "format": Key(_format), "level": Key(_level)}


def log_settings(check: Checker, value: Any) -> LogSettings | None:
    """The ``[log]`` table (absent: the defaults)."""
    values = check.table(value, "log", _LOG_KEYS)
    return None if values is None else LogSettings(**values)
