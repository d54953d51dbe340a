"""Backend connections: one HTTP/1.1 connection per exchange, kept alive in a pool per origin.

Obeys RFC 9112 §9.3 (persistence): a connection goes back to the pool only when h11 says both
the request and the response completed cleanly; anything else is closed. Idle connections are
kept at most ``pool_max_idle`` per backend and ``pool_idle_timeout`` seconds; one that the
backend closes while idle is simply dropped from the pool.

A connect whose exchange stopped waiting (the client went away, a timeout) is closed at once,
never kept for a later request: a client resetting requests as fast as it sends them must not
leave backend connections behind that outlive them (RFC 9113 §10.5, rapid reset). A close
reported for a connection still connecting is a failed connect.

An ``UpstreamConn`` counts the bytes it handed to the driver and that were not yet written
(``pending``), which is the request direction's share of the exchange's buffer, and it pauses
and resumes its own reading for the response direction's backpressure.

Its states (``UpstreamState``) and what moves them (``UpstreamInput``) are one table,
``TRANSITIONS`` (``states.py``): a connection is given to one exchange at a time (when it
opens, or from the idle pool), the idle timer runs only while it is idle, and the driver
reports ``OpenFailed`` only for a connect under way; anything else is a bug and refused. What
the driver reports again or late (a second ``ConnectionOpened``, a close of what is closed) is
ignored.

What the current request has come to on its connection (``Progress``) is a second, smaller
table, ``PROGRESS``: nothing of it written yet, written, answered. With the number of requests
the connection carried it tells a stale connection (RFC 9112 §9.3.1: a kept connection that
fails before any byte of the answer) and whether the request may have reached the backend.
Once it is answered, or written, further bytes change nothing and take no lookup (the
per-chunk path).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

from muxproxy.core.commands import OpenConnection, Origin, PauseReading, ResumeReading
from muxproxy.core.effects import Effects
from muxproxy.core.http1.h1client import H1Client
from muxproxy.core.messages import Abort, Body, End, Headers, ResponseHead
from muxproxy.core.ports import BackendConnection, UpstreamStream, UpstreamUser
from muxproxy.core.states import IGNORED, ILLEGAL, Transitions, step
from muxproxy.core.timers import BackendTimer
from muxproxy.core.upstream.h2pool import H2Pool

if TYPE_CHECKING:
    from muxproxy.config import Upstream
    from muxproxy.core.observe.defencelog import DefenceLog

__all__ = [
    "BackendConnection",
    "Pool",
    "Progress",
    "UpstreamConn",
    "UpstreamState",
    "UpstreamStream",
]


class UpstreamState(enum.Enum):
    __hash__ = object.__hash__  # as ``Phase``'s: a table lookup runs no Python code
    CONNECTING = "connecting"
    """``OpenConnection`` emitted; an exchange waits for it (``Pool.waiting``)."""
    BUSY = "busy"
    """Carrying one exchange's request and response."""
    IDLE = "idle"
    """In the idle pool, its idle timer armed."""
    CLOSED = "closed"


class UpstreamInput(enum.Enum):
    __hash__ = object.__hash__  # as ``Phase``'s: a table lookup runs no Python code
    OPENED = "opened"
    """The driver's ``ConnectionOpened``: the exchange that waits for it gets it."""
    OPEN_FAILED = "open_failed"
    """The driver's ``OpenFailed``."""
    REUSED = "reused"
    """An exchange takes it from the idle pool (``Pool.acquire``)."""
    RELEASED = "released"
    """Its exchange is done with it (``Pool.release``; closed at once if it cannot be kept)."""
    IDLE_TIMEOUT = "idle_timeout"
    """``pool_idle_timeout`` passed."""
    TUNNEL = "tunnel"
    """The backend switched protocols (101): it leaves the pool (``become_tunnel``)."""
    CLOSE = "close"
    """We close it (``close``)."""
    PEER_CLOSED = "peer_closed"
    """The driver's ``ConnectionClosed``."""


