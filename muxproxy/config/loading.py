"""Loading a configuration: the TOML file, the top-level sections, and the ``serve`` flags.

:func:`load_config` reads a TOML file, :func:`parse_config` validates an already parsed table,
:func:`parse_quick_config` validates the flag form of ``muxproxy serve``. All three raise
:class:`ConfigError`, which carries *every* problem found. The checks of one upstream group
live in :mod:`.upstreams`, the machinery in :mod:`.checker`.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from typing import Any

from .admin import admin_settings, quick_admin
from .checker import TOKEN, Checker, Key, describe, join, record_keys
from .fleet import ResolverSettings
from .fleetkeys import RESOLVER_KEYS, fleet_settings
from .logs import log_settings
from .records import (
    AdminSettings,
    Api,
    Config,
    Limits,
    Listener,
    Resume,
    Route,
    Server,
    Timeouts,
    Upstream,
)
from .storeurl import store_url
from .tls import tls_pair_problems
from .upstreams import upstream

__all__ = ["ConfigError", "load_config", "parse_config", "parse_quick_config"]


class ConfigError(Exception):
    """An invalid configuration. ``problems`` holds every problem found, one message each.

    Each message starts with the key path it is about (``timeouts.read``,
    ``upstreams.gpus.servers[1]``; the flag for :func:`parse_quick_config`; the file for
    unreadable or malformed files) and says what is expected. ``source`` is the file, when
    there is one.
    """

    def __init__(self, problems: Iterable[str], *, source: str | None = None) -> None:
        self.problems: list[str] = list(problems)
        self.source = source
        super().__init__(self.problems)

    def __str__(self) -> str:
        head = "invalid configuration"
        if self.source is not None:
            head = f"{self.source}: {head}"
        return "\n".join([head, *(f"  {problem}" for problem in self.problems)])


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read, parse and validate the TOML configuration file at ``path``.

    Relative ``tls_cert``/``tls_key`` paths are taken relative to the file's directory.
    Raises :class:`ConfigError` for a missing or unreadable file, a TOML syntax error (with
    its line and column) and every invalid setting.
    """
    name = os.fspath(path)
    try:
        with open(name, "rb") as file:
            raw = file.read()
    except FileNotFoundError:
        raise ConfigError([f"{name}: no such file"], source=name) from None
    except IsADirectoryError:
        raise ConfigError([f"{name}: is a directory, expected a TOML file"], source=name) from None
    except OSError as exc:
        raise ConfigError([f"{name}: cannot read: {exc.strerror or exc}"], source=name) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            [f"{name}, line {line}: invalid TOML: not UTF-8 text"], source=name
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        where, message = _toml_error_location(exc, text)
        raise ConfigError([f"{name}, {where}: invalid TOML: {message}"], source=name) from None
    except RecursionError:
        # tomllib parses nested arrays and inline tables recursively; no configuration
        # nests more than a few levels.
        raise ConfigError(
            [f"{name}: invalid TOML: arrays or inline tables nested too deeply"], source=name
        ) from None
    try:
        return parse_config(data, base_dir=os.path.dirname(name) or None)
    except ConfigError as exc:
        raise ConfigError(exc.problems, source=name) from None


