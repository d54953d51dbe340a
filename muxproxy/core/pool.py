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
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

from .commands import OpenConnection, Origin, PauseReading, ResumeReading
from .effects import Effects
from .h1 import H1Client
from .h2pool import H2Pool
from .messages import Abort, Body, End, Headers, ResponseHead
from .ports import BackendConnection, UpstreamStream, UpstreamUser
from .timers import BackendTimer

if TYPE_CHECKING:
    from ..config import Upstream

__all__ = ["BackendConnection", "Pool", "UpstreamConn", "UpstreamState", "UpstreamStream"]


class UpstreamState(enum.Enum):
    CONNECTING = "connecting"
    BUSY = "busy"
    IDLE = "idle"
    CLOSED = "closed"


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
        self.pending = 0
        self.paused = False
        self.reused = False
        """The current request is not the connection's first (it came from the idle pool)."""
        self.received = False
        """Some byte of the current request's response arrived."""
        self.written = False
        """Some byte of the current request reached the kernel (a ``DataSent``)."""

    @property
    def stale(self) -> bool:
        """A failure now is the keep-alive race (RFC 9112 §9.3.1), not the server's fault."""
        return self.reused and not self.received

    def _send(self, data: bytes) -> None:
        if data:
            self.pending += len(data)
            self.fx.send(self.conn, data)

    def send_head(self, stream: int, method: bytes, target: bytes, headers: Headers) -> None:
        self.written = False
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
        if self.state is not UpstreamState.CLOSED:
            self.state = UpstreamState.CLOSED
            self.fx.close(self.conn)
            self.pool.discard(self)

    def release(self) -> None:
        self.pool.release(self)

    def become_tunnel(self) -> bytes:
        """The backend switched protocols (its 101, RFC 9110 §15.2.2): the connection leaves
        the pool for good, its bytes are a tunnel's now. Returns the bytes read past the 101."""
        self.exchange = None
        self.state = UpstreamState.CLOSED
        self.pool.discard(self)
        return self.adapter.trailing_data()

    # -- events from the driver ------------------------------------------------------------

    def on_opened(self) -> None:
        if self.state is UpstreamState.CONNECTING:  # not a second report of the same connect
            self.pool.opened(self)

    def on_open_failed(self, reason: str) -> None:
        self.pool.open_failed(self, reason)

    def on_timer(self) -> None:
        if self.state is UpstreamState.IDLE:
            self.close()

    def on_data(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:
            # Bytes from an idle backend (RFC 9112 §9.3: nothing may arrive between
            # responses): the connection is unusable.
            self.close()
            return
        if data:
            self.received = True
        for message in self.adapter.receive(data):
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
        self.written = True
        if self.exchange is not None:
            self.exchange.upstream_drained()

    def on_closed(self, error: str | None) -> None:
        was = self.state
        if was is UpstreamState.CONNECTING:
            # An embedder may report a connect it gave up on as closed rather than (or
            # before) OpenFailed: the same failure for whoever waits for it.
            self.pool.open_failed(self, error or "connection closed while connecting")
            return
        self.state = UpstreamState.CLOSED
        self.pool.discard(self)
        exchange = self.exchange
        if exchange is None or was is UpstreamState.CLOSED:
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
    ) -> None:
        """``upstreams``: the core's table of backend connections by id, which the pool keeps
        (a connection is entered when opened, removed once closed); ``new_id``: a fresh
        (negative) connection id."""
        self.fx = fx
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
        while idle:
            upstream = idle.pop()
            fx.cancel_timer((BackendTimer.POOL, upstream.conn))
            if upstream.state is UpstreamState.IDLE:
                upstream.reused = True
                self._assign(upstream, exchange)
                return
        upstream = UpstreamConn(fx, self, self.new_id(), origin, group)
        self.upstreams[upstream.conn] = upstream
        self.waiting[upstream.conn] = exchange
        fx.emit(OpenConnection(conn=upstream.conn, origin=origin))

    def _assign(self, upstream: UpstreamConn, exchange: UpstreamUser) -> None:
        upstream.state = UpstreamState.BUSY
        upstream.exchange = exchange
        upstream.received = False
        exchange.upstream_ready(upstream)

    def opened(self, upstream: UpstreamConn) -> None:
        # Someone waits for every connection still in ``self.upstreams`` while it connects:
        # ``forget`` closes the connects no one waits for, and a closed one gets no events.
        self._assign(upstream, self.waiting.pop(upstream.conn))

    def open_failed(self, upstream: UpstreamConn, reason: str) -> None:
        upstream.state = UpstreamState.CLOSED
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
        if upstream.state is not UpstreamState.BUSY:
            return
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
        upstream.state = UpstreamState.IDLE
        upstream.resume()
        group_idle.append(upstream)
        fx.set_timer((BackendTimer.POOL, upstream.conn), fx.now + upstream.idle_timeout)

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
