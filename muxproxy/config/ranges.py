"""The range of every numeric configuration key and admin field: one table, :data:`RANGES`.

Internal to :mod:`muxproxy.config`. A key's checking function (:mod:`.checker`,
:mod:`.upstreams`, :mod:`.loading`) says what kind of number it takes (seconds, a positive
integer...); this table says how large (and, where the kind alone does not, how small) it
may be. :meth:`.checker.Checker.table` applies it to every key it converts, so ``muxproxy
check``, a reload (SIGHUP, ``POST /reload``) and the start all refuse the same values; the
admin API's ``weight`` and the state file's take the server weight's range from here too.

Why upper bounds at all: a number is a deadline, a size held in memory, a count or a share,
and past some size it is no longer any of those. ``2**64`` as a weight overflows a float in
the metrics; ``1e300`` seconds is a timer that never fires, written as if it were one. Where
the bound comes from a protocol the RFC is named; otherwise it is the largest value that
still means something on one machine, as HAProxy and Envoy bound theirs:

- a duration: at most a day (86,400 s); a deadline longer than that is no deadline;
- a size held per stream, request or connection: at most 1 GiB; per process: 1 TiB;
- a count: at most 1,000,000 (a connection count to one server: 65,535 source ports);
- a rate: at most 10**9 a minute.

The keys are key paths as the reference writes them (``upstreams.NAME.servers[].weight``);
:func:`pattern` turns a concrete path (``upstreams.gpus.servers[2].weight``) into one. A test
walks every numeric field of every configuration record and fails for one without a range
here, so a new numeric key cannot be added without one: add a line to :data:`RANGES` (a new
field of ``[timeouts]`` or a group's ``timeouts`` is a deadline, and has its range at once).
"""

from __future__ import annotations

import math
import re
from typing import Any

import attrs

from muxproxy.config.records import GroupTimeouts, Timeouts

__all__ = [
    "RANGES",
    "SERVER_WEIGHT",
    "Range",
    "described",
    "outside",
    "pattern",
    "problem",
    "shown",
]


@attrs.frozen
class Range:
    """The values a numeric key takes: ``low`` to ``high``, both included unless
    ``above_low`` (then ``low`` itself is refused, as 0 seconds is)."""

    low: int | float
    high: int | float
    unit: str = ""
    """``"seconds"``, ``"bytes"`` or ``""`` (a count, a share, a ratio)."""
    why: str = ""
    """Where the bound comes from, when it is more than "sane" (shown in errors and docs)."""
    above_low: bool = False

    def contains(self, value: int | float) -> bool:
        """Whether ``value`` is in range; NaN is in no range."""
        low_ok = value > self.low if self.above_low else value >= self.low
        return low_ok and value <= self.high

    @property
    def text(self) -> str:
        """``0 to 1000000``, ``more than 0 and at most 86400 seconds (a day)``."""
        unit = f" {self.unit}" if self.unit else ""
        if self.above_low:
            text = f"more than {_number(self.low)} and at most {_number(self.high)}{unit}"
        else:
            text = f"{_number(self.low)} to {_number(self.high)}{unit}"
        return f"{text} ({self.why})" if self.why else text


