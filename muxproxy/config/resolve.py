"""Whether the servers' host names resolve: the warnings of ``muxproxy check``.

A host name that does not resolve is no configuration error: DNS may not know a new server
yet, or ``muxproxy check`` may run where the fleet's names are not served (a build machine).
The proxy starts with it, and every connection to that server fails (and counts against it)
until the name resolves. So ``check`` warns and still succeeds.

Each name is looked up once, all at once, in daemon threads (``getaddrinfo`` blocks and
cannot be cancelled): a resolver that hangs costs the check ``timeout`` seconds, not more,
and cannot keep the process from exiting.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time

from muxproxy.config.records import Config

__all__ = ["unresolved_servers"]


def unresolved_servers(config: Config, *, timeout: float = 3.0) -> list[str]:
    """One warning per server whose host name does not resolve within ``timeout`` seconds,
    named by its key path (``upstreams.gpus.servers[1]``)."""
    where: dict[str, list[str]] = {}
    for name, group in config.upstreams.items():
        for index, server in enumerate(group.servers):
            if not _is_ip(server.host):
                where.setdefault(server.host, []).append(f"upstreams.{name}.servers[{index}]")
    results: dict[str, str | None] = {}
    threads = [
        threading.Thread(target=_resolve, args=(host, results), daemon=True) for host in where
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    warnings = []
    for host, paths in where.items():
        if host not in results:
            problem = f"did not resolve within {timeout:g}s"
        elif (error := results[host]) is not None:
            problem = f"does not resolve ({error})"
        else:
            continue
        for path in paths:
            warnings.append(
                f'{path}: the host "{host}" {problem}; the proxy starts, but every'
                " connection to this server fails until it resolves"
            )
    return warnings


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _resolve(host: str, results: dict[str, str | None]) -> None:
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        results[host] = getattr(exc, "strerror", None) or str(exc)
    else:
        results[host] = None
