"""Validation of a group's ``discover`` table and of ``slow_start``; the record is in
:mod:`.discovery`.

The per-server keys of ``discover`` are checked by the functions that check a listed
server's (:mod:`.upstreams` hands its table of them to :func:`discover_keys`, so this module
imports nothing of it and no import cycle forms). A name looked up is a DNS name (RFC 1035
§2.3.1, with the ``_service._proto`` labels of RFC 2782 admitted), at most 253 characters.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from muxproxy.config.checker import Checker, Key, describe, join
from muxproxy.config.discovery import Discover

__all__ = ["discover_keys", "discover_parser", "duration_or_zero", "lookup_name"]

_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)\Z")
_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h)\s*\Z")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_NOT_FOR_DISCOVERED = ("address", "backup", "kv_events")
"""Server keys a ``discover`` table has no use for: the answer gives the addresses, SRV
priorities the backups, and the group's ``kv_events.port`` each engine's events."""


def lookup_name(check: Checker, value: Any, path: str) -> str | None:
    """A DNS name to look up (a trailing dot, the root, is allowed and kept)."""
    name = value.removesuffix(".") if isinstance(value, str) else None
    if not name or len(name) > 253 or not all(_LABEL.match(p) for p in name.split(".")):
        check.add(
            path,
            'expected a DNS name such as "vllm.llm.svc.cluster.local" (labels of letters,'
            f" digits, - and _, 63 characters each at most), got {describe(value)}",
        )
        return None
    assert isinstance(value, str)
    return value


def duration_or_zero(check: Checker, value: Any, path: str) -> float | None:
    """Seconds >= 0 as a number, or a string with a unit: ``"30s"``, ``"500ms"``, ``"2m"``,
    ``"1h"``."""
    seconds: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value) if math.isfinite(value) and value >= 0 else None
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match[1]) * _UNITS[match[2]]
    if seconds is None:
        check.add(
            path,
            'expected seconds (a number >= 0, 0: off) or a duration such as "30s", "500ms"'
            f' or "2m", got {describe(value)}',
        )
    return seconds


def discover_keys(server_keys: Mapping[str, Key]) -> dict[str, Key]:
    """The keys of a ``discover`` table: what to look up, and the server keys that apply."""
    keys = {
        "dns": Key(lookup_name),
        "srv": Key(lookup_name),
        "port": Key(Checker.positive_int),
        "interval": Key(Checker.seconds),
    }
    keys.update((k, v) for k, v in server_keys.items() if k not in _NOT_FOR_DISCOVERED)
    return keys


def discover_parser(keys: Mapping[str, Key]) -> Any:
    """The checking function of the ``discover`` key, over ``keys`` (:func:`discover_keys`)."""

    def discover(check: Checker, value: Any, path: str) -> Discover | None:
        values = check.table(
            value, path, keys, what='a table such as { dns = "vllm.example", port = 8000 }'
        )
        if values is None:
            return None
        given = [key for key in ("dns", "srv") if key in values]
        if len(given) != 1:
            check.add(
                path,
                "expected exactly one of dns (A and AAAA records, with port) and srv (SRV"
                f" records), got {'both' if given else 'neither'}",
            )
            return None
        if "dns" in values and "port" not in values:
            check.add(join(path, "port"), "missing; dns gives addresses, port says where: 8000")
            return None
        for key, why in (("port", "ports"), ("weight", "weights")):
            if "srv" in values and key in values:
                check.add(
                    join(path, key),
                    f"SRV records carry the servers' {why}; remove {key}, or look up A and"
                    " AAAA records with dns = NAME",
                )
                return None
        return Discover(**values)

    return discover
