"""Configuration: attrs records the core reads, and TOML loading with validation.

Every record is frozen: a new configuration is a new object (``ConfigChanged``), never a
mutation under a running exchange. Durations are seconds (float), sizes bytes (int).

Loading: :func:`load_config` reads a TOML file, :func:`parse_config` validates an already
parsed table, :func:`parse_quick_config` validates the flag form of ``muxproxy serve``. All
three raise :class:`ConfigError`, which carries *every* problem found, each message naming
the key path and what was expected::

    upstreams.gpus.servers[1]: expected "host:port", got "localhost"
    timeouts.raed: unknown key; did you mean "read"?

The records themselves carry no validators: code may build them directly (tests do, with
port 0 and tiny timeouts); validation is the job of the loading functions.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class Timeouts:
    connect: float = 5.0
    """Seconds to establish an upstream TCP (and TLS) connection."""
    response_head: float = 60.0
    """Seconds from the request being sent upstream to the response head arriving."""
    read: float = 300.0
    """Longest idle gap between two upstream body chunks."""
    send: float = 60.0
    """Longest time a connection may have unsent output without any of it being written."""
    client_header: float = 30.0
    """Seconds a client has to send a complete request head."""
    keepalive_idle: float = 75.0
    """Seconds an idle client connection is kept open between requests."""


@attrs.frozen(kw_only=True)
class Limits:
    stream_buffer: int = 256 * 1024
    """Bytes one stream may hold in the proxy (accepted from its source, not yet sent on)."""
    max_concurrent_streams: int = 100
    """SETTINGS_MAX_CONCURRENT_STREAMS advertised to HTTP/2 clients."""
    max_request_head: int = 64 * 1024
    """Largest request head (HTTP/1.1 request line + fields)."""


@attrs.frozen(kw_only=True)
class Server:
    address: str
    """``host:port`` of the backend."""

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


@attrs.frozen(kw_only=True)
class Upstream:
    name: str
    servers: tuple[Server, ...]
    pool_max_idle: int = 32
    """Idle keep-alive connections kept per backend."""
    pool_idle_timeout: float = 60.0
    """Seconds an idle pooled connection is kept before it is closed."""


@attrs.frozen(kw_only=True)
class Route:
    prefix: str
    upstream: str


@attrs.frozen(kw_only=True)
class Listener:
    address: str
    tls_cert: str | None = None
    tls_key: str | None = None

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


@attrs.frozen(kw_only=True)
class Config:
    listeners: tuple[Listener, ...]
    upstreams: dict[str, Upstream]
    routes: tuple[Route, ...]
    timeouts: Timeouts = Timeouts()
    limits: Limits = Limits()

    def route_for(self, path: bytes) -> Upstream | None:
        """The upstream group of the longest route prefix matching ``path``."""
        text = path.decode("latin-1")
        best: Route | None = None
        for route in self.routes:
            if text.startswith(route.prefix) and (
                best is None or len(route.prefix) > len(best.prefix)
            ):
                best = route
        return None if best is None else self.upstreams[best.upstream]


def quick_config(
    listen: str,
    upstreams: list[str],
    *,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> Config:
    """The configuration of ``muxproxy serve --listen A --upstream B ...``: one route, one group."""
    group = Upstream(name="default", servers=tuple(Server(address=a) for a in upstreams))
    return Config(
        listeners=(Listener(address=listen, tls_cert=tls_cert, tls_key=tls_key),),
        upstreams={"default": group},
        routes=(Route(prefix="/", upstream="default"),),
    )


# --- loading and validation -------------------------------------------------------------------


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
    try:
        return parse_config(data, base_dir=os.path.dirname(name) or None)
    except ConfigError as exc:
        raise ConfigError(exc.problems, source=name) from None


def parse_config(data: Mapping[str, Any], *, base_dir: str | None = None) -> Config:
    """Validate an already parsed TOML document (a ``dict``) and build the :class:`Config`.

    ``base_dir`` is where relative TLS file paths start (default: the working directory).
    Raises :class:`ConfigError` listing every problem found.
    """
    check = _Checker(base_dir)
    suggested = check.unknown_keys(data, _TOP_KEYS, "")

    listeners = None
    if "listeners" in data:
        listeners = check.listeners(data["listeners"])
    elif "listeners" not in suggested:
        check.add("listeners", "missing; " + _EXPECTED_LISTENERS)
    timeouts = check.record(Timeouts, data.get("timeouts", {}), "timeouts", _Checker.seconds)
    limits = check.record(Limits, data.get("limits", {}), "limits", _Checker.positive_int)
    names: list[str] = []
    upstreams = None
    if "upstreams" in data:
        upstreams = check.upstreams(data["upstreams"], names)
    elif "upstreams" not in suggested:
        check.add("upstreams", "missing; " + _EXPECTED_UPSTREAMS)
    routes = check.routes(data.get("routes"), names)

    if check.problems:
        raise ConfigError(check.problems)
    assert listeners is not None and upstreams is not None and routes is not None
    assert timeouts is not None and limits is not None
    return Config(
        listeners=listeners,
        upstreams=upstreams,
        routes=routes,
        timeouts=timeouts,
        limits=limits,
    )


def parse_quick_config(
    listen: str,
    upstreams: list[str],
    *,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> Config:
    """:func:`quick_config` with validation; problems are named by their flag (``--listen``).

    The flag form of ``muxproxy serve``. Raises :class:`ConfigError`.
    """
    check = _Checker(None)
    check.address(listen, "--listen", allow_port_zero=True)
    if not upstreams:
        check.add("--upstream", 'missing; expected at least one "host:port"')
    for upstream in upstreams:
        check.address(upstream, "--upstream")
    if tls_cert is not None:
        check.file(tls_cert, "--tls-cert")
    if tls_key is not None:
        check.file(tls_key, "--tls-key")
    if (tls_cert is None) != (tls_key is None):
        given, missing = (
            ("--tls-cert", "--tls-key") if tls_key is None else ("--tls-key", "--tls-cert")
        )
        check.add(
            missing, f"missing; {given} is given, and TLS needs both --tls-cert and --tls-key"
        )
    if check.problems:
        raise ConfigError(check.problems)
    return quick_config(listen, upstreams, tls_cert=tls_cert, tls_key=tls_key)


def address_problem(value: object, *, allow_port_zero: bool = False) -> str | None:
    """What is wrong with ``value`` as a ``"host:port"`` address (``"[::1]:8080"`` for IPv6).

    Returns the message (``expected "host:port", got "localhost"``), or None when it is
    valid. Ports run 1..65535; ``allow_port_zero`` (listeners) also admits 0, "any free port".
    """
    if not isinstance(value, str):
        return f'expected "host:port", got {_describe(value)}'
    got = _describe(value)
    host, colon, port = value.rpartition(":")
    if not colon or not host or not port:
        return f'expected "host:port", got {got}'
    if host.startswith("[") or host.endswith("]"):
        inner = host[1:-1] if host.startswith("[") and host.endswith("]") else None
        try:
            ipaddress.IPv6Address(inner or "")
        except ValueError:
            return f'expected "host:port" with an IPv6 host such as "[::1]:8080", got {got}'
    elif ":" in host:
        return f'expected "host:port" with an IPv6 host in brackets, e.g. "[::1]:8080", got {got}'
    elif not _HOST_NAME.match(host):
        return f'expected "host:port" with a host name or IP address, got {got}'
    lowest = 0 if allow_port_zero else 1
    if not _PORT.match(port) or not lowest <= int(port) <= 65535:
        return f'expected "host:port" with a port in {lowest}..65535, got {got}'
    return None


_TOP_KEYS = ("listeners", "timeouts", "limits", "upstreams", "routes")
_EXPECTED_LISTENERS = 'expected at least one [[listeners]] table with address = "host:port"'
_EXPECTED_UPSTREAMS = (
    'expected at least one group, e.g. [upstreams.gpus] with servers = ["127.0.0.1:9001"]'
)
_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")
_PORT = re.compile(r"[0-9]{1,5}\Z")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+\Z")
_TOML_ERROR = re.compile(r"(?s)(.*) \(at line (\d+), column (\d+)\)\Z")

_ValueParser = Callable[["_Checker", Any, str], Any]
"""Checks one value at a key path: the converted value, or None after reporting a problem."""


@attrs.frozen
class _Key:
    """One key of a table: how its value is checked, and whether it must be there."""

    parse: _ValueParser
    required: str | None = None
    """None: optional. Otherwise the key is required, and this says what is expected."""


class _Checker:
    """Validates the parts of a configuration, collecting problems instead of stopping."""

    def __init__(self, base_dir: str | None) -> None:
        self.base_dir = base_dir
        self.problems: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}")

    # -- tables --

    def unknown_keys(self, table: Mapping[str, Any], known: Iterable[str], path: str) -> set[str]:
        """Report the keys of ``table`` not in ``known``; returns the known keys suggested."""
        known = list(known)
        suggested: set[str] = set()
        for key in table:
            if key in known:
                continue
            close = difflib.get_close_matches(key, known, n=1)
            suggested.update(close)
            hint = (
                f'did you mean "{close[0]}"?' if close else "expected one of: " + ", ".join(known)
            )
            self.add(_join(path, key), f"unknown key; {hint}")
        return suggested

    def table(
        self, value: Any, path: str, keys: Mapping[str, _Key], what: str = "a table"
    ) -> dict[str, Any] | None:
        """Check a table against its ``keys``: the converted values of the keys present."""
        if not isinstance(value, Mapping):
            self.add(path, f"expected {what}, got {_describe(value)}")
            return None
        suggested = self.unknown_keys(value, keys, path)
        out: dict[str, Any] = {}
        valid = True
        for key, spec in keys.items():
            if key in value:
                converted = spec.parse(self, value[key], _join(path, key))
                if converted is None:
                    valid = False
                else:
                    out[key] = converted
            elif spec.required is not None:
                if key not in suggested:  # "did you mean" already points at it
                    self.add(_join(path, key), f"missing; expected {spec.required}")
                valid = False
        return out if valid else None

    def array(self, value: Any, path: str, what: str) -> list[Any] | None:
        if not isinstance(value, list):
            self.add(path, f"expected {what}, got {_describe(value)}")
            return None
        return value

    def record(self, cls: type[Any], value: Any, path: str, parse: _ValueParser) -> Any:
        """A :class:`Timeouts`-like record whose fields are all checked by ``parse``."""
        keys = {field.name: _Key(parse) for field in attrs.fields(cls)}
        values = self.table(value, path, keys)
        return None if values is None else cls(**values)

    # -- values --

    def seconds(self, value: Any, path: str) -> float | None:
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            self.add(path, f"expected a positive number of seconds, got {_describe(value)}")
            return None
        return float(value)

    def positive_int(self, value: Any, path: str) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            self.add(path, f"expected a positive integer, got {_describe(value)}")
            return None
        return value

    def count(self, value: Any, path: str) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            self.add(path, f"expected an integer >= 0, got {_describe(value)}")
            return None
        return value

    def address(self, value: Any, path: str, *, allow_port_zero: bool = False) -> str | None:
        problem = address_problem(value, allow_port_zero=allow_port_zero)
        if problem is not None:
            self.add(path, problem)
            return None
        assert isinstance(value, str)
        return value

    def listen_address(self, value: Any, path: str) -> str | None:
        return self.address(value, path, allow_port_zero=True)

    def file(self, value: Any, path: str) -> str | None:
        if not isinstance(value, str) or not value:
            self.add(path, f"expected a file path, got {_describe(value)}")
            return None
        resolved = value
        if self.base_dir is not None and not os.path.isabs(value):
            resolved = os.path.join(self.base_dir, value)
        if os.path.isdir(resolved):
            self.add(path, f"expected a file, got the directory {_describe(resolved)}")
            return None
        if not os.path.isfile(resolved):
            self.add(path, f"file not found: {_describe(resolved)}")
            return None
        return resolved

    def prefix(self, value: Any, path: str) -> str | None:
        if not isinstance(value, str) or not value.startswith("/"):
            self.add(path, f'expected a path prefix starting with "/", got {_describe(value)}')
            return None
        return value

    def name(self, value: Any, path: str) -> str | None:
        if not isinstance(value, str) or not value:
            self.add(path, f"expected the name of an upstream group, got {_describe(value)}")
            return None
        return value

    # -- sections --

    def listeners(self, value: Any) -> tuple[Listener, ...] | None:
        items = self.array(value, "listeners", "an array of [[listeners]] tables")
        if items is None:
            return None
        if not items:
            self.add("listeners", _EXPECTED_LISTENERS + ", got an empty array")
            return None
        listeners: list[Listener] = []
        seen: dict[tuple[str, int], str] = {}
        valid = True
        for index, item in enumerate(items):
            path = f"listeners[{index}]"
            values = self.table(item, path, _LISTENER_KEYS)
            if isinstance(item, Mapping) and ("tls_cert" in item) != ("tls_key" in item):
                given, missing = (
                    ("tls_cert", "tls_key") if "tls_cert" in item else ("tls_key", "tls_cert")
                )
                self.add(
                    f"{path}.{missing}",
                    f"missing; {given} is set, and TLS needs both tls_cert and tls_key",
                )
                values = None
            if values is None:
                valid = False
                continue
            listener = Listener(**values)
            if listener.port != 0:
                key = (listener.host, listener.port)
                if key in seen:
                    self.add(
                        f"{path}.address",
                        f"{_describe(listener.address)} is already used by {seen[key]}",
                    )
                    valid = False
                seen.setdefault(key, path)
            listeners.append(listener)
        return tuple(listeners) if valid else None

    def upstreams(self, value: Any, names: list[str]) -> dict[str, Upstream] | None:
        """The ``[upstreams.NAME]`` groups; ``names`` receives every group name, even invalid."""
        if not isinstance(value, Mapping):
            self.add("upstreams", f"expected a table of groups, got {_describe(value)}")
            return None
        if not value:
            self.add("upstreams", "expected at least one group, e.g. [upstreams.gpus]")
            return None
        groups: dict[str, Upstream] = {}
        valid = True
        for name, item in value.items():
            names.append(name)
            path = _join("upstreams", name)
            if not name:
                self.add(path, "expected a non-empty group name")
                valid = False
                continue
            values = self.table(item, path, _UPSTREAM_KEYS, what="a table with servers = [...]")
            if values is None:
                valid = False
                continue
            groups[name] = Upstream(name=name, **values)
        return groups if valid else None

    def servers(self, value: Any, path: str) -> tuple[Server, ...] | None:
        items = self.array(value, path, 'an array of "host:port" strings or { address = ... }')
        if items is None:
            return None
        if not items:
            self.add(path, "expected at least one server, got an empty array")
            return None
        servers = [self.server(item, f"{path}[{index}]") for index, item in enumerate(items)]
        if any(server is None for server in servers):
            return None
        return tuple(server for server in servers if server is not None)

    def server(self, value: Any, path: str) -> Server | None:
        if isinstance(value, str):
            address = self.address(value, path)
            return None if address is None else Server(address=address)
        if not isinstance(value, Mapping):
            self.add(path, f'expected "host:port" or a table with address, got {_describe(value)}')
            return None
        values = self.table(value, path, _SERVER_KEYS)
        return None if values is None else Server(**values)

    def routes(self, value: Any, names: list[str]) -> tuple[Route, ...] | None:
        if value is None or value == []:
            if len(names) == 1:
                return (Route(prefix="/", upstream=names[0]),)
            if len(names) > 1:
                self.add(
                    "routes",
                    f"missing; with several upstream groups ({', '.join(sorted(names))}) "
                    "each request needs a route: add [[routes]] tables with prefix and upstream",
                )
            return None
        items = self.array(value, "routes", "an array of [[routes]] tables")
        if items is None:
            return None
        routes: list[Route] = []
        seen: dict[str, str] = {}
        valid = True
        for index, item in enumerate(items):
            path = f"routes[{index}]"
            values = self.table(item, path, _ROUTE_KEYS)
            # An unknown group is reported even when another key of this route is invalid.
            upstream = item.get("upstream") if isinstance(item, Mapping) else None
            if isinstance(upstream, str) and upstream and upstream not in names:
                advice = f"define [{_join('upstreams', upstream)}]"
                if names:
                    advice += " or use one of: " + ", ".join(sorted(names))
                self.add(f"{path}.upstream", f"no upstream named {_describe(upstream)}; {advice}")
                valid = False
            if values is None:
                valid = False
                continue
            route = Route(**values)
            if route.prefix in seen:
                self.add(
                    f"{path}.prefix",
                    f"{_describe(route.prefix)} is already routed by {seen[route.prefix]}",
                )
                valid = False
            seen.setdefault(route.prefix, path)
            routes.append(route)
        return tuple(routes) if valid else None


# The keys each kind of table may have. To add a server setting (weight, ...): add the field
# to Server and a _Key here with the _Checker method that checks its value.
_LISTENER_KEYS = {
    "address": _Key(_Checker.listen_address, required='"host:port"'),
    "tls_cert": _Key(_Checker.file),
    "tls_key": _Key(_Checker.file),
}
_SERVER_KEYS = {
    "address": _Key(_Checker.address, required='"host:port"'),
}
_UPSTREAM_KEYS = {
    "servers": _Key(_Checker.servers, required='an array of "host:port" servers'),
    "pool_max_idle": _Key(_Checker.count),
    "pool_idle_timeout": _Key(_Checker.seconds),
}
_ROUTE_KEYS = {
    "prefix": _Key(_Checker.prefix, required='a path prefix starting with "/"'),
    "upstream": _Key(_Checker.name, required="the name of an upstream group"),
}


def _join(path: str, key: str) -> str:
    """``path.key``, quoting ``key`` as TOML does when it is not a bare key."""
    quoted = key if _BARE_KEY.match(key) else json.dumps(key, ensure_ascii=False)
    return f"{path}.{quoted}" if path else quoted


def _describe(value: object) -> str:
    """``value`` as the message's ``got ...``: TOML spelling for scalars, a kind otherwise."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list):
        return "an array" if value else "an empty array"
    return f"a {type(value).__name__}"


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