def parse_config(
    data: Mapping[str, Any],
    *,
    base_dir: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Validate an already parsed TOML document (a ``dict``) and build the :class:`Config`.

    ``base_dir`` is where relative TLS file and state file paths start (default: the working
    directory). ``environ`` (default ``os.environ``) may hold ``MUXPROXY_ADMIN_TOKEN``, which
    wins over ``[admin] token``, and ``MUXPROXY_FLEET_STORE``, which wins over ``[fleet]
    store``. Raises :class:`ConfigError` listing every problem found.
    """
    check = Checker(base_dir)
    suggested = check.unknown_keys(data, _TOP_KEYS, "")

    listeners = None
    if "listeners" in data:
        listeners = _listeners(check, data["listeners"])
    elif "listeners" not in suggested:
        check.add("listeners", "missing; " + _EXPECTED_LISTENERS)
    timeouts = check.record(Timeouts, data.get("timeouts", {}), "timeouts", _TIMEOUTS_KEYS)
    limits = check.record(Limits, data.get("limits", {}), "limits", _LIMITS_KEYS)
    names: list[str] = []
    upstreams = None
    if "upstreams" in data:
        upstreams = _upstreams(check, data["upstreams"], names)
    elif "upstreams" not in suggested:
        check.add("upstreams", "missing; " + _EXPECTED_UPSTREAMS)
    routes = _routes(check, data.get("routes"), names)
    log = log_settings(check, data.get("log", {}))
    admin = None
    if "admin" in data:
        environ = os.environ if environ is None else environ
        admin = admin_settings(check, data["admin"], "admin", environ)
    resolver = check.record(ResolverSettings, data.get("resolver", {}), "resolver", RESOLVER_KEYS)
    fleet = fleet_settings(check, data.get("fleet"), os.environ if environ is None else environ)

    if check.problems:
        raise ConfigError(check.problems)
    assert listeners is not None and upstreams is not None and routes is not None
    assert timeouts is not None and limits is not None and log is not None
    assert resolver is not None
    return Config(
        listeners=listeners,
        upstreams=upstreams,
        routes=routes,
        timeouts=timeouts,
        limits=limits,
        log=log,
        admin=admin,
        resolver=resolver,
        fleet=fleet,
    )


def parse_quick_config(
    listen: str,
    upstreams: list[str],
    *,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    admin: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """:func:`quick_config` with validation; problems are named by their flag (``--listen``).

    The flag form of ``muxproxy serve``; ``admin`` is ``--admin ADDRESS``, its token taken
    from ``MUXPROXY_ADMIN_TOKEN`` in ``environ`` (default ``os.environ``). Raises
    :class:`ConfigError`.
    """
    check = Checker(None)
    check.address(listen, "--listen", allow_port_zero=True)
    if not upstreams:
        check.add("--upstream", 'missing; expected at least one "host:port"')
    for address in upstreams:
        check.address(address, "--upstream")
    cert = None if tls_cert is None else check.file(tls_cert, "--tls-cert")
    key = None if tls_key is None else check.file(tls_key, "--tls-key")
    if cert is not None and key is not None:
        flags = ("--tls-cert", "--tls-key")
        for which, message in tls_pair_problems(cert, key, flags):
            check.add(flags[0] if which == "cert" else flags[1], message)
    if (tls_cert is None) != (tls_key is None):
        given, missing = (
            ("--tls-cert", "--tls-key") if tls_key is None else ("--tls-key", "--tls-cert")
        )
        check.add(
            missing, f"missing; {given} is given, and TLS needs both --tls-cert and --tls-key"
        )
    settings = None
    if admin is not None:
        settings = quick_admin(check, admin, os.environ if environ is None else environ)
    if check.problems:
        raise ConfigError(check.problems)
    return quick_config(listen, upstreams, tls_cert=tls_cert, tls_key=tls_key, admin=settings)


_TOP_KEYS = (
    "listeners",
    "timeouts",
    "limits",
    "upstreams",
    "routes",
    "log",
    "admin",
    "resolver",
    "fleet",
)
_EXPECTED_LISTENERS = 'expected at least one [[listeners]] table with address = "host:port"'
_EXPECTED_UPSTREAMS = (
    'expected at least one group, e.g. [upstreams.gpus] with servers = ["127.0.0.1:9001"]'
)
_TOML_ERROR = re.compile(r"(?s)(.*) \(at line (\d+), column (\d+)\)\Z")

_TIMEOUTS_KEYS = record_keys(Timeouts, Checker.seconds)
_LIMITS_KEYS = record_keys(Limits, Checker.positive_int)


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


_LISTENER_KEYS = {
    "address": Key(Checker.listen_address, required='"host:port"'),
    "tls_cert": Key(Checker.file),
    "tls_key": Key(Checker.file),
    "trusted_proxies": Key(trusted_proxies),
}


def _api(check: Checker, value: Any, path: str) -> Api | None:
    choice = check.one_of(value, path, [member.value for member in Api])
    return None if choice is None else Api(choice)


_SIZE = re.compile(r"\A\s*([0-9]+)\s*(B|KiB|MiB|GiB)?\s*\Z")
_SIZE_UNITS = {None: 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


def _size(check: Checker, value: Any, path: str) -> int | None:
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


def _credential_headers(check: Checker, value: Any, path: str) -> tuple[str, ...] | None:
    """Header names (tokens, RFC 9110 §5.1), kept in lower case: the fields a resume is bound
    to (``core/resumebind.py``)."""
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


_RESUME_KEYS = {
    "window": Key(_size),
    "linger": Key(Checker.seconds),
    "store": Key(store_url),
    "credential_headers": Key(_credential_headers),
    "lease": Key(Checker.seconds),
}


def _resume(check: Checker, value: Any, path: str) -> Resume | None:
    """``resume = true`` (the defaults) or a table of :data:`_RESUME_KEYS`."""
    if value is True:
        return Resume()
    if value is False:
        check.add(
            path,
            'expected true or a table such as { window = "256 KiB", linger = 30 };'
            " leave the key out to turn resume off",
        )
        return None
    values = check.table(value, path, _RESUME_KEYS, "true or a table such as { linger = 30 }")
    if values is None:
        return None
    return Resume(**values)


_ROUTE_KEYS = {
    "prefix": Key(Checker.prefix, required='a path prefix starting with "/"'),
    "upstream": Key(Checker.name, required="the name of an upstream group"),
    "retry_until_first_event": Key(Checker.boolean),
    "sse_heartbeat": Key(Checker.seconds),
    "continue_on_failure": Key(Checker.boolean),
    "resume": Key(_resume),
    "api": Key(_api),
}


def _listeners(check: Checker, value: Any) -> tuple[Listener, ...] | None:
    items = check.array(value, "listeners", "an array of [[listeners]] tables")
    if items is None:
        return None
    if not items:
        check.add("listeners", _EXPECTED_LISTENERS + ", got an empty array")
        return None
    listeners: list[Listener] = []
    seen: dict[tuple[str, int], str] = {}
    valid = True
    for index, item in enumerate(items):
        path = f"listeners[{index}]"
        values = check.table(item, path, _LISTENER_KEYS)
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


def _upstreams(check: Checker, value: Any, names: list[str]) -> dict[str, Upstream] | None:
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


def _routes(check: Checker, value: Any, names: list[str]) -> tuple[Route, ...] | None:
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
        values = check.table(item, path, _ROUTE_KEYS)
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
        if route.prefix in seen:
            check.add(
                f"{path}.prefix",
                f"{describe(route.prefix)} is already routed by {seen[route.prefix]}",
            )
            valid = False
        seen.setdefault(route.prefix, path)
        routes.append(route)
    return tuple(routes) if valid else None


def _toml_error_location(exc: tomllib.TOMLDecodeError, text: str) -> tuple[str, str]:
    """(``"line L, column C"``, message) of a TOML syntax error."""
    lineno = getattr(exc, "lineno", None)  # Python >= 3.14
    if isinstance(lineno, int):
        return f"line {lineno}, column {getattr(exc, 'colno', 0)}", str(getattr(exc, "msg", exc))
    message = str(exc)
    match = _TOML_ERROR.match(message)
    if match is not None:
        return f"line {match[2]}, column {match[3]}", match[1]
    suffix = " (at end of document)"
    if message.endswith(suffix):
        return f"line {text.count(chr(10)) + 1} (end of file)", message.removesuffix(suffix)
    return "line ?", message


def quick_config(
    listen: str,
    upstreams: list[str],
    *,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    admin: AdminSettings | None = None,
) -> Config:
    """The configuration of ``muxproxy serve --listen A --upstream B ...``: one route, one group."""
    group = Upstream(name="default", servers=tuple(Server(address=a) for a in upstreams))
    return Config(
        listeners=(Listener(address=listen, tls_cert=tls_cert, tls_key=tls_key),),
        upstreams={"default": group},
        routes=(Route(prefix="/", upstream="default"),),
        admin=admin,
    )
