"""Redis Sentinel store URLs: ``redis+sentinel://host:port[,host:port...]/service[/db]``.

One parser for the config loader (which refuses a malformed URL at load, naming
``resume.store``) and the resume store (which makes a ``coredis.Sentinel`` client of it), so the
two cannot read one URL differently. Every Sentinel is ``host:port`` (no default port: a
Sentinel's 26379 and Redis's 6379 are too easily confused); the service is the name given to
``sentinel monitor``; the db an integer, 0 when left out. A password (``:pw@`` before the hosts)
is the primary's. TLS (``rediss+sentinel://``) is refused: coredis's Sentinel takes no TLS
settings for its Sentinel connections from a URL.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

import attrs

from muxproxy.config.checker import Checker, describe

SCHEME = "redis+sentinel"
_HOST_PORT = re.compile(r"\A(\[[0-9A-Fa-f:.]+\]|[^\s\[\]:/,@]+):([0-9]{1,5})\Z")


@attrs.frozen
class SentinelStore:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    password: str | None = None


def is_sentinel(url: str) -> bool:
    return url.startswith(SCHEME + "://")


def parse_sentinel(url: str) -> SentinelStore:
    """The parts of a ``redis+sentinel://`` URL; ``ValueError`` (with the reason) if malformed."""
    if not is_sentinel(url):
        raise ValueError(f"not a {SCHEME}:// URL")
    rest = url[len(SCHEME) + 3 :]
    if "?" in rest or "#" in rest:
        raise ValueError("no query or fragment is taken")
    hosts, _, path = rest.partition("/")
    password: str | None = None
    if "@" in hosts:
        userinfo, _, hosts = hosts.rpartition("@")
        password = userinfo.partition(":")[2] or None
    sentinels = []
    for host_port in hosts.split(","):
        match = _HOST_PORT.match(host_port)
        if match is None or not 0 < int(match[2]) < 65536:
            raise ValueError(f"expected host:port for each Sentinel, got {host_port!r}")
        sentinels.append((match[1].strip("[]"), int(match[2])))
    service, _, db = path.partition("/")
    if not service:
        raise ValueError("the service name (as in sentinel monitor) is missing")
    if db and re.fullmatch("[0-9]+", db) is None:
        raise ValueError(f"the db must be an integer, got {db!r}")
    return SentinelStore(tuple(sentinels), service, int(db or 0), password)


_STORE_SCHEMES = ("redis", "rediss")
_STORE_EXPECTED = (
    'expected a Redis URL such as "redis://127.0.0.1:6379/0" (or "rediss://" for TLS),'
    ' or a Sentinel URL such as "redis+sentinel://127.0.0.1:26379/mymaster/0";'
    " Cluster stores are not supported"
)


def store_url(check: Checker, value: Any, path: str) -> str | None:
    """``redis://host[:port][/db]`` or ``rediss://``: where streams are shared across workers
    and replicas (``docs/resume.md``). A password may be given as ``redis://:pw@host``. Or
    Sentinel: ``redis+sentinel://host:port[,host:port...]/service[/db]`` (:mod:`.storeurl`)."""
    if not isinstance(value, str):
        check.add(path, f"{_STORE_EXPECTED}, got {describe(value)}")
        return None
    if is_sentinel(value):
        try:
            parse_sentinel(value)
        except ValueError as error:
            check.add(path, f"{_STORE_EXPECTED}: {error}, got {value!r}")
            return None
        return value
    if value.startswith("rediss+sentinel://"):
        check.add(
            path,
            f"{_STORE_EXPECTED}: TLS to Sentinel (rediss+sentinel://) is not supported,"
            f" got {value!r}",
        )
        return None
    try:
        url = urllib.parse.urlsplit(value)
        port = url.port
    except ValueError:
        check.add(path, f"{_STORE_EXPECTED}, got {value!r}")
        return None
    db = url.path.lstrip("/")
    if (
        url.scheme not in _STORE_SCHEMES
        or not url.hostname
        or (port is not None and not 0 < port < 65536)
        or not (db == "" or db.isdigit())
        or url.query
        or url.fragment
    ):
        check.add(path, f"{_STORE_EXPECTED}, got {value!r}")
        return None
    return value


def redacted(url: str) -> str:
    """``url`` without a password (it goes to the logs)."""
    scheme, sep, rest = url.partition("://")
    at = rest.rfind("@")
    return f"{scheme}{sep}{rest[at + 1 :]}" if at >= 0 else url
