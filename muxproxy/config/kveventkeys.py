"""Validation of a group's ``kv_events`` table and of a server's ``kv_events`` endpoint; the
record is in :mod:`.kvevents`.

Internal to :mod:`muxproxy.config`. The events only reorder what ``affinity = "prefix"``
places (the engine holding the most of a prompt goes first among those within the prefix
affinity's load bounds), so a group with ``kv_events`` and another affinity is refused with
the fix, as is a server's own endpoint in a group without ``kv_events``. An endpoint is
ZeroMQ's ``tcp://host:port`` (vLLM's ``"endpoint"`` with the engine's address in place of
``*``).
"""

from __future__ import annotations

from typing import Any

from muxproxy.config.checker import Checker, Key, address_problem, describe, join
from muxproxy.config.discoverykeys import duration_or_zero
from muxproxy.config.kvevents import KvEvents
from muxproxy.config.records import AffinityMode, Upstream

__all__ = ["KV_EVENTS_KEYS", "kv_endpoint", "kv_events", "kv_events_valid", "topic"]

MAX_TOPIC = 256
"""Characters of a topic at most (vLLM's is a short name; ZeroMQ matches it as a prefix)."""


def kv_endpoint(check: Checker, value: Any, path: str) -> str | None:
    """A server's own endpoint: ``"tcp://host:port"``."""
    if isinstance(value, str) and value.startswith("tcp://"):
        problem = address_problem(value.removeprefix("tcp://"))
        if problem is None:
            return value
    check.add(
        path,
        'expected a ZeroMQ endpoint "tcp://host:port" where the engine publishes its'
        f" KV-cache events, got {describe(value)}",
    )
    return None


def topic(check: Checker, value: Any, path: str) -> str | None:
    if not isinstance(value, str) or len(value) > MAX_TOPIC:
        check.add(
            path, f"expected a string of at most {MAX_TOPIC} characters, got {describe(value)}"
        )
        return None
    return value


def stale_after(check: Checker, value: Any, path: str) -> float | None:
    """Seconds above 0, as a number or a duration (``"2s"``, ``"500ms"``)."""
    seconds = duration_or_zero(check, value, path)
    if seconds is not None and seconds <= 0:
        check.add(path, f'expected seconds above 0 (e.g. 2 or "2s"), got {describe(value)}')
        return None
    return seconds


KV_EVENTS_KEYS = {
    "port": Key(Checker.positive_int),
    "topic": Key(topic),
    "stale_after": Key(stale_after),
    "max_blocks": Key(Checker.positive_int),
}


def kv_events(check: Checker, value: Any, path: str) -> KvEvents | None:
    return check.record(KvEvents, value, path, KV_EVENTS_KEYS)  # type: ignore[no-any-return]


def kv_events_valid(check: Checker, path: str, group: Upstream) -> bool:
    """The cross-checks of ``kv_events`` in the group at ``path`` (see the module header)."""
    if group.kv_events is not None and group.affinity is not AffinityMode.PREFIX:
        check.add(
            join(path, "kv_events"),
            'reorders the placement of affinity = "prefix" by the engines\' KV-cache events,'
            f' but the group\'s affinity is "{group.affinity.value}"; add {path}.affinity ='
            ' "prefix" or remove kv_events',
        )
        return False
    if group.kv_events is None:
        for index, server in enumerate(group.servers):
            if server.kv_events is not None:
                check.add(
                    f"{path}.servers[{index}].kv_events",
                    "names where the engine publishes its KV-cache events, but the group"
                    f" does not follow them; add {path}.kv_events = {{ port = 5557 }} (and"
                    ' affinity = "prefix") or remove it',
                )
                return False
    return True
