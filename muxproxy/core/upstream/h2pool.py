"""HTTP/2 backends: streams of every client multiplexed onto a few shared connections.

Obeys RFC 9113: §5.1.2 (at most the backend's SETTINGS_MAX_CONCURRENT_STREAMS open streams per
connection: a stream is only started once the backend's first SETTINGS said how many), §3.4 (the
backend's SETTINGS is due first: a connection that sends none within the connect timeout is
closed, its waiting requests fail as timeouts), §6.8 (GOAWAY, whenever it comes, even in the
same read as the first SETTINGS: streams up to last_stream_id finish, the connection takes no
new ones, a new connection serves the rest; a stream above it was never processed, so §8.7
makes it safe to retry, and it is reported ``stale`` like HTTP/1.1's keep-alive race), §6.7
(PING keeps an idle connection alive and proves it is), §8.7 (a client that goes away cancels
its backend stream with RST_STREAM(CANCEL), not the shared connection), §5.2/§6.9 (flow control
per stream, end to end), §5.1.1 (stream ids are never reused: a connection that used the last
one drains like after a GOAWAY).

Policy, per server: up to ``max_connections`` connections (draining ones not counted). A request
takes a free stream on a ready connection; with none free it waits in a FIFO per server, bounded
by ``MAX_WAITING`` (beyond it the request fails at once, like a refused connect: retried on the
next server or answered 502) and by the exchange's connect timeout (then 504). A new connection
is opened while requests wait, none is being opened and the server is below ``max_connections``.

Response backpressure: the stream acknowledges the backend's DATA (WINDOW_UPDATE) as soon as the
bytes were handed to the client side, unless the exchange paused it (the client's buffer is
above high water); then acknowledgements are withheld until it resumes. The backend's window
for that one stream closes; the connection and every other stream go on.

A connection's states (``H2State``) and what moves them (``H2Input``) are one table,
``TRANSITIONS`` (``states.py``). The backend's first SETTINGS and its GOAWAY are inputs when
they arrive (once each, seen by what ``H2Client`` knew before and after a read); no byte comes
before the connect opened and no stream is opened before READY, so those pairs are refused.
The timer is the start timer until READY and the keep-alive after; what it ends, it ends by
``close`` (``CLOSE``).

A stream's own life (``StreamState``: no id yet, open, done) is the small table ``STREAM``:
its id comes with its head, once; it is done once (its slot freed, or its connection gone), and
a second end is one already on its way.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, assert_never

from muxproxy.core.commands import Log, OpenConnection, Origin
from muxproxy.core.effects import Effects
from muxproxy.core.flow import Flow
from muxproxy.core.http.headers import upstream_h2_headers
from muxproxy.core.http2.h2client import H2Client
from muxproxy.core.messages import Abort, Body, End, Headers, ResponseHead
from muxproxy.core.ports import BackendConnection, UpstreamUser
from muxproxy.core.states import IGNORED, ILLEGAL, Transitions, step
from muxproxy.core.timers import BackendTimer
from muxproxy.core.upstream.h2upstream_states import TRANSITIONS as TRANSITIONS
from muxproxy.core.upstream.h2upstream_states import H2Input as H2Input
from muxproxy.core.upstream.h2upstream_states import H2State as H2State

if TYPE_CHECKING:
    from muxproxy.config import Server, Upstream

# Requests that may wait for a free stream per server before new ones fail at once.
MAX_WAITING = 1024
# An idle connection is PINGed this often (at most a third of the idle timeout); a PING not
# acknowledged by the next one means the connection is dead.
PING_INTERVAL = 20.0


class StreamState(enum.Enum):
    __hash__ = object.__hash__  # as ``Phase``'s: a table lookup runs no Python code
    UNSTARTED = "unstarted"
    """Granted a slot; its head (and so its id) not sent yet."""
    OPEN = "open"
    DONE = "done"
    """Ended (its slot freed), or its connection went away."""


class StreamInput(enum.Enum):
    __hash__ = object.__hash__  # as ``Phase``'s: a table lookup runs no Python code
    START = "start"
    """Its head goes out and it gets its id (``send_head``)."""
    FINISH = "finish"
    """It ends: released, cancelled, reset by the backend, or its connection closed."""


STREAM: Transitions[StreamState, StreamInput] = {
    (StreamState.UNSTARTED, StreamInput.START): StreamState.OPEN,
    (StreamState.UNSTARTED, StreamInput.FINISH): StreamState.DONE,
    (StreamState.OPEN, StreamInput.START): ILLEGAL,  # one head per stream
    (StreamState.OPEN, StreamInput.FINISH): StreamState.DONE,
    (StreamState.DONE, StreamInput.START): ILLEGAL,  # its exchange let go of it
    (StreamState.DONE, StreamInput.FINISH): IGNORED,  # an exchange's close after the reset
}

_OPEN = StreamState.OPEN  # bound once: read off its class, a member costs a metaclass lookup


class H2Stream:
    """One exchange's stream on a shared backend connection (``pool.UpstreamStream``)."""

    http_version = b"2"

    def __init__(self, upstream: H2Upstream, exchange: UpstreamUser) -> None:
        self.upstream = upstream
        self.exchange: UpstreamUser | None = exchange
        self.sid = 0
        self.flow = Flow()
        """Stopped by the exchange (``pause`` / ``resume``, its ``response_flow`` decides);
        its credit: response flow-controlled bytes withheld from the backend meanwhile."""
        self.state = StreamState.UNSTARTED
        """Changed by ``move`` alone, as ``STREAM`` says."""
        self.refused = False
        """The backend's GOAWAY said it will not process this stream (RFC 9113 §6.8): how it
        ended, kept after it is DONE for the retry's question (``written``)."""

    def move(self, input: StreamInput) -> bool:
        """Take ``input`` as ``STREAM`` says: False where it is ignored."""
        before = self.state
        target = step(STREAM, "H2Stream", before, input)
        if target is not None:
            self.state = target
        moves = self.upstream.fx.moves
        if moves is not None:
            moves.record(self, before, input, self.state)
        return target is not None

    @property
    def pending(self) -> int:
        """Request bytes not yet written: the stream's send queue plus the connection's."""
        return self.upstream.client.queued(self.sid) + self.upstream.pending

    @property
    def written(self) -> bool:
        """The backend may have processed the request: false once a GOAWAY refused the stream
        (what ``Exchange`` asks before a ``stale`` retry of a non-idempotent request)."""
        return not self.refused

    def send_head(
        self,
        stream: int,
        method: bytes,
        target: bytes,
        headers: Headers,
        *,
        protocol: bytes | None = None,
    ) -> None:
        """Open the stream; ``protocol``: an RFC 8441 extended CONNECT (``:protocol``)."""
        self.move(StreamInput.START)
        up = self.upstream
        scheme = b"https" if up.origin.tls else b"http"
        fields = upstream_h2_headers(method, scheme, target, headers)
        if protocol is not None:
            fields.insert(1, (b":protocol", protocol))
        self.sid = up.client.start_request(fields)
        up.streams[self.sid] = self
        up.flush()
        if not up.client.stream_ids_left:
            up.retire()

    def send_body(self, data: bytes) -> None:
        if self.state is _OPEN:
            self.upstream.client.send_body(self.sid, data)
            self.upstream.flush()

    def send_end(self, trailers: Headers) -> None:
        if self.state is _OPEN:
            fields = [(name.lower(), value) for name, value in trailers]
            self.upstream.client.send_end(self.sid, fields)
            self.upstream.flush()

    @property
    def paused(self) -> bool:
        return self.flow.stopped

    def pause(self) -> None:
        self.flow.stop()

    def resume(self) -> None:
        if self.flow.resume():
            self._ack()

    def took(self, flow_len: int) -> None:
        """The exchange handed a DATA frame's bytes on: acknowledge unless paused."""
        flow = self.flow
        flow.hold(flow_len)
        if not flow.stopped:
            self._ack()

    def _ack(self) -> None:
        if self.flow.withheld and self.sid:
            self.upstream.client.acknowledge(self.sid, self.flow.release())
            self.upstream.flush()

    def close(self) -> None:
        """The exchange gives up on the stream: RST_STREAM(CANCEL) if it is still open."""
        if self.state is _OPEN:
            self.upstream.client.cancel(self.sid)
            self.upstream.flush()
        self._finish()

    def release(self) -> None:
        """The exchange completed cleanly: free the stream's slot."""
        if self.sid:
            self.upstream.client.forget(self.sid)
        self._finish()

    def _finish(self) -> None:
        self.exchange = None
        if self.move(StreamInput.FINISH):
            self.upstream.stream_finished(self)