_S = UpstreamState
_I = UpstreamInput
TRANSITIONS: Transitions[UpstreamState, UpstreamInput] = {
    (_S.CONNECTING, _I.OPENED): _S.BUSY,
    (_S.CONNECTING, _I.OPEN_FAILED): _S.CLOSED,
    (_S.CONNECTING, _I.REUSED): ILLEGAL,  # never in the idle pool yet
    (_S.CONNECTING, _I.RELEASED): ILLEGAL,  # no exchange has it yet
    (_S.CONNECTING, _I.IDLE_TIMEOUT): ILLEGAL,
    (_S.CONNECTING, _I.TUNNEL): ILLEGAL,
    (_S.CONNECTING, _I.CLOSE): _S.CLOSED,  # its exchange stopped waiting (``Pool.forget``)
    (_S.CONNECTING, _I.PEER_CLOSED): _S.CLOSED,  # a failed connect
    (_S.BUSY, _I.OPENED): IGNORED,  # reported twice
    (_S.BUSY, _I.OPEN_FAILED): ILLEGAL,  # the driver reports a close once it opened
    (_S.BUSY, _I.REUSED): ILLEGAL,  # one exchange at a time
    (_S.BUSY, _I.RELEASED): _S.IDLE,
    (_S.BUSY, _I.IDLE_TIMEOUT): ILLEGAL,  # the timer is cancelled when it leaves the pool
    (_S.BUSY, _I.TUNNEL): _S.CLOSED,
    (_S.BUSY, _I.CLOSE): _S.CLOSED,
    (_S.BUSY, _I.PEER_CLOSED): _S.CLOSED,
    (_S.IDLE, _I.OPENED): IGNORED,  # reported twice
    (_S.IDLE, _I.OPEN_FAILED): ILLEGAL,
    (_S.IDLE, _I.REUSED): _S.BUSY,
    (_S.IDLE, _I.RELEASED): ILLEGAL,  # released twice
    (_S.IDLE, _I.IDLE_TIMEOUT): _S.CLOSED,
    (_S.IDLE, _I.TUNNEL): ILLEGAL,  # no exchange, no 101
    (_S.IDLE, _I.CLOSE): _S.CLOSED,  # bytes while idle (RFC 9112 §9.3), a stop, not kept
    (_S.IDLE, _I.PEER_CLOSED): _S.CLOSED,
    (_S.CLOSED, _I.OPENED): IGNORED,  # the outcome of a connect we gave up was on its way
    (_S.CLOSED, _I.OPEN_FAILED): IGNORED,
    (_S.CLOSED, _I.REUSED): ILLEGAL,  # a close takes it out of the idle pool
    # The backend's close ended a response framed by it (``on_closed``), and its exchange
    # lets go of the connection after that.
    (_S.CLOSED, _I.RELEASED): IGNORED,
    (_S.CLOSED, _I.IDLE_TIMEOUT): IGNORED,
    (_S.CLOSED, _I.TUNNEL): ILLEGAL,
    (_S.CLOSED, _I.CLOSE): IGNORED,
    (_S.CLOSED, _I.PEER_CLOSED): IGNORED,
}
del _S, _I


class Progress(enum.Enum):
    """What the connection's current request has come to."""

    __hash__ = object.__hash__  # as ``Phase``'s: a table lookup runs no Python code

    UNWRITTEN = "unwritten"
    """No byte of it reached the kernel yet (it may be sent elsewhere, whatever its method)."""
    WRITTEN = "written"
    """Some byte of it reached the kernel (a ``DataSent``); nothing of its answer arrived."""
    ANSWERED = "answered"
    """Some byte of its response arrived."""


class ProgressInput(enum.Enum):
    __hash__ = object.__hash__  # as ``Phase``'s: a table lookup runs no Python code
    ASSIGNED = "assigned"
    """An exchange takes the connection (new or from the idle pool): its answer is to come."""
    HEAD_SENT = "head_sent"
    """The request's head is handed to the driver: nothing of this request written yet."""
    SENT = "sent"
    """The driver wrote some bytes (``DataSent``)."""
    RECEIVED = "received"
    """Some bytes of the response arrived."""