def _number(value: int | float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


DAY = 86_400
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4
COUNT = 1_000_000

_TIMEOUT = Range(0, DAY, "seconds", "a day", above_low=True)
_BUFFER = Range(1, GIB, "bytes", "1 GiB: held in memory for one stream, request or connection")
_PROCESS_BYTES = Range(1, TIB, "bytes", "1 TiB")
_COUNT = Range(1, COUNT)
_COUNT_OR_ZERO = Range(0, COUNT)
_CONNECTIONS = Range(1, 65_535, "", "the source ports a proxy has to one server")
_RATE = Range(1, 10**9, "", "a billion a minute")

SERVER_WEIGHT = Range(0, COUNT, "", "weights are relative shares")
"""A server's weight (and a model alias target's), in the configuration, the admin API and
the state file."""

_G = "upstreams.NAME"

RANGES: dict[str, Range] = {
    # Every field of [timeouts] and of a group's is a deadline, a new one included.
    **{f"timeouts.{field.name}": _TIMEOUT for field in attrs.fields(Timeouts)},
    "limits.stream_buffer": Range(
        2048, GIB, "bytes", "at least two socket reads; at most 1 GiB held for one stream"
    ),
    # RFC 9113 §6.5.2 allows 2**32-1, HAProxy's tune.h2.max-concurrent-streams no bound:
    # past a million streams one connection would be the whole process.
    "limits.max_concurrent_streams": _COUNT,
    # Envoy's max_request_headers_kb stops at 8192 KiB; a head is held whole.
    "limits.max_request_head": Range(1, 8 * MIB, "bytes", "8 MiB, Envoy's largest"),
    "limits.max_header_fields": Range(1, 32_767, "", "HAProxy's tune.http.maxhdr largest"),
    "limits.max_request_body": _PROCESS_BYTES,
    "limits.max_client_connections": Range(
        1, 1_048_576, "", "Linux's default fs.nr_open: the descriptors one process may open"
    ),
    "limits.h2_connection_window": Range(
        65_535, 2**31 - 1, "bytes", "RFC 9113 §6.9.1: a flow-control window"
    ),
    "limits.connection_buffer": _BUFFER,
    "limits.h2_reset_budget": _COUNT,
    "limits.h2_control_frame_budget": _COUNT,
    "limits.resume_memory": _PROCESS_BYTES,
    # Held per request before it is routed, as the body keys' ``sticky.body_limit``.
    "limits.max_route_body": Range(1, 16 * MIB, "bytes", "16 MiB: held for one request"),
    "models.NAME.targets[].weight": SERVER_WEIGHT,
    f"{_G}.pool_max_idle": Range(0, 65_535, "", "the source ports a proxy has to one server"),
    f"{_G}.pool_idle_timeout": _TIMEOUT,
    # The largest context windows hold about 10**7 tokens.
    f"{_G}.default_max_tokens": Range(1, 10**7, "", "ten million tokens"),
    f"{_G}.servers[].weight": SERVER_WEIGHT,
    f"{_G}.servers[].max_fails": _COUNT_OR_ZERO,
    f"{_G}.servers[].fail_timeout": _TIMEOUT,
    f"{_G}.servers[].max_connections": _CONNECTIONS,
    f"{_G}.servers[].max_streams": _COUNT,
    f"{_G}.servers[].max_waiting": _COUNT_OR_ZERO,
    # discover: the per-server keys as a listed server's; a lookup at most once a second.
    f"{_G}.discover.port": Range(1, 65_535, "", "a TCP port"),
    f"{_G}.discover.interval": Range(1, 3600, "seconds", "an hour; at least a second"),
    f"{_G}.discover.weight": SERVER_WEIGHT,
    f"{_G}.discover.max_fails": _COUNT_OR_ZERO,
    f"{_G}.discover.fail_timeout": _TIMEOUT,
    f"{_G}.discover.max_connections": _CONNECTIONS,
    f"{_G}.discover.max_streams": _COUNT,
    f"{_G}.discover.max_waiting": _COUNT_OR_ZERO,
    f"{_G}.slow_start": Range(0, 3600, "seconds", "an hour"),
    f"{_G}.models_refresh": Range(1, 3600, "seconds", "an hour; at least a second"),
    f"{_G}.sticky.body_limit": _BUFFER,
    f"{_G}.sticky.session_idle": _TIMEOUT,
    # RFC 6265bis, the Max-Age attribute: a user agent caps a cookie's Max-Age at 400 days.
    f"{_G}.sticky.cookie.expires": Range(
        0, 400 * DAY, "seconds", "400 days, the most browsers keep a cookie", above_low=True
    ),
    f"{_G}.next_upstream.tries": _COUNT,
    f"{_G}.next_upstream.tries_timeout": _TIMEOUT,
    f"{_G}.next_upstream.replay_buffer": Range(0, GIB, "bytes", "1 GiB: held for one request"),
    f"{_G}.health_check.interval": _TIMEOUT,
    f"{_G}.health_check.timeout": _TIMEOUT,
    f"{_G}.health_check.passes": _COUNT,
    f"{_G}.health_check.fails": _COUNT,
    f"{_G}.health_check.expect_status": Range(100, 599, "", "RFC 9110 §15: a status code"),
    **{f"{_G}.timeouts.{field.name}": _TIMEOUT for field in attrs.fields(GroupTimeouts)},
    f"{_G}.prefix.length": Range(1, 64 * MIB, "bytes", "64 MiB: a key is hashed per request"),
    f"{_G}.prefix.load_factor": Range(1, 100),
    f"{_G}.prefix.balance_gap": _COUNT,
    f"{_G}.load_report.interval": _TIMEOUT,
    f"{_G}.load_report.timeout": _TIMEOUT,
    f"{_G}.load_report.kv_cache_limit": Range(0, 1, "", "a fraction", above_low=True),
    f"{_G}.kv_events.port": Range(1, 65_535, "", "a TCP port"),
    f"{_G}.kv_events.stale_after": Range(0, 3600, "seconds", "an hour", above_low=True),
    f"{_G}.kv_events.max_blocks": Range(1, 10_000_000, "", "some 2 GB held per engine"),
    f"{_G}.queue.max": _COUNT_OR_ZERO,
    f"{_G}.queue.timeout": _TIMEOUT,
    f"{_G}.queue.retry_after": Range(1, DAY, "seconds", "a day"),
    f"{_G}.queue.affinity_wait": Range(0, DAY, "seconds", "a day"),
    f"{_G}.rate_limit.tokens_per_minute": _RATE,
    f"{_G}.rate_limit.requests_per_minute": _RATE,
    f"{_G}.rate_limit.max_concurrent": Range(1, 1_000_000, "", "a million streams in flight"),
    "routes[].sse_heartbeat": _TIMEOUT,
    "resolver.timeout": Range(0, 60, "seconds", "a minute: a lookup", above_low=True),
    "resolver.attempts": Range(1, 10),
    "fleet.sync_interval": Range(0.1, 3600, "seconds", "an hour"),
    "telemetry.export_interval": Range(0.1, 3600, "seconds", "an hour"),
    "telemetry.sample_ratio": Range(0, 1, "", "a share of traces"),
    # A request waits for the hook: longer than a minute is no answer.
    "extensions[].timeout": Range(0, 60, "seconds", "a minute", above_low=True),
    "routes[].resume.window": Range(
        4096, GIB, "bytes", "at least a few events; at most 1 GiB held for one stream"
    ),
    "routes[].resume.linger": _TIMEOUT,
    "routes[].resume.lease": Range(
        1,
        300,
        "seconds",
        "5 minutes: renewed every third of it, a dead owner's readers wait for it",
    ),
}
"""Key path (as the reference writes it) -> its range. Every numeric key has one."""


_GROUP_IN_PATH = re.compile(r'\A(upstreams|models)\.("(?:[^"\\]|\\.)*"|[A-Za-z0-9_-]+)')
_INDEX = re.compile(r"\[[0-9]*\]")


def pattern(path: str) -> str:
    """A concrete key path as :data:`RANGES` names it: ``upstreams.gpus.servers[1].weight``
    -> ``upstreams.NAME.servers[].weight``."""
    match = _GROUP_IN_PATH.match(path)
    if match is not None:
        path = f"{match[1]}.NAME" + path[match.end() :]
    return _INDEX.sub("[]", path)


def described(path: str, kind: str) -> str:
    """``kind`` (what the reference says a key's value looks like) with the key's range."""
    limits = RANGES.get(path)
    return kind if limits is None else f"{kind}; range: {limits.text}"


def problem(path: str, value: Any) -> str | None:
    """What is wrong with the number ``value`` at the concrete key path ``path``: None when
    it is in the key's range (or the key has none: it is not a number). ``value`` is what
    the key's checking function converted, so already a number of the right kind."""
    limits = RANGES.get(pattern(path))
    if limits is None or not isinstance(value, int | float):
        return None
    return outside(limits, value)


def outside(limits: Range, value: Any) -> str | None:
    """The message for ``value`` outside ``limits`` (a boolean, NaN and infinities are
    outside every range), or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"expected a number, {limits.text}, got {shown(value)}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"expected a finite number, {limits.text}, got {shown(value)}"
    if limits.contains(value):
        return None
    if value > limits.high:
        fix = f"lower it to {_number(limits.high)} or less"
    elif limits.above_low:
        fix = f"raise it above {_number(limits.low)}"
    else:
        fix = f"raise it to {_number(limits.low)} or more"
    return f"expected {limits.text}, got {shown(value)}; {fix}"


def shown(value: Any) -> str:
    """``value`` for a message; a very long integer by its size (a message is one line, and
    Python will not even print an integer of more than 4300 digits)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and abs(value) >= 10**30:
        return "an integer of 31 digits or more"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    if isinstance(value, int):
        return str(value)
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- docs/operations.md --

BEGIN = (
    "<!-- numeric ranges: generated from muxproxy/config/ranges.py by scripts/config-reference -->"
)
END = "<!-- end of numeric ranges -->"


def render_markdown() -> str:
    """The table of every range, as ``docs/operations.md`` holds it between :data:`BEGIN`
    and :data:`END`."""
    rows = [BEGIN, "", "| key | range |", "|---|---|"]
    rows += [f"| `{path}` | {limits.text} |" for path, limits in RANGES.items()]
    return "\n".join([*rows, "", END])


def with_table(document: str) -> str:
    """``document`` (``docs/operations.md``) with its table of ranges rendered anew."""
    start = document.index(BEGIN)
    end = document.index(END, start) + len(END)
    return document[:start] + render_markdown() + document[end:]
