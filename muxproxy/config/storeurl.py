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

import attrs

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