class H2Upstream:
    """One HTTP/2 connection to a backend (a ``pool.BackendConnection``)."""

    def __init__(
        self, pool: H2Pool, conn: int, origin: Origin, group: Upstream, server: Server
    ) -> None:
        self.pool = pool
        self.fx = pool.fx
        self.conn = conn
        self.origin = origin
        self.server = server
        self.idle_timeout = group.pool_idle_timeout
        self.start_deadline = self.fx.now + (
            group.timeouts.connect or self.fx.config.timeouts.connect
        )
        """Connected with the backend's first SETTINGS by then, or given up (RFC 9113 §3.4)."""
        self.client = H2Client(initial_window=min(65535, self.fx.read_size))
        self.state = H2State.CONNECTING
        """Changed by ``move`` alone, as ``TRANSITIONS`` says (and by fault isolation)."""
        self.streams: dict[int, H2Stream] = {}
        self.pending = 0
        self.paused = False
        self.idle_since = self.fx.now
        self.ping_sent = False

    def move(self, input: H2Input) -> bool:
        """Take ``input`` as ``TRANSITIONS`` says: False where it is ignored."""
        before = self.state
        target = step(TRANSITIONS, "H2Upstream", before, input)
        if target is not None:
            self.state = target
        moves = self.fx.moves
        if moves is not None:
            moves.record(self, before, input, self.state)
        return target is not None

    @property
    def free_streams(self) -> int:
        if self.state is not H2State.READY:
            return 0
        return self.client.max_concurrent_streams - self.client.open_streams

    def flush(self) -> None:
        data = self.client.data_to_send()
        if self.state is not H2State.CLOSED:
            self._send(data)

    def _send(self, data: bytes) -> None:
        if data:
            self.pending += len(data)
            self.fx.send(self.conn, data)

    # -- driver events (BackendConnection) -------------------------------------------------

    def on_opened(self) -> None:
        if self.move(H2Input.OPENED):
            self.flush()  # the client preface and our SETTINGS (RFC 9113 §3.4)

    def on_open_failed(self, reason: str) -> None:
        if self.move(H2Input.OPEN_FAILED):
            self.pool.discard(self, f"connect to {self.origin} failed: {reason}")

    def on_data(self, data: bytes) -> None:
        client = self.client
        had_settings = client.settings_received
        had_goaway = client.goaway_last_stream is not None
        messages = client.receive(data)
        went_away = (
            not had_goaway and client.goaway_last_stream is not None and self.move(H2Input.GOAWAY)
        )
        if went_away:
            # Before the messages: a refused stream retried below must not come back here,
            # and a GOAWAY in the same read as the first SETTINGS means no stream at all.
            fields = {"upstream": str(self), "last_stream": client.goaway_last_stream}
            self.fx.emit(Log(event="upstream_goaway", fields=fields))
        elif not had_settings and client.settings_received and self.move(H2Input.SETTINGS):
            self.pool.ready(self)
        for message in messages:
            stream = self.streams.get(message.stream)
            exchange = stream.exchange if stream is not None else None
            if stream is None or exchange is None:
                if type(message) is Body:
                    client.acknowledge(message.stream, message.flow_len)
                continue
            if type(message) is Body:
                exchange.response_body(message.data)
                stream.took(message.flow_len)
            elif type(message) is ResponseHead:
                exchange.response_head(message)
            elif type(message) is End:
                exchange.response_end(message.trailers)
            elif type(message) is Abort:
                # The adapter already forgot the stream, so the exchange's close sends no RST.
                stream.refused = client.refused(message.stream)
                exchange.upstream_failed(message.reason, stale=stream.refused)
                if stream.move(StreamInput.FINISH):
                    stream.exchange = None
                    self.stream_finished(stream)
        if client.window_changed:
            for sid in client.flush_blocked():
                stream = self.streams.get(sid)
                if stream is not None and stream.exchange is not None:
                    stream.exchange.upstream_drained()
        if went_away and self.state is H2State.DRAINING:
            if self.streams:
                self.pool.draining(self)
            else:
                self.close("backend sent GOAWAY")
        self.flush()
        if client.closed:
            self.close()

    def on_sent(self, nbytes: int) -> None:
        self.pending -= nbytes
        for stream in list(self.streams.values()):
            if stream.exchange is not None:
                stream.exchange.upstream_drained()

    def on_closed(self, error: str | None) -> None:
        if not self.move(H2Input.PEER_CLOSED):
            return
        reason = error or "backend closed the connection"
        for stream in list(self.streams.values()):
            exchange = stream.exchange
            stream.exchange = None
            stream.move(StreamInput.FINISH)
            if exchange is not None:
                exchange.upstream_failed(reason)
        self.streams.clear()
        self.pool.discard(self, reason)

    def on_timer(self) -> None:
        """The start timer (connected, with the backend's SETTINGS, by ``start_deadline``), then
        the keep-alive timer: PING an idle connection, close it after the idle timeout."""
        state = self.state
        match state:
            case H2State.CONNECTING | H2State.STARTING:
                # RFC 9113 §3.4: the server's preface is a SETTINGS frame; a backend that is up
                # at TCP but sends none cannot take a stream, and must not hold the requests
                # that wait for it (nor keep the pool from opening another connection) for ever.
                what = "connect" if state is H2State.CONNECTING else "SETTINGS"
                fields = {"upstream": str(self), "wait": what}
                self.fx.emit(Log(event="upstream_start_timeout", fields=fields))
                reason = f"no {what} from {self.origin} within the connect timeout"
                self.close(reason, timeout=True)
            case H2State.READY | H2State.DRAINING:
                if not self.streams:
                    self._keep_alive()
            case H2State.CLOSED:
                pass  # cancelled with the close (``H2Pool.discard``); a late call
            case _:
                assert_never(state)

    def _keep_alive(self) -> None:
        now = self.fx.now
        deadline = self.idle_since + self.idle_timeout
        if now >= deadline:
            self.close()
            return
        if self.ping_sent and not self.client.ping_acked:
            self.fx.emit(Log(event="upstream_ping_timeout", fields={"upstream": str(self)}))
            self.close()
            return
        self.client.ping()
        self.ping_sent = True
        self.flush()
        self.fx.set_timer(
            (BackendTimer.POOL, self.conn), min(now + self._ping_interval(), deadline)
        )

    def _ping_interval(self) -> float:
        return min(PING_INTERVAL, self.idle_timeout / 3)

    def close(self, reason: str = "connection closed", *, timeout: bool = False) -> None:
        """Close the connection; with no other to serve them, the requests that wait for a
        stream to ``origin`` fail with ``reason`` (``timeout``: as a timeout)."""
        was = self.state
        if not self.move(H2Input.CLOSE):
            return
        if was is not H2State.CONNECTING:
            self.client.goaway()
            self._send(self.client.data_to_send())
        self.fx.close(self.conn)
        self.pool.discard(self, reason, timeout=timeout)

    def __str__(self) -> str:
        return f"{self.origin} (h2, conn {self.conn})"

    # -- streams ---------------------------------------------------------------------------

    def retire(self) -> None:
        """The last stream id is taken (RFC 9113 §5.1.1): drain, new streams go elsewhere."""
        if not self.move(H2Input.RETIRE):
            return
        self.fx.emit(Log(event="upstream_stream_ids_used", fields={"upstream": str(self)}))
        self.pool.draining(self)

    def stream_finished(self, stream: H2Stream) -> None:
        if self.streams.get(stream.sid) is stream:
            del self.streams[stream.sid]
        self.flush()
        if self.state is H2State.DRAINING and not self.streams:
            self.close()
            return
        if self.state is not H2State.READY:
            return
        if not self.streams:
            self.idle_since = self.fx.now
            self.ping_sent = False
            self.fx.set_timer((BackendTimer.POOL, self.conn), self.fx.now + self._ping_interval())
        # The freed stream goes to a waiting request once the current event is handled, not
        # while the exchange that released it is still finishing (``Effects.defer``).
        self.fx.defer(self.conn, lambda: self.pool.ready(self))

    def take(self, exchange: UpstreamUser) -> None:
        self.fx.cancel_timer((BackendTimer.POOL, self.conn))
        exchange.upstream_ready(H2Stream(self, exchange))


