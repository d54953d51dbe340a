"""Validation of the ``[admin]`` section: the admin API's address, token and state file.

Internal to :mod:`muxproxy.config`; :func:`admin_settings` is what :mod:`.loading` calls for
a file, :func:`quick_admin` for ``muxproxy serve --admin ADDRESS``. A state file that exists
is read and checked too (:mod:`.runtime`), so ``muxproxy check`` finds a corrupt one before a
start or a reload would.

The one rule beyond types: an admin address that is not loopback needs a token. Whoever can
reach the admin listener can drain every server or reload the configuration, so muxproxy
refuses to open it to a network unguarded rather than trusting a firewall to exist. The token
is a bearer token (RFC 6750 §2.1), so it must have the ``b64token`` syntax to be sent in an
``Authorization`` header at all. ``MUXPROXY_ADMIN_TOKEN``, when set, wins over the file's
``token``: the secret can stay out of a file that is checked in.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any

from muxproxy.config.checker import Checker, Key, describe
from muxproxy.config.records import ADMIN_TOKEN_ENV, AdminSettings
from muxproxy.config.runtime import load_state

__all__ = ["admin_settings", "is_loopback", "quick_admin"]

_B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*\Z")
"""RFC 6750 §2.1: the syntax of a bearer token."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address's host, brackets removed) names this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def _token(check: Checker, value: Any, path: str) -> str | None:
    if not isinstance(value, str) or not _B64TOKEN.match(value):
        check.add(
            path,
            "expected a bearer token: letters, digits and -._~+/ (RFC 6750 §2.1), got"
            f" {'a string of other characters' if isinstance(value, str) else describe(value)}",
        )
        return None
    return value


def _state_file(check: Checker, value: Any, path: str) -> str | None:
    if not isinstance(value, str) or not value:
        check.add(path, f"expected a file path, got {describe(value)}")
        return None
    resolved = check.file_to_write(
        value,
        path,
        missing_directory="create it (the state file is written there, through a temporary"
        " file beside it)",
    )
    if resolved is None:
        return None
    try:
        load_state(resolved)  # a missing file is fine: nothing was changed yet
    except (OSError, ValueError) as exc:
        check.add(
            path,
            f"{exc}; fix or remove the file (without it every server starts at its"
            " configured weight, neither drained nor down)",
        )
        return None
    return resolved


_ADMIN_KEYS = {
    "address": Key(Checker.listen_address),
    "token": Key(_token),
    "state_file": Key(_state_file),
}


def admin_settings(
    check: Checker, value: Any, path: str, environ: Mapping[str, str]
) -> AdminSettings | None:
    """The ``[admin]`` table at ``path``, its token taken from ``environ`` when set there."""
    values = check.table(value, path, _ADMIN_KEYS)
    valid, token = _environment_token(check, environ)
    if values is None or not valid:
        return None
    if token is not None:
        values["token"] = token
    settings = AdminSettings(**values)
    return settings if _guarded(check, settings, f"{path}.token") else None


def quick_admin(check: Checker, address: str, environ: Mapping[str, str]) -> AdminSettings | None:
    """The admin settings of ``muxproxy serve --admin ADDRESS`` (the token from ``environ``)."""
    valid = check.address(address, "--admin", allow_port_zero=True) is not None
    token_valid, token = _environment_token(check, environ)
    if not valid or not token_valid:
        return None
    settings = AdminSettings(address=address, token=token)
    return settings if _guarded(check, settings, "--admin") else None


def _environment_token(check: Checker, environ: Mapping[str, str]) -> tuple[bool, str | None]:
    """(valid, the token in ``environ``): None when it is unset or empty."""
    value = environ.get(ADMIN_TOKEN_ENV)
    if not value:
        return True, None
    token = _token(check, value, ADMIN_TOKEN_ENV)
    return token is not None, token


def _guarded(check: Checker, settings: AdminSettings, path: str) -> bool:
    if settings.token is not None or is_loopback(settings.host):
        return True
    flag = path.startswith("--")
    where = (
        ADMIN_TOKEN_ENV
        if flag
        else f"[admin] token (or the environment variable {ADMIN_TOKEN_ENV})"
    )
    check.add(
        path,
        ("" if flag else "missing; ")
        + f"the admin address {describe(settings.address)} is not loopback, and without a"
        f" token anyone who reaches it could change weights and reload: set {where}, or"
        ' listen on "127.0.0.1:PORT"',
    )
    return False
