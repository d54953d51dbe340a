"""What the defences did, for operators: a counter each, and rate-limited log lines.

A flood is what the defences are for, so logging each act would turn an attack on the proxy
into an attack on its logs. Each kind (``KINDS``) is counted in ``ProxyCore.counters`` every
time, and logged at most once per ``LOG_INTERVAL`` seconds: the first act logs a line at once,
the ones in the following interval are only counted, and the next line says how many were left
out (``suppressed``). Time is the event's ``now`` (the core reads no clock), so the limit is
tested without waiting.

``DefenceLog`` sees its owner through ``Defended`` (its counters, and the clock and ``emit`` of
its ``Effects``), which ``ProxyCore`` has by its shape, so this module imports no part of the
proxy.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from typing import Any, Protocol

from muxproxy.core.commands import Log

KINDS = (
    "client_h2_abuse",
    "smuggling_refused",
    "request_header_timeout",
    "request_body_timeout",
    "request_body_deadline",
    "stream_send_timeout",
    "upstream_trailing_bytes",
)
"""Each is a log event and a counter of the same name:

- ``client_h2_abuse``: an HTTP/2 client ran out of an abuse budget (``h2guard.py``) and got
  GOAWAY(ENHANCE_YOUR_CALM) (RFC 9113 §10.5);
- ``smuggling_refused``: an HTTP/1.1 request whose framing two parsers could read differently
  (bare LF, obs-fold, repeated or list-form Content-Length, Content-Length with
  Transfer-Encoding; RFC 9112 §6.1, §6.3, §11.2) was refused with 400;
- ``request_header_timeout``: an HTTP/1.1 request head not complete within
  ``timeouts.client_header`` got 408 (slowloris, RFC 9110 §15.5.9);
- ``request_body_timeout``: a request body that stopped coming for ``timeouts.client_header``
  got 408 (HTTP/1.1) or RST_STREAM(CANCEL) (HTTP/2);
- ``request_body_deadline``: a request body not complete within ``timeouts.client_body`` of
  its head (one trickled just under the gap) got 408 (``bodyclock.py``);
- ``stream_send_timeout``: an HTTP/2 stream whose window the client kept closed for
  ``timeouts.send`` got RST_STREAM(CANCEL) (the zero-window reader);
- ``upstream_trailing_bytes``: an HTTP/1.1 backend sent bytes after a complete response, in
  the read that ended it or while the connection waited in the pool (RFC 9112 §9.3); the
  connection was closed, never given to the next request, which would have read them as its
  answer (``h1client.py``). Logged with the server (``server``), not a client.
"""

LOG_INTERVAL = 10.0
"""Seconds between two log lines of one kind, at least."""


class _Effects(Protocol):
    @property
    def now(self) -> float: ...
    def emit(self, command: Log) -> None: ...


class Defended(Protocol):
    """What ``DefenceLog`` uses of its owner (``ProxyCore``): the counters it adds to, and of
    the owner's ``Effects`` the time of the event being handled and where log records go."""

    @property
    def counters(self) -> MutableMapping[str, int]: ...
    @property
    def fx(self) -> _Effects: ...


class DefenceLog:
    """Counts every act of a defence and logs the first of each ``interval``, per kind."""

    def __init__(self, core: Defended, *, interval: float = LOG_INTERVAL) -> None:
        self.core = core
        self.interval = interval
        self._quiet_until: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def record(self, kind: str, client: str | None, **fields: Any) -> None:
        """One act of defence ``kind`` against the client at address ``client`` (None: a
        defence against a backend, which ``fields`` name)."""
        core = self.core
        core.counters[kind] += 1
        now = core.fx.now
        if now < self._quiet_until.get(kind, -math.inf):
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._quiet_until[kind] = now + self.interval
        suppressed = self._suppressed.pop(kind, 0)
        peer = {} if client is None else {"client": client}
        core.fx.emit(Log(event=kind, fields={**peer, **fields, "suppressed": suppressed}))
