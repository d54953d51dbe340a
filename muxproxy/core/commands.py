"""Commands the core returns to the driver.

The driver carries them out in order. None of them blocks the core: the driver reports the
outcome later as an event (``ConnectionOpened``, ``DataSent``, ``ConnectionClosed``, ...).
"""

from __future__ import annotations

from typing import Any

import attrs

from ..config import Server
from .events import ConnId, TimerId


@attrs.frozen(kw_only=True, slots=True)
class Origin:
    """Where an upstream connection goes."""

    host: str
    port: int
    tls: bool = False
    alpn: str = "http/1.1"
    """With ``tls``: the one protocol offered by ALPN, which the backend must accept."""
    ca: str | None = None
    """With ``tls``: CA bundle verifying the backend's certificate (None: system store)."""
    server_name: str | None = None
    """With ``tls``: SNI and certificate name (None: ``host``)."""

    @classmethod
    def of(cls, server: Server) -> Origin:
        """Where ``server`` (a configured backend) is reached."""
        return cls(
            host=server.host,
            port=server.port,
            tls=server.tls,
            alpn="h2" if server.protocol == "h2" else "http/1.1",
            ca=server.tls_ca,
            server_name=server.tls_server_name,
        )

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@attrs.frozen(kw_only=True, slots=True)
class Command:
    pass


@attrs.frozen(kw_only=True, slots=True)
class SendData(Command):
    """Append ``data`` to the connection's pending output; the writer sends it all at once."""

    conn: ConnId
    data: bytes


@attrs.frozen(kw_only=True, slots=True)
class OpenConnection(Command):
    """Connect to ``origin``; answer with ``ConnectionOpened`` or ``OpenFailed``."""

    conn: ConnId
    origin: Origin


@attrs.frozen(kw_only=True, slots=True)
class CloseConnection(Command):
    """Stop reading, send what is pending, then close. The driver answers with
    ``ConnectionClosed`` (exactly once, also when the connection broke meanwhile)."""

    conn: ConnId
    flush_timeout: float | None = attrs.field(default=None, eq=False)
    """Seconds the flush of pending output may go without progress (the kernel taking none
    of it) before the driver closes the connection anyway; None: no bound. The core fills
    it with ``timeouts.send``: a close issued *because* a peer stopped reading must not wait
    for it forever. Not part of equality: a close is identified by its connection, so
    ``CloseConnection(conn=c) in commands`` asks whether ``c`` is being closed."""


@attrs.frozen(kw_only=True, slots=True)
class ShutdownWrite(Command):
    """Send what is pending, then end our sending side (TCP FIN, ``shutdown(SHUT_WR)``);
    reading goes on. The connection is still closed only by ``CloseConnection`` (or when it
    fails), and ``ConnectionClosed`` still comes exactly once.

    Over TLS the driver sends nothing: trio's ``SSLStream`` cannot send close_notify and
    keep reading, so the peer learns the end from the protocol above it (a WebSocket Close
    frame) or from the close that follows.
    """

    conn: ConnId


@attrs.frozen(kw_only=True, slots=True)
class PauseReading(Command):
    conn: ConnId


@attrs.frozen(kw_only=True, slots=True)
class ResumeReading(Command):
    conn: ConnId


@attrs.frozen(kw_only=True, slots=True)
class SetTimer(Command):
    """Deliver ``Wakeup(timer)`` at monotonic time ``at``; replaces an earlier setting."""

    timer: TimerId
    at: float


@attrs.frozen(kw_only=True, slots=True)
class CancelTimer(Command):
    timer: TimerId


@attrs.frozen(kw_only=True, slots=True)
class Log(Command):
    """A structured log record: access log lines and diagnostics, as data tests can assert."""

    event: str
    fields: dict[str, Any] = attrs.field(factory=dict)
