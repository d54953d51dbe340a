"""The validation machinery: a :class:`Checker` that collects problems, and value checks.

Internal to :mod:`muxproxy.config`. A problem is ``"<key path>: <message>"``; the message says
what is expected and what was found (``expected "host:port", got "localhost"``), and, where the
fix is not obvious from that, how to fix it. Checks never stop at the first problem: a check
that fails reports and returns None, and its caller goes on with the next key.

A table is checked against a mapping of its keys to :class:`Key`, each naming the function
that checks the key's value: a :class:`Checker` method or any function of the same shape,
``parse(checker, value, path) -> converted value or None``. A number it returns is then held
to its key's range (:mod:`.ranges`), so no checking function repeats an upper bound.

A key unknown in its table gets a "did you mean" from that table's keys, or, given a
:data:`Placement` (:func:`.layout.placement`, which knows every table), a pointer to the table
it belongs in. The placement is handed in, not imported: the tables are made of the checking
functions built on this module, so this module stays below them all.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from muxproxy.config.ranges import problem as range_problem

__all__ = [
    "TOKEN",
    "Checker",
    "Key",
    "Placement",
    "ValueParser",
    "address_problem",
    "alternatives",
    "describe",
    "is_host_name",
    "join",
    "record_keys",
]

TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
"""RFC 9110 §5.6.2 token: header names, and cookie names (RFC 6265 §4.1.1)."""
TOKEN_CHARS = "letters, digits and !#$%&'*+-.^_`|~"
"""What :data:`TOKEN` admits, in the words of a message."""

_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")
_PORT = re.compile(r"[0-9]{1,5}\Z")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+\Z")

ValueParser = Callable[["Checker", Any, str], Any]
"""Checks one value at a key path: the converted value, or None after reporting a problem."""

Placement = Callable[[str, str], str | None]
"""Where a key unknown in the table at a path belongs instead (``placement(key, path)``), as a
hint (``"first_token" belongs in [upstreams.NAME.timeouts]``), or None."""


@attrs.frozen
class Key:
    """One key of a table: how its value is checked, and whether it must be there."""

    parse: ValueParser
    required: str | None = None
    """None: optional. Otherwise the key is required, and this says what is expected."""


class Checker:
    """Validates the parts of a configuration, collecting problems instead of stopping."""

    def __init__(self, base_dir: str | None, *, placement: Placement | None = None) -> None:
        self.base_dir = base_dir
        self.problems: list[str] = []
        self.placement = placement
        """Points a key unknown in its table at the table it belongs in; None: no pointer."""

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
            from difflib import get_close_matches  # only on a mistake (see ``one_of``)

            close = get_close_matches(key, known, n=1)
            suggested.update(close)
            # A near-certain misspelling of a key of this table ("upstream" for
            # "upstreams") is that; otherwise a key of another table is a misplaced one.
            near = get_close_matches(key, known, n=1, cutoff=0.8)
            elsewhere = None if near or self.placement is None else self.placement(key, path)
            if elsewhere is not None:
                hint = elsewhere + (f' (or did you mean "{close[0]}"?)' if close else "")
            elif close:
                hint = f'did you mean "{close[0]}"?'
            else:
                hint = "expected one of: " + ", ".join(known)
            self.add(join(path, key), f"unknown key; {hint}")
        return suggested

    def table(
        self, value: Any, path: str, keys: Mapping[str, Key], what: str = "a table"
    ) -> dict[str, Any] | None:
        """Check a table against its ``keys``: the converted values of the keys present."""
        if not isinstance(value, Mapping):
            self.add(path, f"expected {what}, got {describe(value)}")
            return None
        suggested = self.unknown_keys(value, keys, path)
        out: dict[str, Any] = {}
        valid = True
        for key, spec in keys.items():
            if key in value:
                where = join(path, key)
                converted = spec.parse(self, value[key], where)
                # Every numeric key's range (ranges.RANGES), after the check of its kind.
                problem = None if converted is None else range_problem(where, converted)
                if problem is not None:
                    self.add(where, problem)
                    converted = None
                if converted is None:
                    valid = False
                else:
                    out[key] = converted
            elif spec.required is not None:
                if key not in suggested:  # "did you mean" already points at it
                    self.add(join(path, key), f"missing; expected {spec.required}")
                valid = False
        return out if valid else None

    def array(self, value: Any, path: str, what: str) -> list[Any] | None:
        if not isinstance(value, list):
            self.add(path, f"expected {what}, got {describe(value)}")
            return None
        return value

    def record(self, cls: type[Any], value: Any, path: str, keys: Mapping[str, Key]) -> Any:
        """A record of ``cls`` from the table ``value``, its keys checked by ``keys``
        (:func:`record_keys` for a :class:`Timeouts`-like record)."""
        values = self.table(value, path, keys)
        return None if values is None else cls(**values)

    # -- values --

    def seconds(self, value: Any, path: str) -> float | None:
        """A positive, finite number of seconds. TOML's ``inf`` and ``nan`` (and ``1e400``,
        which reads as ``inf``) are refused, as are integers too large for a float: every
        duration becomes a timer deadline or a cookie's Max-Age, which need a finite one."""
        seconds = _finite(value)
        if seconds is None or not seconds > 0:
            self.add(path, f"expected a positive, finite number of seconds, got {describe(value)}")
            return None
        return seconds

    def positive_int(self, value: Any, path: str) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            self.add(path, f"expected a positive integer, got {describe(value)}")
            return None
        return value

    def count(self, value: Any, path: str) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            self.add(path, f"expected an integer >= 0, got {describe(value)}")
            return None
        return value

    def boolean(self, value: Any, path: str) -> bool | None:
        if not isinstance(value, bool):
            self.add(path, f"expected true or false (a TOML boolean), got {describe(value)}")
            return None
        return value

    def string(self, value: Any, path: str) -> str | None:
        if not isinstance(value, str):
            self.add(path, f"expected a string, got {describe(value)}")
            return None
        return value

    def one_of(self, value: Any, path: str, choices: Sequence[str]) -> str | None:
        """``value`` if it is one of ``choices``; otherwise a problem with a did-you-mean."""
        if isinstance(value, str) and value in choices:
            return value
        message = f"expected {alternatives(choices)}, got {describe(value)}"
        if isinstance(value, str):
            # difflib is imported on a mistake only: a serving process that was given a
            # valid configuration never holds it.
            from difflib import get_close_matches

            close = [choice for choice in choices if choice.lower() == value.lower()]
            close = close or get_close_matches(value, choices, n=1)
            if close:
                message += f'; did you mean "{close[0]}"?'
        self.add(path, message)
        return None

    def address(self, value: Any, path: str, *, allow_port_zero: bool = False) -> str | None:
        problem = address_problem(value, allow_port_zero=allow_port_zero)
        if problem is not None:
            self.add(path, problem)
            return None
        assert isinstance(value, str)
        return value

    def listen_address(self, value: Any, path: str) -> str | None:
        return self.address(value, path, allow_port_zero=True)

    def resolved(self, value: str) -> str:
        """The file path ``value`` relative to the configuration file's directory (an
        absolute one, or any without a file, as it is)."""
        if self.base_dir is not None and not os.path.isabs(value):
            return os.path.join(self.base_dir, value)
        return value

    def file_to_write(self, value: str, path: str, *, missing_directory: str) -> str | None:
        """``value`` :meth:`resolved`, as a file muxproxy creates or writes: not a directory,
        in a directory that exists (``missing_directory`` ends the message when it does not:
        what to do)."""
        resolved = self.resolved(value)
        if os.path.isdir(resolved):
            self.add(path, f"expected a file, got the directory {describe(resolved)}")
            return None
        directory = os.path.dirname(resolved) or "."
        if not os.path.isdir(directory):
            self.add(
                path, f"the directory {describe(directory)} does not exist; {missing_directory}"
            )
            return None
        return resolved

    def file(self, value: Any, path: str) -> str | None:
        if not isinstance(value, str) or not value:
            self.add(path, f"expected a file path, got {describe(value)}")
            return None
        resolved = self.resolved(value)
        if os.path.isdir(resolved):
            self.add(path, f"expected a file, got the directory {describe(resolved)}")
            return None
        if not os.path.isfile(resolved):
            self.add(path, f"file not found: {describe(resolved)}")
            return None
        return resolved

    def prefix(self, value: Any, path: str) -> str | None:
        if not isinstance(value, str) or not value.startswith("/"):
            self.add(path, f'expected a path prefix starting with "/", got {describe(value)}')
            return None
        return value

    def name(self, value: Any, path: str) -> str | None:
        if not isinstance(value, str) or not value:
            self.add(path, f"expected the name of an upstream group, got {describe(value)}")
            return None
        return value


