"""Commands the core returns to the driver.

The driver carries them out in order. None of them blocks the core: the driver reports the
outcome later as an event (``ConnectionOpened``, ``DataSent``, ``ConnectionClosed``, ...).
"""

from __future__ import annotations

from typing import Any

import attrs

from muxproxy.config import Server
from muxproxy.core.events import ConnId, TimerId
from muxproxy.extensions.api import Extension, Request
from muxproxy.fleet.budgets import Ask
from muxproxy.fleet.sessions import SessionEntry


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
    linger: bool = attrs.field(default=True, eq=False)
    """Whether the driver, once the output is flushed and FIN sent, may still read and drop
    what the client sends for a while before it closes (RFC 9112 §9.6: so that an RST does
    not destroy a response the client has not read). False for a connection idle between
    requests, whose client has nothing unanswered: nothing to protect, and a client that
    keeps it open would hold a stop for the whole linger (nginx closes those at once too)."""


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


# -- the shared resume store (``resume.py``; the driver's ``muxproxy.trio.resumestore``) ----


@attrs.frozen(kw_only=True, slots=True)
class ResumeMeta:
    """What a resume made elsewhere needs besides the events: sent with a stream's first
    ``ResumeAppend`` only."""

    credential: bytes
    """``resumebind.binding_of`` of the request that began the stream (a hash)."""
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    """The backend's response head fields, from which a resume's head is made."""
    version: str
    """The backend's HTTP version (for the resume's ``Via``)."""


@attrs.frozen(kw_only=True, slots=True)
class ResumeAppend(Command):
    """Append a resumable stream's events to the shared store ``store``, the events one
    backend read completed (one command per read, never per event); also once at its end.

    The driver never blocks the core on it: it queues the append (dropping it, counted,
    when the queue is full or the store is down)."""

    store: str
    token: bytes
    events: tuple[tuple[int, bytes], ...]
    """``(seq, bytes as sent)``, in order."""
    first_seq: int
    """The oldest seq still in the owner's window: older ones are trimmed from the store,
    so the store holds what the owner holds."""
    last_seq: int
    end: str | None = None
    """``"ended"`` or ``"broken"``: the backend stream is over (nothing follows)."""
    linger: float
    """Seconds the store keeps the stream past its end (and past its last append while it
    is live, plus a margin, so the keys of an owner that died go away)."""
    meta: ResumeMeta | None = None
    lease: float = 5.0
    """Seconds of the owner's lease on the live stream (``resume.lease``): the driver renews
    it while the stream is live, so a reader elsewhere knows when the owner died."""


@attrs.frozen(kw_only=True, slots=True)
class ResumeFetch(Command):
    """Answer a resume of a stream this process does not hold from the shared store: the
    driver feeds ``ResumeFetched`` for ``request`` (an exchange's ident), the first one
    with the head, then one per batch read, until one whose ``state`` is not ``"live"``.
    After each batch it waits for ``ResumeFetchMore`` (the client's buffer is the bound)."""

    store: str
    request: int
    token: bytes
    after: int
    """The last seq the client had: events after it are sent."""
    credential: bytes


@attrs.frozen(kw_only=True, slots=True)
class ResumeFetchMore(Command):
    """The client of fetch ``request`` took the last batch: read the next one."""

    request: int


@attrs.frozen(kw_only=True, slots=True)
class ResumeFetchCancel(Command):
    """The client of fetch ``request`` is gone: stop reading the store for it."""

    request: int


@attrs.frozen(kw_only=True, slots=True)
class ResumeProbe(Command):
    """A stream of ours lingered ``linger`` seconds with nobody reading it here: ask the
    shared store whether a client follows it through another process. Answered by
    ``ResumeProbed`` (``reading`` False also when the store cannot be asked)."""

    store: str
    token: bytes
    stream: int
    """The stream's ident in its ``ResumeStore`` (``Resumable.ident``)."""


# -- fleet-wide budgets (``fleetadmit.py``; the driver's ``muxproxy.trio.fleetbudgets``) -------


@attrs.frozen(kw_only=True, slots=True)
class BudgetReserve(Command):
    """Reserve ``ask`` from its tenant's budgets in the fleet store ``store`` (one round
    trip). Always answered by ``BudgetAnswered``, within ``fleet.budgets.RESERVE_TIMEOUT``
    seconds: a store that is down, slow or wrong answers as an error."""

    store: str
    ask: Ask


@attrs.frozen(kw_only=True, slots=True)
class BudgetSettle(Command):
    """Correct the reservation of ``ask`` by ``correction`` tokens (reserved minus used)
    and release its lease. Fire and forget: the driver batches it, off the request's path."""

    store: str
    ask: Ask
    correction: int


# -- the shared memory of sessions (``sessionshare.py``; the driver's ``fleetsessions``) ----


@attrs.frozen(kw_only=True, slots=True)
class SessionsRemembered(Command):
    """Sessions this core sent to a server since its last batch (the latest per key), for
    the other workers and replicas to learn (``fleet/sessions.py``). Emitted at most every
    ``SHARE_DELAY`` seconds, and only where the driver shares them. The times are the core's
    clock (the ``now`` of the events); the driver turns them into wall-clock time."""

    entries: tuple[SessionEntry, ...]


# -- extension hooks (``exchange/hooked.py``; the driver's ``muxproxy.trio.hookcalls``) -------


@attrs.frozen(kw_only=True, slots=True)
class ExtensionCall(Command):
    """Await ``extension.on_request_head_async(view)`` for exchange ``request``, at most
    ``timeout`` seconds. Always answered by ``ExtensionAnswered`` (an error when the hook
    raised or ran out of time)."""

    request: int
    position: int
    """Where the extension is in the request-head chain (echoed in the answer)."""
    extension: Extension
    view: Request
    timeout: float


# -- the engines' KV-cache events (``upstream/kvfeeds.py``; the driver's ``trio/kvfollow``) ---


@attrs.frozen(kw_only=True, slots=True)
class KvEndpoint:
    """Where one server of a group with ``kv_events`` publishes its events."""

    group: str
    address: str
    """The server's configured address, as the answers name it."""
    host: str
    port: int
    topic: bytes


@attrs.frozen(kw_only=True, slots=True)
class KvFollow(Command):
    """Follow exactly these endpoints from now on (every configuration says all of them):
    subscribe to the new ones, stop following the ones left out. Answered, per endpoint, by
    ``KvSubscription`` and ``KvEventsReceived`` for as long as it is followed."""

    endpoints: tuple[KvEndpoint, ...]


@attrs.frozen(kw_only=True, slots=True)
class KvTokenize(Command):
    """``POST /tokenize`` with ``body`` to ``origin`` (a server of ``group``), off every
    request's path. Always answered by ``KvTokensAnswered`` with ``key``."""

    group: str
    origin: Origin
    key: bytes
    body: bytes
