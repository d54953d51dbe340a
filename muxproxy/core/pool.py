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
from typing import TYPE_CHECKING, Protocol

from .commands import OpenConnection, Origin, PauseReading, ResumeReading
from .h1 import H1Client
from .h2pool import H2Pool
from .messages import Abort, Body, End, Headers, ResponseHead

if TYPE_CHECKING:
    from ..config import Upstream
    from .proxy import ProxyCore


class UpstreamUser(Protocol):
    """What a backend connection talks to: an exchange, or a health probe."""

    def upstream_ready(self, upstream: UpstreamStream) -> None: ...
    def upstream_drained(self) -> None: ...
    def response_head(self, head: ResponseHead) -> None: ...
    def response_body(self, data: bytes) -> None: ...
    def response_end(self, trailers: Headers) -> None: ...
    def upstream_failed(self, reason: str, *, timeout: bool = False, stale: bool = False) -> None:
        """The backend stream failed. ``stale``: on a reused keep-alive connection, before any
        response byte arrived (RFC 9112 §9.3.1: the backend may have closed it while we picked
        it), or an HTTP/2 stream above a GOAWAY's last_stream_id (RFC 9113 §8.7: never
        processed), so a retry on a fresh connection to the same server is safe to consider."""


class UpstreamStream(Protocol):
    """One request/response on a backend, whatever the protocol: what an exchange talks to.

    ``UpstreamConn`` (HTTP/1.1, the whole connection) and ``h2pool.H2Stream`` (one stream of a
    shared HTTP/2 connection) implement it.
    """

    exchange: UpstreamUser | None
    http_version: bytes

    @property
    def pending(self) -> int:
        """Request bytes taken from the exchange and not yet written to the backend."""

    @property
    def paused(self) -> bool: ...

    def send_head(self, stream: int, method: bytes, target: bytes, headers: Headers) -> None: ...
    def send_body(self, data: bytes) -> None: ...
    def send_end(self, trailers: Headers) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def close(self) -> None:
        """Abandon the request (h1: close the connection; h2: RST_STREAM(CANCEL))."""

    def release(self) -> None:
        """The exchange completed cleanly: the connection may carry another request."""


class BackendConnection(Protocol):
    """A backend connection as ``ProxyCore`` dispatches driver events to it."""

    conn: int

    def on_opened(self) -> None: ...
    def on_open_failed(self, reason: str) -> None: ...
    def on_data(self, data: bytes) -> None: ...
    def on_sent(self, nbytes: int) -> None: ...
    def on_closed(self, error: str | None) -> None: ...
    def on_timer(self) -> None: ...
    def close(self) -> None: ...


class UpstreamState(enum.Enum):
    CONNECTING = "connecting"
    BUSY = "busy"
    IDLE = "idle"
    CLOSED = "closed"


class UpstreamConn:
    http_version = b"1.1"

    def __init__(self, core: ProxyCore, conn: int, origin: Origin, group: Upstream) -> None:
        self.core = core
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
            self.core.send(self.conn, data)

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
            self.core.emit(PauseReading(conn=self.conn))

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self.core.emit(ResumeReading(conn=self.conn))

    def close(self) -> None:
        if self.state is not UpstreamState.CLOSED:
            self.state = UpstreamState.CLOSED
            self.core.close(self.conn)
            self.core.pool.discard(self)

    def release(self) -> None:
        self.core.pool.release(self)

    # -- events from the driver ------------------------------------------------------------

    def on_opened(self) -> None:
        if self.state is UpstreamState.CONNECTING:  # not a second report of the same connect
            self.core.pool.opened(self)

    def on_open_failed(self, reason: str) -> None:
        self.core.pool.open_failed(self, reason)

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
            self.core.pool.open_failed(self, error or "connection closed while connecting")
            return
        self.state = UpstreamState.CLOSED
        self.core.pool.discard(self)
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
    def __init__(self, core: ProxyCore) -> None:
        self.core = core
        self.h2 = H2Pool(core)
        """HTTP/2 servers' shared connections (``protocol = "h2"``)."""
        self.idle: dict[Origin, list[UpstreamConn]] = {}
        self.waiting: dict[int, UpstreamUser] = {}
        """Exchange waiting for each connecting connection."""

    def acquire(
        self, origin: Origin, group: Upstream, exchange: UpstreamUser, *, fresh: bool = False
    ) -> None:
        """Give ``exchange`` a connection to ``origin``: an idle one now, or a new one later
        (always a new one with ``fresh``: the retry after a stale pooled connection)."""
        core = self.core
        server = group.server_at(origin.host, origin.port)
        if server is not None and server.protocol == "h2":
            self.h2.acquire(origin, group, server, exchange)
            return
        idle = None if fresh else self.idle.get(origin)
        while idle:
            upstream = idle.pop()
            core.cancel_timer(("pool", upstream.conn))
            if upstream.state is UpstreamState.IDLE:
                upstream.reused = True
                self._assign(upstream, exchange)
                return
        upstream = UpstreamConn(core, core.new_upstream_id(), origin, group)
        core.upstreams[upstream.conn] = upstream
        self.waiting[upstream.conn] = exchange
        core.emit(OpenConnection(conn=upstream.conn, origin=origin))

    def _assign(self, upstream: UpstreamConn, exchange: UpstreamUser) -> None:
        upstream.state = UpstreamState.BUSY
        upstream.exchange = exchange
        upstream.received = False
        exchange.upstream_ready(upstream)

    def opened(self, upstream: UpstreamConn) -> None:
        # Someone waits for every connection still in ``core.upstreams`` while it connects:
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
                upstream = self.core.upstreams[conn]
                upstream.close()  # which drops the ``waiting`` entry (``discard``)

    def release(self, upstream: UpstreamConn) -> None:
        """Return a connection whose exchange is done; keep it if it can carry another."""
        core = self.core
        adapter = upstream.adapter
        if upstream.state is not UpstreamState.BUSY:
            return
        if not adapter.reusable or core.shutting_down:
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
        core.set_timer(("pool", upstream.conn), core.now + upstream.idle_timeout)

    def shutdown(self) -> None:
        """A graceful stop began: idle connections close now, busy ones when their exchange
        ends (``release``); HTTP/2 ones when their last stream ends (``H2Pool.ready``)."""
        for idle in self.idle.values():
            for upstream in list(idle):
                upstream.close()  # which takes it out of ``idle`` (``discard``)
        self.h2.shutdown()

    def discard(self, upstream: UpstreamConn) -> None:
        """Forget a connection that closed (or never opened), and whoever waited for it."""
        core = self.core
        core.upstreams.pop(upstream.conn, None)
        self.waiting.pop(upstream.conn, None)
        core.cancel_timer(("pool", upstream.conn))
        idle = self.idle.get(upstream.origin)
        if idle and upstream in idle:
            idle.remove(upstream)

    def idle_timeout(self, conn: int) -> None:
        upstream = self.core.upstreams.get(conn)
        if upstream is not None:
            upstream.on_timer()
