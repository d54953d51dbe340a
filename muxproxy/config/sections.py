"""The top-level sections of a configuration file: the keys of ``[[listeners]]``,
``[timeouts]``, ``[limits]`` and ``[[routes]]`` (with a route's ``resume``), and the checks of the
listeners, the groups and the routes as arrays and tables.

Internal to :mod:`muxproxy.config`. Each ``*_KEYS`` mapping is what :mod:`.loading` checks its
table with and what the reference documents (:mod:`.layout`), so a key added here is in both at
once. The checks of one group's own keys live in :mod:`.upstreams`; the sections with a module
of their own (``[log]``, ``[admin]``, ``[resolver]``, ``[fleet]``) in theirs. Like every
checking module this one sits above :mod:`.checker` and below :mod:`.layout`: it imports no
module that reads the tables.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any

from muxproxy.config.checker import TOKEN, Checker, Key, describe, join, record_keys
from muxproxy.config.modelkeys import model_patterns
from muxproxy.config.records import Api, Limits, Listener, Resume, Route, Timeouts, Upstream
from muxproxy.config.storeurl import store_url
from muxproxy.config.tls import tls_pair_problems
from muxproxy.config.upstreams import upstream

__all__ = [
    "EXPECTED_LISTENERS",
    "LIMITS_KEYS",
    "LISTENER_KEYS",
    "RESUME_KEYS",
    "ROUTE_KEYS",
    "TIMEOUTS_KEYS",
    "api",
    "credential_headers",
    "listener_tables",
    "resume",
    "route_tables",
    "size",
    "trusted_proxies",
    "upstream_groups",
]

EXPECTED_LISTENERS = 'expected at least one [[listeners]] table with address = "host:port"'

TIMEOUTS_KEYS = record_keys(Timeouts, Checker.seconds)
LIMITS_KEYS = record_keys(Limits, Checker.positive_int)


def trusted_proxies(
    check: Checker, value: Any, path: str
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] | None:
    """``[[listeners]] trusted_proxies``: an array of CIDRs (``"10.0.0.0/8"``) or addresses
    (one host: ``/32``, ``/128``)."""
    items = check.array(value, path, 'an array of CIDRs, e.g. ["10.0.0.0/8", "127.0.0.1/32"]')
    if items is None:
        return None
    networks = []
    valid = True
    for index, item in enumerate(items):
        where = f"{path}[{index}]"
        if not isinstance(item, str):
            check.add(where, f'expected a CIDR such as "10.0.0.0/8", got {describe(item)}')
            valid = False
            continue
        try:
            networks.append(ipaddress.ip_network(item.strip()))
        except ValueError:
            valid = False
            try:
                loose = ipaddress.ip_network(item.strip(), strict=False)
            except ValueError:
                check.add(
                    where,
                    f'expected a CIDR such as "10.0.0.0/8" or an address such as "10.0.0.1",'
                    f" got {describe(item)}",
                )
            else:
                check.add(where, f'{describe(item)} has host bits set; write "{loose}"')
    return tuple(networks) if valid else None


LISTENER_KEYS = {
    "address": Key(Checker.listen_address, required='"host:port"'),
    "tls_cert": Key(Checker.file),
    "tls_key": Key(Checker.file),
    "trusted_proxies": Key(trusted_proxies),
}


def api(check: Checker, value: Any, path: str) -> Api | None:
    choice = check.one_of(value, path, [member.value for member in Api])
    return None if choice is None else Api(choice)


_SIZE = re.compile(r"\A\s*([0-9]+)\s*(B|KiB|MiB|GiB)?\s*\Z")
_SIZE_UNITS = {None: 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


def size(check: Checker, value: Any, path: str) -> int | None:
    """A positive number of bytes: an integer, or a string such as ``"256 KiB"``."""
    if isinstance(value, str) and (match := _SIZE.match(value)):
        value = int(match[1]) * _SIZE_UNITS[match[2]]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        check.add(
            path,
            'expected a positive size: bytes, or a string such as "256 KiB" or "1 MiB"'
            f" (units B, KiB, MiB, GiB), got {describe(value)}",
        )
        return None
    return value


def credential_headers(check: Checker, value: Any, path: str) -> tuple[str, ...] | None:
    """Header names (tokens, RFC 9110 §5.1), kept in lower case: the fields a resume is bound
    to (``core/streams/resumebind.py``)."""
    expected = 'expected a list of header names such as ["authorization", "x-api-key"]'
    if not isinstance(value, list):
        check.add(path, f"{expected}, got {describe(value)}")
        return None
    names: list[str] = []
    for index, name in enumerate(value):
        if not isinstance(name, str) or not TOKEN.match(name):
            check.add(
                f"{path}[{index}]",
                f"{expected}; each a token (letters, digits and !#$%&'*+-.^_`|~),"
                f" got {describe(name)}",
            )
            return None
        if name.lower() not in names:
            names.append(name.lower())
    return tuple(names)


RESUME_KEYS = {
    "window": Key(size),
    "linger": Key(Checker.seconds),
    "store": Key(store_url),
    "credential_headers": Key(credential_headers),
    "lease": Key(Checker.seconds),
}


def resume(check: Checker, value: Any, path: str) -> Resume | None:
    """``resume = true`` (the defaults) or a table of :data:`RESUME_KEYS`."""
    if value is True:
        return Resume()
    if value is False:
        check.add(
            path,
            'expected true or a table such as { window = "256 KiB", linger = 30 };'
            " leave the key out to turn resume off",
        )
        return None
    values = check.table(value, path, RESUME_KEYS, "true or a table such as { linger = 30 }")
    if values is None:
        return None
    return Resume(**values)


ROUTE_KEYS = {
    "prefix": Key(Checker.prefix, required='a path prefix starting with "/"'),
    "upstream": Key(Checker.name, required="the name of an upstream group"),
    "retry_until_first_event": Key(Checker.boolean),
    "sse_heartbeat": Key(Checker.seconds),
    "continue_on_failure": Key(Checker.boolean),
    "resume": Key(resume),
    "api": Key(api),
    "models": Key(model_patterns),
}


def listener_tables(check: Checker, value: Any) -> tuple[Listener, ...] | None:
    items = check.array(value, "listeners", "an array of [[listeners]] tables")
    if items is None:
        return None
    if not items:
        check.add("listeners", EXPECTED_LISTENERS + ", got an empty array")
        return None
    listeners: list[Listener] = []
    seen: dict[tuple[str, int], str] = {}
    valid = True
    for index, item in enumerate(items):
        path = f"listeners[{index}]"
        values = check.table(item, path, LISTENER_KEYS)
        if isinstance(item, Mapping) and ("tls_cert" in item) != ("tls_key" in item):
            given, missing = (
                ("tls_cert", "tls_key") if "tls_cert" in item else ("tls_key", "tls_cert")
            )
            check.add(
                f"{path}.{missing}",
                f"missing; {given} is set, and TLS needs both tls_cert and tls_key",
            )
            values = None
        if values is None:
            valid = False
            continue
        if "tls_cert" in values:
            problems = tls_pair_problems(values["tls_cert"], values["tls_key"])
            for which, message in problems:
                check.add(f"{path}.tls_{which}", message)
            if problems:
                valid = False
                continue
        listener = Listener(**values)
        if listener.port != 0:
            key = (listener.host, listener.port)
            if key in seen:
                check.add(
                    f"{path}.address",
                    f"{describe(listener.address)} is already used by {seen[key]}",
                )
                valid = False
            seen.setdefault(key, path)
        listeners.append(listener)
    return tuple(listeners) if valid else None


def upstream_groups(check: Checker, value: Any, names: list[str]) -> dict[str, Upstream] | None:
    """The ``[upstreams.NAME]`` groups; ``names`` receives every group name, even invalid."""
    if not isinstance(value, Mapping):
        check.add("upstreams", f"expected a table of groups, got {describe(value)}")
        return None
    if not value:
        check.add("upstreams", "expected at least one group, e.g. [upstreams.gpus]")
        return None
    groups: dict[str, Upstream] = {}
    valid = True
    for name, item in value.items():
        names.append(name)
        path = join("upstreams", name)
        if not name:
            check.add(path, "expected a non-empty group name")
            valid = False
            continue
        group = upstream(check, name, item, path)
        if group is None:
            valid = False
            continue
        groups[name] = group
    return groups if valid else None


def route_tables(check: Checker, value: Any, names: list[str]) -> tuple[Route, ...] | None:
    if value is None or value == []:
        if len(names) == 1:
            return (Route(prefix="/", upstream=names[0]),)
        if len(names) > 1:
            check.add(
                "routes",
                f"missing; with several upstream groups ({', '.join(sorted(names))}) "
                "each request needs a route: add [[routes]] tables with prefix and upstream",
            )
        return None
    items = check.array(value, "routes", "an array of [[routes]] tables")
    if items is None:
        return None
    routes: list[Route] = []
    seen: dict[str, str] = {}
    valid = True
    for index, item in enumerate(items):
        path = f"routes[{index}]"
        values = check.table(item, path, ROUTE_KEYS)
        # An unknown group is reported even when another key of this route is invalid.
        group = item.get("upstream") if isinstance(item, Mapping) else None
        if isinstance(group, str) and group and group not in names:
            advice = f"define [{join('upstreams', group)}]"
            if names:
                advice += " or use one of: " + ", ".join(sorted(names))
            check.add(f"{path}.upstream", f"no upstream named {describe(group)}; {advice}")
            valid = False
        if values is None:
            valid = False
            continue
        route = Route(**values)
        if route.models:
            routes.append(route)  # several routes of one prefix may serve different models
            continue
        if route.prefix in seen:
            check.add(
                f"{path}.prefix",
                f"{describe(route.prefix)} is already routed by {seen[route.prefix]}; give"
                " one of them models = [...] to route the prefix by model",
            )
            valid = False
        seen.setdefault(route.prefix, path)
        routes.append(route)
    return tuple(routes) if valid else None