_P = Progress
_PI = ProgressInput
PROGRESS: dict[tuple[Progress, ProgressInput], Progress] = {
    (_P.UNWRITTEN, _PI.ASSIGNED): _P.UNWRITTEN,
    (_P.UNWRITTEN, _PI.HEAD_SENT): _P.UNWRITTEN,
    (_P.UNWRITTEN, _PI.SENT): _P.WRITTEN,
    (_P.UNWRITTEN, _PI.RECEIVED): _P.ANSWERED,
    # Kept (the last request's bytes were written) until this request's head goes out.
    (_P.WRITTEN, _PI.ASSIGNED): _P.WRITTEN,
    (_P.WRITTEN, _PI.HEAD_SENT): _P.UNWRITTEN,
    (_P.WRITTEN, _PI.SENT): _P.WRITTEN,
    (_P.WRITTEN, _PI.RECEIVED): _P.ANSWERED,
    (_P.ANSWERED, _PI.ASSIGNED): _P.WRITTEN,  # the answered request was written
    (_P.ANSWERED, _PI.HEAD_SENT): _P.ANSWERED,  # bytes came first: never stale
    (_P.ANSWERED, _PI.SENT): _P.ANSWERED,
    (_P.ANSWERED, _PI.RECEIVED): _P.ANSWERED,
}
del _P, _PI
# The members the per-request and per-chunk paths name, bound once: an enum member read off
# its class goes through the metaclass, some ten times the cost of a global.
_UNWRITTEN = Progress.UNWRITTEN
_ANSWERED = Progress.ANSWERED
_ASSIGNED = ProgressInput.ASSIGNED
_HEAD_SENT = ProgressInput.HEAD_SENT
_SENT = ProgressInput.SENT
_RECEIVED = ProgressInput.RECEIVED


