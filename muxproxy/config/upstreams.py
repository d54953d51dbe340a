"""Validation of one ``[upstreams.NAME]`` group: servers, balancing, stickiness, retries,
health checks, per-group timeouts and the request headers set for the backends.

Internal to :mod:`muxproxy.config`; :func:`upstream` is what :mod:`.loading` calls. Each
function here checks one value at one key path, reports through the :class:`Checker` and
returns the record, or None when something was wrong.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs

from muxproxy.config.checker import (
    TOKEN,
    TOKEN_CHARS,
    Checker,
    Key,
    alternatives,
    describe,
    join,
    record_keys,
)
from muxproxy.config.discoverykeys import discover_keys, discover_parser, duration_or_zero
from muxproxy.config.groupmodelkeys import model_names, models_valid
from muxproxy.config.kveventkeys import kv_endpoint, kv_events, kv_events_valid
from muxproxy.config.queuekeys import admission_queue
from muxproxy.config.records import (
    CONDITIONS,
    PROMPT_SOURCES,
    AffinityMode,
    Balance,
    GroupTimeouts,
    HeaderRule,
    HealthCheck,
    LoadReporting,
    NextUpstream,
    PrefixAffinity,
    RateLimit,
    Server,
    Upstream,
)
from muxproxy.config.stickykeys import source, sticky

__all__ = ["upstream"]

_REQUEST_PATH = re.compile(r"/[^\s\x00-\x1f\x7f]*\Z")
_HTTP_CONDITION = re.compile(r"http_[0-9]{3}\Z")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_VARIABLE = re.compile(r"\$([A-Za-z0-9_]*)")
_VARIABLES = ("session_key", "remote_addr")
_VARIABLE_PREFIXES = ("arg_", "cookie_", "http_")
_EXPECTED_VARIABLES = "$session_key, $remote_addr, $arg_NAME, $cookie_NAME or $http_NAME"
_PROXY_HEADERS = frozenset(
    {
        "connection",
        "content-length",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
"""Headers set_headers may not set: message framing and hop-by-hop fields."""
_CONDITION_ORDER = tuple(sorted(CONDITIONS, key=lambda c: (c.startswith("http_"), c)))


def upstream(check: Checker, name: str, value: Any, path: str) -> Upstream | None:
    """The group ``name`` at ``path`` (``upstreams.NAME``), with its cross-checks."""
    reports_off = isinstance(value, dict) and value.get("load_report") is False
    if reports_off:  # ``load_report = false``: none, not even prefix affinity's default
        value = {key: item for key, item in value.items() if key != "load_report"}
    values = check.table(value, path, _UPSTREAM_KEYS, what="a table with servers = [...]")
    if values is None:
        return None
    if "servers" in values and "discover" in values:
        check.add(
            path,
            "servers and discover are both set; keep one: servers lists the servers,"
            " discover finds them in DNS",
        )
        return None
    if "servers" not in values and "discover" not in values:
        if "servers" not in value and "discover" not in value:  # not already reported
            check.add(
                join(path, "servers"),
                'missing; expected an array of "host:port" servers (or discover ='
                ' { dns = "NAME", port = 8000 } to find them in DNS)',
            )
        return None
    group = Upstream(name=name, **values)
    if group.affinity is AffinityMode.PREFIX and group.load_report is None and not reports_off:
        # Prefix affinity keeps a key on its engine while the engine has room: its own
        # report says so (vLLM, SGLang: ``/metrics``); a server without one degrades to the
        # bounds alone, logged once.
        group = attrs.evolve(group, load_report=LoadReporting())
    found = group.discover
    if found is not None and found.max_waiting is not None and group.load_report is None:
        check.add(
            f"{path}.discover.max_waiting",
            "counts the requests the engine reports waiting, but the group has no load"
            f' reports; add {path}.load_report = {{ path = "/metrics" }} or remove it',
        )
        return None
    if group.load_report is None:
        for index, one in enumerate(group.servers):
            if one.max_waiting is not None:
                check.add(
                    f"{path}.servers[{index}].max_waiting",
                    "counts the requests the engine reports waiting, but the group has no"
                    f' load reports; add {path}.load_report = {{ path = "/metrics" }} or'
                    " remove max_waiting",
                )
                return None
    if not models_valid(check, path, group, value) or not kv_events_valid(check, path, group):
        return None
    if not group.sticky.sources:
        valid = True
        for rule in group.set_headers:
            if "$session_key" in rule.value:
                check.add(
                    join(join(path, "set_headers"), _raw_name(value, rule.name)),
                    "uses $session_key, but the group has no session sources, so it would "
                    f'always be empty; add [{path}.sticky] with sources = ["header:X-Chat-ID"]'
                    " (or another source)",
                )
                valid = False
        if not valid:
            return None
    return group


def _raw_name(table: Mapping[str, Any], lower: str) -> str:
    """The spelling in the file of the set_headers key stored as ``lower``."""
    headers = table.get("set_headers", {})
    return next((key for key in headers if key.lower() == lower), lower)


# -- servers --

SERVER_PROTOCOLS = ("h1", "h2")


def servers(check: Checker, value: Any, path: str) -> tuple[Server, ...] | None:
    items = check.array(value, path, 'an array of "host:port" strings or { address = ... }')
    if items is None:
        return None
    if not items:
        check.add(path, "expected at least one server, got an empty array")
        return None
    parsed = [server(check, item, f"{path}[{index}]") for index, item in enumerate(items)]
    if any(one is None for one in parsed):
        return None
    result = tuple(one for one in parsed if one is not None)
    seen: dict[str, int] = {}
    valid = True
    for index, one in enumerate(result):
        if one.address in seen:
            check.add(
                f"{path}[{index}]",
                f"{describe(one.address)} is already listed at {path}[{seen[one.address]}];"
                " list a server once, and give it a larger weight for a larger share",
            )
            valid = False
        seen.setdefault(one.address, index)
    if all(one.backup for one in result):
        check.add(
            path,
            "every server is a backup; expected at least one primary server to take the"
            " traffic: set backup = false on one of them, or add one",
        )
        valid = False
    return result if valid else None


def server(check: Checker, value: Any, path: str) -> Server | None:
    if isinstance(value, str):
        address = check.address(value, path)
        return None if address is None else Server(address=address)
    if not isinstance(value, Mapping):
        check.add(path, f'expected "host:port" or a table with address, got {describe(value)}')
        return None
    values = check.table(value, path, _SERVER_KEYS)
    return None if values is None else Server(**values)


def weight(check: Checker, value: Any, path: str) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        check.add(path, f"expected an integer >= 0 (0 drains the server), got {describe(value)}")
        return None
    return value


def server_protocol(check: Checker, value: Any, path: str) -> str | None:
    if value not in SERVER_PROTOCOLS:
        check.add(
            path,
            f'expected "h1" (HTTP/1.1) or "h2" (HTTP/2: h2c, or TLS with ALPN when tls = true),'
            f" got {describe(value)}",
        )
        return None
    return str(value)


def max_connections(check: Checker, value: Any, path: str) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        check.add(
            path, f"expected an integer >= 1 (h2 connections to this server), got {describe(value)}"
        )
        return None
    return value


def max_fails(check: Checker, value: Any, path: str) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        check.add(path, f"expected an integer >= 0 (0: never take it out), got {describe(value)}")
        return None
    return value


def balance(check: Checker, value: Any, path: str) -> Balance | None:
    choice = check.one_of(value, path, [member.value for member in Balance])
    return None if choice is None else Balance(choice)


# -- retries --


def next_upstream(check: Checker, value: Any, path: str) -> NextUpstream | None:
    values = check.table(value, path, _NEXT_UPSTREAM_KEYS)
    return None if values is None else NextUpstream(**values)


def conditions(check: Checker, value: Any, path: str) -> frozenset[str] | None:
    items = check.array(value, path, f"an array of conditions ({', '.join(_CONDITION_ORDER)})")
    if items is None:
        return None
    result: set[str] = set()
    valid = True
    for index, item in enumerate(items):
        where = f"{path}[{index}]"
        if isinstance(item, str) and item not in CONDITIONS and _HTTP_CONDITION.match(item):
            codes = sorted(c.removeprefix("http_") for c in CONDITIONS if c.startswith("http_"))
            check.add(
                where,
                f"expected {alternatives(_CONDITION_ORDER)}, got {describe(item)};"
                f" only {', '.join(codes[:-1])} and {codes[-1]} responses can be retried",
            )
            valid = False
            continue
        condition = check.one_of(item, where, _CONDITION_ORDER)
        if condition is None:
            valid = False
        else:
            result.add(condition)
    return frozenset(result) if valid else None


# -- health checks --


def health_check(check: Checker, value: Any, path: str) -> HealthCheck | None:
    values = check.table(value, path, _HEALTH_CHECK_KEYS)
    if values is None:
        return None
    health = HealthCheck(**values)
    if health.timeout >= health.interval:
        where = "timeout" if "timeout" in values else "interval"
        check.add(
            join(path, where),
            f"expected timeout ({health.timeout:g}s) to be less than interval"
            f" ({health.interval:g}s), so that a check ends before the next one starts;"
            " lower timeout or raise interval",
        )
        return None
    return health


def request_path(check: Checker, value: Any, path: str) -> str | None:
    if not isinstance(value, str) or not _REQUEST_PATH.match(value):
        check.add(path, f'expected a request path starting with "/", got {describe(value)}')
        return None
    return value


def status_code(check: Checker, value: Any, path: str) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 100 <= value <= 599:
        check.add(path, f"expected an HTTP status code in 100..599, got {describe(value)}")
        return None
    return value


# -- timeouts and headers --


def group_timeouts(check: Checker, value: Any, path: str) -> GroupTimeouts | None:
    result: GroupTimeouts | None = check.record(GroupTimeouts, value, path, _GROUP_TIMEOUTS_KEYS)
    return result


def set_headers(check: Checker, value: Any, path: str) -> tuple[HeaderRule, ...] | None:
    if not isinstance(value, Mapping):
        check.add(
            path,
            'expected a table of header names to values, e.g. { "X-Chat-ID" = "$session_key" },'
            f" got {describe(value)}",
        )
        return None
    rules: list[HeaderRule] = []
    seen: dict[str, str] = {}
    valid = True
    for name, template in value.items():
        where = join(path, name)
        lower = name.lower()
        if not TOKEN.match(name):
            check.add(
                where, f"expected a header name (a token: {TOKEN_CHARS}), got {describe(name)}"
            )
            valid = False
        elif lower in _PROXY_HEADERS:
            check.add(
                where,
                "the proxy manages this header (message framing or hop-by-hop);"
                " remove it from set_headers",
            )
            valid = False
        elif lower in seen:
            check.add(
                where,
                f"{describe(name)} is already set by {seen[lower]} (header names ignore case);"
                " keep one",
            )
            valid = False
        seen.setdefault(lower, where)
        if not _template(check, template, where):
            valid = False
        elif valid:
            rules.append(HeaderRule(name=lower, value=template))
    return tuple(rules) if valid else None


def _template(check: Checker, value: Any, path: str) -> bool:
    """Check a header value template; True when it is valid."""
    if not isinstance(value, str):
        check.add(path, f'expected a string, e.g. "$session_key", got {describe(value)}')
        return False
    if _CONTROL.search(value):
        check.add(
            path,
            f"expected a header value without control characters or line breaks,"
            f" got {describe(value)}",
        )
        return False
    valid = True
    for match in _VARIABLE.finditer(value):
        name = match[1]
        if name in _VARIABLES or any(
            name.startswith(prefix) and len(name) > len(prefix) for prefix in _VARIABLE_PREFIXES
        ):
            continue
        if not name:
            message = f'"$" without a variable name in {describe(value)}'
        else:
            message = f'unknown variable "${name}" in {describe(value)}'
        message += f"; expected {_EXPECTED_VARIABLES}"
        from difflib import get_close_matches  # on a mistake only (``Checker.one_of``)

        close = get_close_matches(name, _VARIABLES, 1) if name else []
        if close:
            message += f'; did you mean "${close[0]}"?'
        check.add(path, message)
        valid = False
    return valid


# -- LLM-aware balancing and admission --


def affinity(check: Checker, value: Any, path: str) -> AffinityMode | None:
    choice = check.one_of(value, path, [member.value for member in AffinityMode])
    return None if choice is None else AffinityMode(choice)


def prefix_affinity(check: Checker, value: Any, path: str) -> PrefixAffinity | None:
    values = check.table(value, path, _PREFIX_KEYS)
    return None if values is None else PrefixAffinity(**values)


def prompt_source(check: Checker, value: Any, path: str) -> str | None:
    return check.one_of(value, path, PROMPT_SOURCES)


def load_factor(check: Checker, value: Any, path: str) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value <= 100:
        check.add(
            path,
            "expected a number from 1 to 100 (a server takes a new prefix while its streams"
            f" are under load_factor x the mean; 1.25 is usual), got {describe(value)}",
        )
        return None
    return float(value)


def balance_gap(check: Checker, value: Any, path: str) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        check.add(
            path,
            "expected an integer >= 1 (a server takes a new prefix only while within"
            " balance_gap streams of the least loaded one; about a quarter of an engine's"
            f" batch slots is usual), got {describe(value)}",
        )
        return None
    return value


def fraction(check: Checker, value: Any, path: str) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        check.add(path, f"expected a fraction in (0, 1], e.g. 0.95, got {describe(value)}")
        return None
    return float(value)


def load_reporting(check: Checker, value: Any, path: str) -> LoadReporting | None:
    values = check.table(value, path, _LOAD_REPORT_KEYS)
    if values is None:
        return None
    report = LoadReporting(**values)
    if report.poll_timeout >= report.interval:
        check.add(
            join(path, "timeout"),
            f"expected timeout ({report.poll_timeout:g}s) to be less than interval"
            f" ({report.interval:g}s), so that a poll ends before the next one starts;"
            " lower timeout or raise interval",
        )
        return None
    return report


def rate_limit(check: Checker, value: Any, path: str) -> RateLimit | None:
    values = check.table(value, path, _RATE_LIMIT_KEYS)
    if values is None:
        return None
    if not values:
        check.add(
            path,
            "sets no budget; expected tokens_per_minute = N, requests_per_minute = M"
            " and/or max_concurrent = C, or remove rate_limit",
        )
        return None
    return RateLimit(**values)


# The keys each kind of table may have. To add a setting: add the field to its record in
# records.py and a Key here with the function that checks its value.
_SERVER_KEYS = {
    "address": Key(Checker.address, required='"host:port"'),
    "weight": Key(weight),
    "max_fails": Key(max_fails),
    "fail_timeout": Key(Checker.seconds),
    "backup": Key(Checker.boolean),
    "protocol": Key(server_protocol),
    "max_connections": Key(max_connections),
    "tls": Key(Checker.boolean),
    "tls_ca": Key(Checker.file),
    "tls_server_name": Key(Checker.string),
    "max_streams": Key(Checker.positive_int),
    "max_waiting": Key(Checker.count),
    "kv_events": Key(kv_endpoint),
}
_NEXT_UPSTREAM_KEYS = {
    "on": Key(conditions),
    "tries": Key(Checker.positive_int),
    "tries_timeout": Key(Checker.seconds),
    "replay_buffer": Key(Checker.count),
}
_HEALTH_CHECK_KEYS = {
    "path": Key(request_path),
    "interval": Key(Checker.seconds),
    "timeout": Key(Checker.seconds),
    "passes": Key(Checker.positive_int),
    "fails": Key(Checker.positive_int),
    "expect_status": Key(status_code),
}
_DISCOVER_KEYS = discover_keys(_SERVER_KEYS)
discover = discover_parser(_DISCOVER_KEYS)
_UPSTREAM_KEYS = {
    "servers": Key(servers),
    "discover": Key(discover),
    "slow_start": Key(duration_or_zero),
    "pool_max_idle": Key(Checker.count),
    "pool_idle_timeout": Key(Checker.seconds),
    "balance": Key(balance),
    "sticky": Key(sticky),
    "next_upstream": Key(next_upstream),
    "health_check": Key(health_check),
    "set_headers": Key(set_headers),
    "timeouts": Key(group_timeouts),
    "default_max_tokens": Key(Checker.positive_int),
    "affinity": Key(affinity),
    "prefix": Key(prefix_affinity),
    "load_report": Key(load_reporting),
    "kv_events": Key(kv_events),
    "queue": Key(admission_queue),
    "tenant": Key(source),
    "priority": Key(source),
    "rate_limit": Key(rate_limit),
    "models": Key(model_names),
    "learn_models": Key(Checker.boolean),
    "models_refresh": Key(Checker.seconds),
}
_PREFIX_KEYS = {
    "source": Key(prompt_source),
    "length": Key(Checker.positive_int),
    "load_factor": Key(load_factor),
    "balance_gap": Key(balance_gap),
}
_LOAD_REPORT_KEYS = {
    "path": Key(request_path),
    "interval": Key(Checker.seconds),
    "timeout": Key(Checker.seconds),
    "kv_cache_limit": Key(fraction),
}
_GROUP_TIMEOUTS_KEYS = record_keys(GroupTimeouts, Checker.seconds)
_RATE_LIMIT_KEYS = {
    "tokens_per_minute": Key(Checker.positive_int),
    "requests_per_minute": Key(Checker.positive_int),
    "max_concurrent": Key(Checker.positive_int),
}