class H2Pool:
    """Every h2 backend connection, and the requests waiting for a free stream."""

    def __init__(
        self, fx: Effects, upstreams: dict[int, BackendConnection], new_id: Callable[[], int]
    ) -> None:
        """``upstreams`` and ``new_id``: as for ``pool.Pool``, whose table this shares."""
        self.fx = fx
        self.upstreams = upstreams
        self.new_id = new_id
        self.conns: dict[Origin, list[H2Upstream]] = {}
        self.waiting: dict[Origin, deque[UpstreamUser]] = {}
        self.servers: dict[Origin, tuple[Upstream, Server]] = {}

    def acquire(self, origin: Origin, group: Upstream, server: Server, user: UpstreamUser) -> None:
        self.servers[origin] = (group, server)
        for upstream in self.conns.get(origin, ()):
            if upstream.free_streams > 0:
                upstream.take(user)
                return
        queue = self.waiting.setdefault(origin, deque())
        if len(queue) >= MAX_WAITING:
            user.upstream_failed(f"{MAX_WAITING} requests already wait for {origin}")
            return
        queue.append(user)
        self._maybe_open(origin)

    def _maybe_open(self, origin: Origin) -> None:
        if not self.waiting.get(origin):
            return
        group, server = self.servers[origin]
        live = [
            u
            for u in self.conns.get(origin, ())
            if u.state in (H2State.CONNECTING, H2State.STARTING, H2State.READY)
        ]
        if any(u.state is not H2State.READY for u in live) or len(live) >= server.max_connections:
            return  # a connection on its way will take them, or they wait for a free stream
        fx = self.fx
        upstream = H2Upstream(self, self.new_id(), origin, group, server)
        self.upstreams[upstream.conn] = upstream
        self.conns.setdefault(origin, []).append(upstream)
        fx.emit(OpenConnection(conn=upstream.conn, origin=origin))
        fx.set_timer((BackendTimer.POOL, upstream.conn), upstream.start_deadline)

    def ready(self, upstream: H2Upstream) -> None:
        """``upstream`` may have free streams: give them to the waiting requests. While
        stopping (shutdown.py), one left without a stream closes instead of idling."""
        origin = upstream.origin
        queue = self.waiting.get(origin)
        while queue and upstream.free_streams > 0:
            upstream.take(queue.popleft())
        if self.fx.shutting_down and not upstream.streams:
            upstream.close()  # which opens another if requests still wait (``discard``)
            return
        self._maybe_open(origin)

    def shutdown(self) -> None:
        """A graceful stop began: every connection without a stream closes now; one still
        connecting closes when it is ready (``ready``) unless requests wait for it."""
        for conns in self.conns.values():
            for upstream in list(conns):
                if not upstream.streams and upstream.state in (H2State.READY, H2State.DRAINING):
                    upstream.close()

    def draining(self, upstream: H2Upstream) -> None:
        self._maybe_open(upstream.origin)

    def forget(self, user: UpstreamUser) -> None:
        for queue in self.waiting.values():
            if user in queue:
                queue.remove(user)

    def discard(self, upstream: H2Upstream, reason: str, *, timeout: bool = False) -> None:
        fx = self.fx
        self.upstreams.pop(upstream.conn, None)
        fx.cancel_timer((BackendTimer.POOL, upstream.conn))
        origin = upstream.origin
        conns = self.conns.get(origin, [])
        if upstream in conns:
            conns.remove(upstream)
        live = [u for u in conns if u.state is not H2State.DRAINING]
        queue = self.waiting.get(origin)
        if queue and not live:
            # Nothing left that could serve them: they fail now (and may be retried elsewhere)
            # rather than loop on a backend that refuses connections.
            self.waiting[origin] = deque()
            for user in queue:
                user.upstream_failed(reason, timeout=timeout)
        else:
            self._maybe_open(origin)

    @property
    def idle_count(self) -> int:
        return sum(1 for c in self.conns.values() for u in c if not u.streams)