class UpstreamConn:
    http_version = b"1.1"

    def __init__(self, fx: Effects, pool: Pool, conn: int, origin: Origin, group: Upstream) -> None:
        self.fx = fx
        self.pool = pool
        self.conn = conn
        self.origin = origin
        self.max_idle = group.pool_max_idle
        self.idle_timeout = group.pool_idle_timeout
        self.adapter = H1Client()
        self.exchange: UpstreamUser | None = None
        self.state = UpstreamState.CONNECTING
        """Changed by ``move`` alone, as ``TRANSITIONS`` says (and by fault isolation)."""
        self.pending = 0
        self.paused = False
        self.requests = 0
        """The requests it was given, the current one included (more than one: reused)."""
        self.progress = Progress.UNWRITTEN
        """Changed by ``advance`` alone, as ``PROGRESS`` says."""

    def move(self, input: UpstreamInput) -> bool:
        """Take ``input`` as ``TRANSITIONS`` says: False where it is ignored."""
        before = self.state
        target = step(TRANSITIONS, "UpstreamConn", before, input)
        if target is not None:
            self.state = target
        if self.fx.moves is not None:
            self.fx.moves.record(self, before, input, self.state)
        return target is not None

    def advance(self, input: ProgressInput) -> None:
        """The current request's ``progress`` after ``input``, as ``PROGRESS`` says."""
        # ``PROGRESS`` ignores and refuses nothing (its test checks): a lookup, not ``step``.
        before = self.progress
        self.progress = PROGRESS[(before, input)]
        if self.fx.moves is not None:
            self.fx.moves.record(self, before, input, self.progress)

    @property
    def stale(self) -> bool:
        """A failure now is the keep-alive race (RFC 9112 §9.3.1), not the server's fault."""
        return self.requests > 1 and self.progress is not _ANSWERED

    @property
    def written(self) -> bool:
        """Some byte of the current request may have reached the backend."""
        return self.progress is not _UNWRITTEN

    def _send(self, data: bytes) -> None:
        if data:
            self.pending += len(data)
            self.fx.send(self.conn, data)

    def send_head(self, stream: int, method: bytes, target: bytes, headers: Headers) -> None:
        self.advance(_HEAD_SENT)
        self._send(self.adapter.send_head(stream, method, target, headers))

    def send_body(self, data: bytes) -> None:
        self._send(self.adapter.send_body(data))

    def send_end(self, trailers: Headers) -> None:
        self._send(self.adapter.send_end(trailers))

    def pause(self) -> None:
        if not self.paused:
            self.paused = True
            self.fx.emit(PauseReading(conn=self.conn))

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self.fx.emit(ResumeReading(conn=self.conn))

    def close(self) -> None:
        if self.move(UpstreamInput.CLOSE):
            self._shut()

    def _shut(self) -> None:
        self.fx.close(self.conn)
        self.pool.discard(self)

    def release(self) -> None:
        self.pool.release(self)

    def become_tunnel(self) -> bytes:
        """The backend switched protocols (its 101, RFC 9110 §15.2.2): the connection leaves
        the pool for good, its bytes are a tunnel's now. Returns the bytes read past the 101."""
        self.move(UpstreamInput.TUNNEL)
        self.exchange = None
        self.pool.discard(self)
        return self.adapter.trailing_data()

    # -- events from the driver ------------------------------------------------------------

    def on_opened(self) -> None:
        if self.move(UpstreamInput.OPENED):
            self.pool.opened(self)

    def on_open_failed(self, reason: str) -> None:
        if self.move(UpstreamInput.OPEN_FAILED):
            self.pool.open_failed(self, reason)

    def on_timer(self) -> None:
        if self.move(UpstreamInput.IDLE_TIMEOUT):
            self._shut()

    def on_data(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:
            # Bytes from an idle backend (RFC 9112 §9.3: nothing may arrive between
            # responses): the connection is unusable, and the bytes must never be read as
            # the answer to the next request on it.
            if data and self.state is UpstreamState.IDLE:
                self.pool.trailing_bytes(self)
            self.close()
            return
        if data and self.progress is not _ANSWERED:
            self.advance(_RECEIVED)
        adapter = self.adapter
        extra = adapter.extra
        messages = adapter.receive(data)
        if adapter.extra and not extra:
            # Bytes past the end of the response (``h1client.py``): ``Pool.release`` will
            # close the connection rather than keep it.
            self.pool.trailing_bytes(self)
        for message in messages:
            if self.exchange is not exchange:
                # The exchange let go of this connection while handling an earlier message
                # of this read (e.g. a retried 503 head): the rest belongs to the abandoned
                # attempt and must not reach the exchange's next attempt.
                return
            if type(message) is Body:
                exchange.response_body(message.data)
            elif type(message) is ResponseHead:
                exchange.response_head(message)
            elif type(message) is End:
                exchange.response_end(message.trailers)
                return
            elif type(message) is Abort:
                exchange.upstream_failed(message.reason, stale=self.stale)
                return

    def on_sent(self, nbytes: int) -> None:
        self.pending -= nbytes
        if self.progress is _UNWRITTEN:
            self.advance(_SENT)
        if self.exchange is not None:
            self.exchange.upstream_drained()

    def on_closed(self, error: str | None) -> None:
        was = self.state
        if not self.move(UpstreamInput.PEER_CLOSED):
            return
        if was is UpstreamState.CONNECTING:
            # An embedder may report a connect it gave up on as closed rather than (or
            # before) OpenFailed: the same failure for whoever waits for it.
            self.pool.open_failed(self, error or "connection closed while connecting")
            return
        self.pool.discard(self)
        exchange = self.exchange
        if exchange is None:
            return
        # On a clean close h11 decides whether EOF ends the response (read-until-close
        # framing) or truncates it (inside a Content-Length or chunked body). A broken one
        # (reset, failed write, TLS close without close_notify) ends nothing: a body framed
        # by the close is complete only after a clean one (RFC 9112 §8, §9.8).
        if error is None:
            self.on_data(b"")
        if self.exchange is not None:
            self.exchange.upstream_failed(
                error or "backend closed the connection", stale=self.stale
            )


class Pool:
    """Backend connections of one core (``ports.Backends``, for exchanges and probes)."""

    def __init__(
        self,
        fx: Effects,
        upstreams: dict[int, BackendConnection],
        new_id: Callable[[], int],
        defences: DefenceLog,
    ) -> None:
        """``upstreams``: the core's table of backend connections by id, which the pool keeps
        (a connection is entered when opened, removed once closed); ``new_id``: a fresh
        (negative) connection id; ``defences``: where a backend's trailing bytes are counted
        and logged."""
        self.fx = fx
        self.defences = defences
        self.upstreams = upstreams
        self.new_id = new_id
        self.h2 = H2Pool(fx, upstreams, new_id)
        """HTTP/2 servers' shared connections (``protocol = "h2"``)."""
        self.idle: dict[Origin, list[UpstreamConn]] = {}
        self.waiting: dict[int, UpstreamUser] = {}
        """Exchange waiting for each connecting connection."""

    def acquire(
        self, origin: Origin, group: Upstream, exchange: UpstreamUser, *, fresh: bool = False
    ) -> None:
        """Give ``exchange`` a connection to ``origin``: an idle one now, or a new one later
        (always a new one with ``fresh``: the retry after a stale pooled connection)."""
        fx = self.fx
        server = group.server_at(origin.host, origin.port)
        if server is not None and server.protocol == "h2":
            self.h2.acquire(origin, group, server, exchange)
            return
        idle = None if fresh else self.idle.get(origin)
        if idle:
            upstream = idle.pop()
            fx.cancel_timer((BackendTimer.POOL, upstream.conn))
            upstream.move(UpstreamInput.REUSED)  # every connection in ``idle`` is IDLE
            self._assign(upstream, exchange)
            return
        upstream = UpstreamConn(fx, self, self.new_id(), origin, group)
        self.upstreams[upstream.conn] = upstream
        self.waiting[upstream.conn] = exchange
        fx.emit(OpenConnection(conn=upstream.conn, origin=origin))

    def _assign(self, upstream: UpstreamConn, exchange: UpstreamUser) -> None:
        """BUSY now (``OPENED`` or ``REUSED``): ``exchange``'s."""
        upstream.exchange = exchange
        upstream.requests += 1
        upstream.advance(_ASSIGNED)
        exchange.upstream_ready(upstream)

    def opened(self, upstream: UpstreamConn) -> None:
        # Someone waits for every connection still in ``self.upstreams`` while it connects:
        # ``forget`` closes the connects no one waits for, and a closed one gets no events.
        self._assign(upstream, self.waiting.pop(upstream.conn))

    def open_failed(self, upstream: UpstreamConn, reason: str) -> None:
        """The connect failed (``upstream`` is CLOSED): whoever waits for it fails."""
        exchange = self.waiting.pop(upstream.conn, None)
        self.discard(upstream)
        if exchange is not None:
            exchange.upstream_failed(f"connect to {upstream.origin} failed: {reason}")

    def forget(self, exchange: UpstreamUser) -> None:
        """``exchange`` no longer waits for the connection being opened for it: close it."""
        self.h2.forget(exchange)
        for conn, waiting in list(self.waiting.items()):
            if waiting is exchange:
                upstream = self.upstreams[conn]
                upstream.close()  # which drops the ``waiting`` entry (``discard``)

    def release(self, upstream: UpstreamConn) -> None:
        """Return a connection whose exchange is done; keep it if it can carry another."""
        fx = self.fx
        adapter = upstream.adapter
        if not upstream.move(UpstreamInput.RELEASED):
            return  # the backend closed it first
        if not adapter.reusable or fx.shutting_down:
            # Stopping (shutdown.py): a connection whose exchange ended is not kept.
            upstream.close()
            return
        adapter.next_cycle()
        group_idle = self.idle.setdefault(upstream.origin, [])
        if len(group_idle) >= upstream.max_idle:
            upstream.close()
            return
        upstream.exchange = None
        upstream.resume()
        group_idle.append(upstream)
        fx.set_timer((BackendTimer.POOL, upstream.conn), fx.now + upstream.idle_timeout)

    def trailing_bytes(self, upstream: UpstreamConn) -> None:
        """``upstream``'s backend sent bytes after a complete response (RFC 9112 §9.3): the
        connection is closed rather than reused; counted and logged (``defencelog.py``)."""
        self.defences.record(
            "upstream_trailing_bytes",
            None,
            server=str(upstream.origin),
            conn=upstream.conn,
        )

    def shutdown(self) -> None:
        """A graceful stop began: idle connections close now, busy ones when their exchange
        ends (``release``); HTTP/2 ones when their last stream ends (``H2Pool.ready``)."""
        for idle in self.idle.values():
            for upstream in list(idle):
                upstream.close()  # which takes it out of ``idle`` (``discard``)
        self.h2.shutdown()

    def discard(self, upstream: UpstreamConn) -> None:
        """Forget a connection that closed (or never opened), and whoever waited for it."""
        fx = self.fx
        self.upstreams.pop(upstream.conn, None)
        self.waiting.pop(upstream.conn, None)
        fx.cancel_timer((BackendTimer.POOL, upstream.conn))
        idle = self.idle.get(upstream.origin)
        if idle and upstream in idle:
            idle.remove(upstream)

    def idle_timeout(self, conn: int) -> None:
        upstream = self.upstreams.get(conn)
        if upstream is not None:
            upstream.on_timer()
