"""Validation of ``[fleet]`` (the shared store) and ``[resolver]`` (the DNS servers discovery
asks); the records are in :mod:`.fleet`.

A nameserver is an IP address (a name would need DNS to find DNS), with an optional port
(53, RFC 1035 §4.2, when left out), kept as ``host:port`` (``[v6]:port``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any

from muxproxy.config.checker import Checker, Key, describe
from muxproxy.config.fleet import FleetSettings, StoreErrorPolicy
from muxproxy.config.storeurl import store_url

__all__ = ["FLEET_KEYS", "FLEET_STORE_ENV", "RESOLVER_KEYS", "fleet_settings"]

FLEET_STORE_ENV = "MUXPROXY_FLEET_STORE"
"""When set and not empty, the store's URL, winning over ``[fleet] store`` (and making a
``[fleet]`` table of the defaults when the file has none): a URL with a password can then
come from a Secret rather than a file that is checked in."""


def _store_error(check: Checker, value: Any, path: str) -> StoreErrorPolicy | None:
    choice = check.one_of(value, path, [p.value for p in StoreErrorPolicy])
    return None if choice is None else StoreErrorPolicy(choice)


FLEET_KEYS = {
    "store": Key(store_url, required='a Redis URL such as "redis://redis:6379/0"'),
    "on_store_error": Key(_store_error),
    "sync_interval": Key(Checker.seconds),
}


def _nameserver(value: Any) -> str | None:
    """``value`` as ``host:port`` when it is an IP address with an optional port (53 when
    left out); None when it is not one."""
    if not isinstance(value, str):
        return None
    host, port = value, 53
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                return None
            port = int(rest[1:])
    elif value.count(":") == 1:
        host, _, text = value.partition(":")
        if not text.isdigit():
            return None
        port = int(text)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if not 0 < port < 65536:
        return None
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


def _nameservers(check: Checker, value: Any, path: str) -> tuple[str, ...] | None:
    items = check.array(value, path, 'an array of DNS server addresses such as "10.96.0.10:53"')
    if items is None:
        return None
    out: list[str] = []
    for index, item in enumerate(items):
        normal = _nameserver(item)
        if normal is None:
            check.add(
                f"{path}[{index}]",
                'expected an IP address with an optional port, such as "10.96.0.10:53",'
                f' "10.96.0.10" or "[fd00::a]:53" (a name would need DNS itself), got'
                f" {describe(item)}",
            )
            return None
        out.append(normal)
    return tuple(out)


RESOLVER_KEYS = {
    "nameservers": Key(_nameservers),
    "timeout": Key(Checker.seconds),
    "attempts": Key(Checker.positive_int),
}


def fleet_settings(check: Checker, value: Any, environ: Mapping[str, str]) -> FleetSettings | None:
    """The ``[fleet]`` table (``value``, None when the file has none), its store taken from
    :data:`FLEET_STORE_ENV` in ``environ`` when set there. None: no fleet."""
    url = environ.get(FLEET_STORE_ENV)
    if url:
        if store_url(check, url, FLEET_STORE_ENV) is None:
            return None
        if value is not None and not isinstance(value, Mapping):
            check.add("fleet", f"expected a table, got {describe(value)}")
            return None
        value = {**(value or {}), "store": url}
    if value is None:
        return None
    settings: FleetSettings | None = check.record(FleetSettings, value, "fleet", FLEET_KEYS)
    return settings
