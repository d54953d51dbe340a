"""What every serving process of muxproxy says and does alike: one process, a supervisor of
``--workers N`` and each of its workers.

Exit statuses, the ``muxproxy listening on ...`` lines, the wording of a process's exit, the
access log's reopening and the start-up heap freeze (the signals are ``signals.py``'s).
``cli.py`` (one process), ``workers.py`` (the supervisor) and ``worker.py`` (a worker) all
import this module and none of them imports another for these: the one-process command line
and the supervisor stay independent of each other, and the supervisor's process looks to an
operator exactly as one process does (the same lines, the same statuses, the same signals).

It imports neither Trio nor the proxy: ``muxproxy check`` loads it too.
"""

from __future__ import annotations

import gc
import logging
import signal
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from muxproxy.config import Config

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
"""Bad usage or an invalid configuration."""


def reopen_access_log(server: Any, log: logging.Logger) -> None:
    """:data:`REOPEN_LOG_SIGNAL`'s work in a process that serves (``server``: its running
    ``ProxyServer``), logged: reopened, nothing to reopen, or why it could not (the old file
    is still written then)."""
    access = server.config.log.access
    if access in ("stderr", "off"):
        log.info("muxproxy: SIGUSR1: the access log is %s, no file to reopen", access)
        return
    try:
        server.reopen_access_log()
    except OSError as exc:
        log.warning(
            "muxproxy: SIGUSR1: cannot reopen the access log %s: %s; still writing to the old file",
            access,
            exc.strerror or exc,
        )
        return
    log.info("muxproxy: SIGUSR1: reopened the access log %s", access)


def listening_lines(config: Config, bound: Sequence[tuple[str, int]]) -> list[str]:
    """``muxproxy listening on SCHEME://HOST:PORT`` for each bound (host, port).

    ``bound`` is what ``serve`` reports: one address per listener, in order, when the counts
    match; otherwise each address is matched to a listener by port.
    """
    listeners = config.listeners
    if len(bound) == len(listeners):
        tls = [listener.tls for listener in listeners]
    else:
        by_port = {listener.port: listener.tls for listener in listeners}
        every = all(listener.tls for listener in listeners)
        tls = [by_port.get(port, every) for _, port in bound]
    return [
        listening_line(secure, host, port) for (host, port), secure in zip(bound, tls, strict=True)
    ]


def listening_line(tls: bool, host: str, port: int) -> str:
    """``muxproxy listening on SCHEME://HOST:PORT``: one listener, bound."""
    return f"muxproxy listening on {scheme(tls)}://{host_port(host, port)}"


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 host in brackets (RFC 3986 §3.2.2)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def scheme(tls: bool) -> str:
    return "https" if tls else "http"


def describe_exit(returncode: int | None) -> str:
    """How a child process ended, for a log line: ``exited with status 1``, ``was killed by
    SIGKILL``; ``returncode`` as ``subprocess`` gives it (negative: the signal's number)."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:  # a real-time signal has no name of its own
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


def freeze_startup_heap() -> None:
    """Take what start-up allocated out of the cyclic garbage collector's view (``gc.freeze``).

    For a serving process, once it listens: the modules, the configuration and Trio's runtime
    (about 29,000 objects) are never garbage, yet every full collection walked all of them, a
    pause of 27-34 ms for every stream at once, every few seconds at 100 streams; after it the
    full collections take 1.6-3.7 ms (``docs/performance.md``). What serving allocates is
    collected as before.
    """
    gc.freeze()
