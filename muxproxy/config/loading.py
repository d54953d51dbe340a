"""Loading a configuration: the TOML file, its top level, and the ``serve`` flags.

:func:`load_config` reads a TOML file, :func:`parse_config` validates an already parsed table,
:func:`parse_quick_config` validates the flag form of ``muxproxy serve``. All three raise
:class:`ConfigError`, which carries *every* problem found. The sections' keys live in
:mod:`.sections` (and the modules of ``[log]``, ``[admin]``, ``[fleet]``, one group's in
:mod:`.upstreams`), the machinery in :mod:`.checker`.

This is the top of the package's imports: it hands its :class:`~.checker.Checker` the
pointer for a key in the wrong table (:func:`.layout.placement`), which reads every table's
keys, so no checking module needs to know the tables it sits beside.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from typing import Any

from muxproxy.config.admin import admin_settings, quick_admin
from muxproxy.config.checker import Checker
from muxproxy.config.extensionkeys import extension_tables
from muxproxy.config.fleet import ResolverSettings
from muxproxy.config.fleetkeys import RESOLVER_KEYS, fleet_settings
from muxproxy.config.layout import placement
from muxproxy.config.logs import log_settings
from muxproxy.config.modelkeys import model_aliases
from muxproxy.config.records import (
    AdminSettings,
    Config,
    Limits,
    Listener,
    Route,
    Server,
    Timeouts,
    Upstream,
)
from muxproxy.config.sections import (
    EXPECTED_LISTENERS,
    LIMITS_KEYS,
    TIMEOUTS_KEYS,
    listener_tables,
    route_tables,
    upstream_groups,
)
from muxproxy.config.telemetrykeys import telemetry_settings
from muxproxy.config.tls import tls_pair_problems

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
    check = Checker(base_dir, placement=placement)
    suggested = check.unknown_keys(data, _TOP_KEYS, "")

    listeners = None
    if "listeners" in data:
        listeners = listener_tables(check, data["listeners"])
    elif "listeners" not in suggested:
        check.add("listeners", "missing; " + EXPECTED_LISTENERS)
    timeouts = check.record(Timeouts, data.get("timeouts", {}), "timeouts", TIMEOUTS_KEYS)
    limits = check.record(Limits, data.get("limits", {}), "limits", LIMITS_KEYS)
    names: list[str] = []
    upstreams = None
    if "upstreams" in data:
        upstreams = upstream_groups(check, data["upstreams"], names)
    elif "upstreams" not in suggested:
        check.add("upstreams", "missing; " + _EXPECTED_UPSTREAMS)
    routes = route_tables(check, data.get("routes"), names)
    log = log_settings(check, data.get("log", {}))
    admin = None
    if "admin" in data:
        environ = os.environ if environ is None else environ
        admin = admin_settings(check, data["admin"], "admin", environ)
    resolver = check.record(ResolverSettings, data.get("resolver", {}), "resolver", RESOLVER_KEYS)
    fleet = fleet_settings(check, data.get("fleet"), os.environ if environ is None else environ)
    extensions = extension_tables(check, data.get("extensions"))
    telemetry = telemetry_settings(check, data.get("telemetry"))
    models = model_aliases(check, data.get("models"))

    if check.problems:
        raise ConfigError(check.problems)
    assert listeners is not None and upstreams is not None and routes is not None
    assert timeouts is not None and limits is not None and log is not None
    assert resolver is not None and models is not None
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
        extensions=extensions,
        telemetry=telemetry,
        models=models,
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
    check = Checker(None, placement=placement)
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
    "extensions",
    "telemetry",
    "models",
)
_EXPECTED_UPSTREAMS = (
    'expected at least one group, e.g. [upstreams.gpus] with servers = ["127.0.0.1:9001"]'
)
_TOML_ERROR = re.compile(r"(?s)(.*) \(at line (\d+), column (\d+)\)\Z")


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