def record_keys(cls: type[Any], parse: ValueParser) -> dict[str, Key]:
    """The keys of a record whose fields are all optional and all checked by ``parse``."""
    return {field.name: Key(parse) for field in attrs.fields(cls)}


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (not a number, a boolean, infinite, NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer beyond the float range
        return None
    return number if math.isfinite(number) else None


def address_problem(value: object, *, allow_port_zero: bool = False) -> str | None:
    """What is wrong with ``value`` as a ``"host:port"`` address (``"[::1]:8080"`` for IPv6).

    Returns the message (``expected "host:port", got "localhost"``), or None when it is
    valid. Ports run 1..65535; ``allow_port_zero`` (listeners) also admits 0, "any free port".
    """
    if not isinstance(value, str):
        return f'expected "host:port", got {describe(value)}'
    got = describe(value)
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


def is_host_name(value: str) -> bool:
    """Whether ``value`` is a host name or IPv4 address as ``address_problem`` admits them."""
    return _HOST_NAME.match(value) is not None


def alternatives(choices: Iterable[str]) -> str:
    """``"a", "b" or "c"``: the choices quoted, for "expected ..." messages."""
    quoted = [json.dumps(choice) for choice in choices]
    if len(quoted) <= 1:
        return "".join(quoted)
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


def join(path: str, key: str) -> str:
    """``path.key``, quoting ``key`` as TOML does when it is not a bare key."""
    quoted = key if _BARE_KEY.match(key) else json.dumps(key, ensure_ascii=False)
    return f"{path}.{quoted}" if path else quoted


def describe(value: object) -> str:
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
