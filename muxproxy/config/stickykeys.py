"""Validation of a group's session stickiness: ``[upstreams.NAME.sticky]`` (its session
sources and ``session_idle``) and ``[upstreams.NAME.sticky.cookie]``; the records are in
:mod:`.records`.

Internal to :mod:`muxproxy.config`; :mod:`.upstreams` checks the group's ``sticky`` key with
:func:`sticky`, and its ``tenant`` and ``priority`` keys with :func:`source` (a tenant is
named the way a session is: ``"kind:name"``). Names obey what they will be matched against:
a cookie or header name is an RFC 9110 §5.6.2 token (cookie names: RFC 6265 §4.1.1), a query
argument name holds no ``&``, ``=`` or ``#``, a body path is dotted identifiers. The cookie's
``same_site = "None"`` needs ``secure`` (browsers drop a SameSite=None cookie without Secure),
and its ``path`` no ``;`` or control character (RFC 6265 §4.1.1, ``path-av``).
"""

from __future__ import annotations

import re
from typing import Any

from muxproxy.config.checker import TOKEN, TOKEN_CHARS, Checker, Key, describe, is_host_name, join
from muxproxy.config.records import SOURCE_KINDS, SessionSource, Sticky, StickyCookie

__all__ = ["source", "sticky"]

_SOURCE_NAMES = {
    "cookie": f"a cookie name (a token: {TOKEN_CHARS})",
    "header": f"a header name (a token: {TOKEN_CHARS})",
    "query": 'a query argument name (no spaces, "&", "=" or "#")',
    "body": 'a dotted path of JSON object keys, each an identifier, e.g. "metadata.session_id"',
}
_QUERY_NAME = re.compile(r"[^\s&=#\x00-\x1f\x7f]+\Z")
_BODY_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
_COOKIE_PATH = re.compile(r"/[^;\x00-\x1f\x7f]*\Z")
_SAME_SITE = ("Strict", "Lax", "None")


def sticky(check: Checker, value: Any, path: str) -> Sticky | None:
    values = check.table(value, path, _STICKY_KEYS)
    return None if values is None else Sticky(**values)


def sources(check: Checker, value: Any, path: str) -> tuple[SessionSource, ...] | None:
    items = check.array(value, path, 'an array of "kind:name" strings')
    if items is None:
        return None
    parsed = [source(check, item, f"{path}[{index}]") for index, item in enumerate(items)]
    if any(one is None for one in parsed):
        return None
    result = tuple(one for one in parsed if one is not None)
    seen: dict[SessionSource, int] = {}
    valid = True
    for index, one in enumerate(result):
        if one in seen:
            check.add(
                f"{path}[{index}]",
                f'"{one.kind}:{one.name}" is already listed at {path}[{seen[one]}]; remove one',
            )
            valid = False
        seen.setdefault(one, index)
    return result if valid else None


def source(check: Checker, value: Any, path: str) -> SessionSource | None:
    kinds = ", ".join(SOURCE_KINDS[:-1]) + " or " + SOURCE_KINDS[-1]
    expected = f'expected "kind:name" with kind {kinds}, e.g. "header:X-Chat-ID"'
    if not isinstance(value, str) or ":" not in value:
        check.add(path, f"{expected}, got {describe(value)}")
        return None
    kind, _, name = value.partition(":")
    if kind not in SOURCE_KINDS:
        message = f"unknown kind {describe(kind)}; {expected}, got {describe(value)}"
        from difflib import get_close_matches  # on a mistake only (``Checker.one_of``)

        close = get_close_matches(kind.lower(), SOURCE_KINDS, n=1)
        if close:
            message += f"; did you mean {describe(close[0] + ':' + name)}?"
        check.add(path, message)
        return None
    valid = {
        "cookie": TOKEN.match(name),
        "header": TOKEN.match(name),
        "query": _QUERY_NAME.match(name),
        "body": _BODY_PATH.match(name),
    }[kind]
    if not valid:
        check.add(
            path, f'expected "{kind}:NAME" with NAME {_SOURCE_NAMES[kind]}, got {describe(value)}'
        )
        return None
    return SessionSource(kind=kind, name=name.lower() if kind == "header" else name)


def sticky_cookie(check: Checker, value: Any, path: str) -> StickyCookie | None:
    values = check.table(value, path, _COOKIE_KEYS)
    if values is None:
        return None
    cookie = StickyCookie(**values)
    if cookie.same_site == "None" and not cookie.secure:
        check.add(
            join(path, "same_site"),
            '"None" needs secure = true (browsers drop SameSite=None cookies without Secure);'
            ' set secure = true, or use "Lax"',
        )
        return None
    return cookie


def cookie_name(check: Checker, value: Any, path: str) -> str | None:
    if not isinstance(value, str) or not TOKEN.match(value):
        check.add(path, f"expected a cookie name (a token: {TOKEN_CHARS}), got {describe(value)}")
        return None
    return value


def cookie_domain(check: Checker, value: Any, path: str) -> str | None:
    if not isinstance(value, str) or not is_host_name(value.removeprefix(".")):
        check.add(path, f'expected a domain such as "example.com", got {describe(value)}')
        return None
    return value


def cookie_path(check: Checker, value: Any, path: str) -> str | None:
    if not isinstance(value, str) or not _COOKIE_PATH.match(value):
        check.add(
            path,
            f'expected a path starting with "/", without ";" or control characters,'
            f" got {describe(value)}",
        )
        return None
    return value


def same_site(check: Checker, value: Any, path: str) -> str | None:
    return check.one_of(value, path, _SAME_SITE)


# The keys each table may have. To add a setting: add the field to its record in records.py
# and a Key here with the function that checks its value.
_COOKIE_KEYS = {
    "name": Key(cookie_name),
    "expires": Key(Checker.seconds),
    "domain": Key(cookie_domain),
    "path": Key(cookie_path),
    "http_only": Key(Checker.boolean),
    "secure": Key(Checker.boolean),
    "same_site": Key(same_site),
    "secret": Key(Checker.string),
}
_STICKY_KEYS = {
    "sources": Key(sources),
    "body_limit": Key(Checker.positive_int),
    "cookie": Key(sticky_cookie),
    "session_idle": Key(Checker.seconds),
}
