"""One byte tunnel: a client side and a backend side, after a WebSocket handshake.

What it obeys:

- RFC 9110 §7.8 / §15.2.2: after a 101 (Switching Protocols) the connection carries the new
  protocol; for the proxy that is opaque bytes both ways. An HTTP/1.1 client connection is
  raw from then on (its bytes reach the tunnel before h11, see ``ProxyCore.tunnels``); an
  HTTP/1.1 backend connection is raw too and leaves the pool for good.
- RFC 6455: the WebSocket frames pass unchanged (masking, extensions, close codes are the two
  endpoints' business); the proxy never parses them.
- RFC 8441 §5: over HTTP/2 a side is one stream (the client's, or one on an HTTP/2 backend
  connection, ``StreamBackend``); its DATA payloads are the bytes, and END_STREAM /
  RST_STREAM stand for the TCP FIN / RST of a connection.
- RFC 9293 §3.6: a FIN ends one direction only. Each side's end (its EOF, ``InputEnded``, or
  END_STREAM) is relayed to the other side (``ShutdownWrite`` or END_STREAM, after what is
  pending for it), and the other direction goes on until it ends too: a WebSocket client
  that sends its Close frame and then ends its side still gets the backend's Close reply
  (RFC 6455 §7.1.1: the close handshake runs in both directions).
- A TLS side cannot carry a half-close (RFC 8446 §6.1 allows one, but the driver's TLS stream
  sends close_notify only with the whole close; ``ShutdownWrite`` does nothing there). So the
  other side's end closes a TLS side's connection outright, after what is pending for it (as
  nginx ends an upgraded connection at either side's EOF): its peer learns the end at once
  instead of after its own close timeout. For a WebSocket this is the close RFC 6455 §7.1.1
  wants of the server, after the Close frames, which a conforming endpoint sends before it
  ends its side.

Invariants, the same as for an exchange (design §4):

- Bounded buffers. Bytes taken from one side and not yet written to the other are counted:
  client to backend ``backend.pending`` (what the backend connection has not written),
  backend to client ``client.buffered(stream)``. At ``high_water`` the reading side stops
  (HTTP/1.1 client and backend: PauseReading; HTTP/2 client or backend stream: its
  WINDOW_UPDATEs are withheld); at ``low_water`` it resumes: a ``Flow`` per direction
  (``flow.py``), ``client_flow`` and ``backend_flow``.
- ``state`` says which directions still flow, moved by ``TRANSITIONS``
  (``tunnel_states.py``) alone. Once both ended, both sides are closed; a
  failure or reset of either side (or a client that goes away) closes both at once, the
  other side after what is pending for it is written (``CloseConnection`` flushes; on
  HTTP/2 END_STREAM queues behind the data).
- ``timeouts.tunnel_idle`` without a byte either way closes both sides, half-closed or not:
  a lazy timer, armed once and moved forward only when it fires (like the read timeout).
- It ends exactly once (``CLOSED``), and then tells its owner (``ended``), which logs it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from muxproxy.core.commands import Log, PauseReading, ResumeReading, ShutdownWrite
from muxproxy.core.effects import Effects
from muxproxy.core.events import TimerId
from muxproxy.core.flow import Flow
from muxproxy.core.ports import ClientStream, Http1Upgrade, TunnelClient
from muxproxy.core.states import step
from muxproxy.core.tunnel.tunnel_states import (
    BACKEND_FLOWS,
    CLIENT_FLOWS,
    TRANSITIONS,
    TunnelInput,
    TunnelState,
)

if TYPE_CHECKING:
    from muxproxy.core.upstream.h2pool import H2Stream


class ClientEnd(enum.Enum):
    """What ending the tunnel does to the client side."""

    KEEP = "keep"
    """It is gone already (closed, or the stream was reset)."""
    END = "end"
    """A clean end: HTTP/1.1 close after the flush, or END_STREAM after the queued data."""
    ABORT = "abort"
    """HTTP/1.1 close after the flush, or RST_STREAM."""


class BackendEnd(enum.Enum):
    """What ending the tunnel does to the backend side."""

    KEEP = "keep"
    """It is gone already (closed, failed, or reset)."""
    END = "end"
    """Both directions ended cleanly: close the connection, free the stream."""
    ABORT = "abort"
    """Close the connection after the flush, or RST_STREAM(CANCEL)."""


class ClientKind(enum.Enum):
    RAW = "raw"
    """An HTTP/1.1 connection after its 101: the socket's bytes are the tunnel's."""
    H2_STREAM = "h2_stream"
    """One HTTP/2 stream after a 200 to an extended CONNECT (RFC 8441): DATA frames."""


class Backend(Protocol):
    """The backend side of a tunnel: a raw connection or one stream of an HTTP/2 one."""

    @property
    def pending(self) -> int:
        """Bytes handed to this side and not yet written."""

    @property
    def half_close(self) -> bool:
        """Whether ``end`` reaches the backend while the other direction goes on."""

    def send(self, data: bytes) -> None: ...
    def end(self) -> None:
        """Our sending side ends (after what is pending): FIN, or END_STREAM."""

    def close(self, how: BackendEnd) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...


class RawBackend:
    """An HTTP/1.1 backend connection after its 101: its bytes are the tunnel's."""

    def __init__(self, fx: Effects, conn: int, pending: int, *, half_close: bool = True) -> None:
        self.fx = fx
        self.conn = conn
        self.pending = pending
        self.half_close = half_close
        """False over TLS: ``end`` cannot reach the backend (see the module's comment)."""

    def send(self, data: bytes) -> None:
        self.pending += len(data)
        self.fx.send(self.conn, data)

    def sent(self, nbytes: int) -> None:
        self.pending -= nbytes

    def end(self) -> None:
        self.fx.emit(ShutdownWrite(conn=self.conn))

    def close(self, how: BackendEnd) -> None:
        if how is not BackendEnd.KEEP:
            # Flushes first (``CloseConnection``).
            self.fx.close(self.conn)

    def pause(self) -> None:
        self.fx.emit(PauseReading(conn=self.conn))

    def resume(self) -> None:
        self.fx.emit(ResumeReading(conn=self.conn))


class StreamBackend:
    """One stream on an HTTP/2 backend connection, after its 200 to an extended CONNECT
    (RFC 8441 §5). Its DATA reach the tunnel through the exchange (``response_body``), and
    are acknowledged as they are handed on unless paused (``H2Stream.took``)."""

    def __init__(self, stream: H2Stream) -> None:
        self.stream = stream

    @property
    def pending(self) -> int:
        return self.stream.pending

    @property
    def half_close(self) -> bool:
        """END_STREAM ends one direction of a stream (RFC 9113 §8.1), over TLS too."""
        return True

    def send(self, data: bytes) -> None:
        self.stream.send_body(data)

    def end(self) -> None:
        self.stream.send_end([])

    def close(self, how: BackendEnd) -> None:
        stream = self.stream
        stream.exchange = None
        if how is BackendEnd.END and not stream.upstream.client.queued(stream.sid):
            stream.release()  # both END_STREAMs went by: the stream is closed
        else:
            # RST_STREAM(CANCEL) unless it is over already; also when our END_STREAM still
            # waits for window behind data, so that the stream cannot stay half-open.
            stream.close()

    def pause(self) -> None:
        self.stream.pause()

    def resume(self) -> None:
        self.stream.resume()


class Tunnel:
    def __init__(
        self,
        fx: Effects,
        tunnels: dict[int, Tunnel],
        exchange: ClientStream,
        client: TunnelClient,
        *,
        raw: Http1Upgrade | None,
        backend: Backend,
        timer: TimerId,
        ended: Callable[[str], None],
    ) -> None:
        """``tunnels``: the core's table of connections whose bytes are a tunnel's; this one
        enters its raw connections there, and leaves it when it ends. ``raw``: an HTTP/1.1
        client's switched connection, whose bytes are the tunnel's; None for an HTTP/2 client,
        whose tunnel is the stream (RFC 8441 §5)."""
        self.fx = fx
        self.tunnels = tunnels
        self.exchange = exchange
        """The exchange that opened the tunnel: the client connection holds it while the
        backend is stopped for the client (``ResponseSink.hold``)."""
        self.client = client
        self.raw = raw
        self.stream = exchange.stream
        self.kind = ClientKind.H2_STREAM if raw is None else ClientKind.RAW
        self.client_half_close = self.kind is ClientKind.H2_STREAM or client.scheme == b"http"
        """Whether the client can be sent a half-close: END_STREAM, or a FIN on plain TCP
        (``scheme`` is https exactly on a TLS connection)."""
        self.backend = backend
        self.timer = timer
        self.ended = ended
        self.state = TunnelState.OPEN
        """Changed by ``move`` alone, as ``TRANSITIONS`` says (and by fault isolation)."""
        self.client_flow = Flow()
        """The client as the source; its credit: HTTP/2 flow-controlled bytes of the
        client's DATA not yet given back."""
        self.backend_flow = Flow()
        self.bytes_up = 0
        self.bytes_down = 0
        self.last_activity = fx.now
        if isinstance(backend, RawBackend):
            tunnels[backend.conn] = self
        if self.kind is ClientKind.RAW:
            tunnels[self.client.conn] = self
        fx.set_timer(timer, fx.now + fx.config.timeouts.tunnel_idle)

    def move(self, input: TunnelInput) -> TunnelState | None:
        """Take ``input`` as ``TRANSITIONS`` says: the state after it, None where ignored."""
        before = self.state
        target = step(TRANSITIONS, "Tunnel", before, input)
        if target is not None:
            self.state = target
        if self.fx.moves is not None:
            self.fx.moves.record(self, before, input, self.state)
        return target

    # -- client to backend -----------------------------------------------------------------

    def on_data(self, conn: int, data: bytes) -> None:
        """Raw bytes read from the backend (a negative id) or the HTTP/1.1 client."""
        if conn < 0:
            self.from_backend(data)
        else:
            self.from_client(data, 0)

    def input_ended(self, conn: int) -> None:
        """A raw connection's peer ended its sending side (``InputEnded``)."""
        if conn < 0:
            self.backend_end()
        else:
            self.client_end()

    def from_client(self, data: bytes, flow_len: int) -> None:
        """Bytes from the client: raw HTTP/1.1 bytes, or one DATA payload (``flow_len``)."""
        if self.state not in CLIENT_FLOWS:
            self.move(TunnelInput.CLIENT_BYTES)  # refused, or ignored: the credit goes back
            if flow_len:
                self.client.acknowledge(self.stream, flow_len)
            return
        self.last_activity = self.fx.now
        self.client_flow.hold(flow_len)
        if data:
            self.bytes_up += len(data)
            self.backend.send(data)
        self._check_client_flow()

    def backend_sent(self, nbytes: int) -> None:
        """The raw backend connection wrote ``nbytes`` of what we handed it."""
        backend = self.backend
        if isinstance(backend, RawBackend):
            backend.sent(nbytes)
        self.backend_drained()

    def backend_drained(self) -> None:
        """The backend side wrote some of its pending bytes."""
        flow = self.client_flow
        if (flow.stopped or flow.withheld) and self.move(TunnelInput.BACKEND_DRAINED) is not None:
            self._check_client_flow()

    def _check_client_flow(self) -> None:
        flow = self.client_flow
        limits = self.fx.limits
        pending = self.backend.pending
        client = self.client
        if flow.filled(pending, limits):
            client.pause_source()
        elif flow.drained(pending, limits):
            client.resume_source()
        # RFC 9113 §6.9: the window opens again only once the bytes moved on.
        credit = flow.release()
        if credit:
            client.acknowledge(self.stream, credit)

    # -- backend to client -----------------------------------------------------------------

    def from_backend(self, data: bytes) -> None:
        if not data:
            return
        if self.state not in BACKEND_FLOWS:
            self.move(TunnelInput.BACKEND_BYTES)  # refused, or ignored
            return
        self.last_activity = self.fx.now
        self.bytes_down += len(data)
        client = self.client
        raw = self.raw
        if raw is not None:
            raw.send_raw(data)
        else:
            client.send_body(self.stream, data)
        flow = self.backend_flow
        if not flow.stopped and flow.filled(client.buffered(self.stream), self.fx.limits):
            self.backend.pause()
            client.hold(self.exchange)

    def client_drained(self) -> None:
        """The client side wrote some of its pending bytes; maybe read the backend again."""
        flow = self.backend_flow
        if (
            flow.stopped
            and self.move(TunnelInput.CLIENT_DRAINED) is not None
            and flow.drained(self.client.buffered(self.stream), self.fx.limits)
        ):
            self.backend.resume()
            self.client.release(self.exchange)

    # -- endings ---------------------------------------------------------------------------

    def client_end(self) -> None:
        """The client ended its side: its FIN, or END_STREAM (RFC 8441 §5). Relayed to the
        backend once what the client sent before it is written; the backend goes on."""
        target = self.move(TunnelInput.CLIENT_END)
        if target is TunnelState.CLIENT_ENDED and self.backend.half_close:
            self.backend.end()
        elif target is TunnelState.CLIENT_ENDED:
            # A TLS backend cannot be told of a half-close: its connection closes.
            self._end("client ended", client=ClientEnd.END, backend=BackendEnd.END)
        elif target is TunnelState.CLOSED:
            self._closed("both sides ended", client=ClientEnd.END, backend=BackendEnd.END)

    def backend_end(self) -> None:
        """The backend ended its side: its FIN, or END_STREAM on an HTTP/2 backend stream.
        Relayed to the client after what is pending for it; the client goes on."""
        target = self.move(TunnelInput.BACKEND_END)
        if target is TunnelState.BACKEND_ENDED and not self.client_half_close:
            # A TLS client cannot be told of a half-close: its connection closes.
            self._end("backend ended", client=ClientEnd.END, backend=BackendEnd.END)
        elif target is TunnelState.BACKEND_ENDED and self.kind is ClientKind.RAW:
            self.fx.emit(ShutdownWrite(conn=self.client.conn))
        elif target is TunnelState.BACKEND_ENDED:
            self.client.keep_receiving(self.stream)
            self.client.send_end(self.stream, [])
        elif target is TunnelState.CLOSED:
            self._closed("both sides ended", client=ClientEnd.END, backend=BackendEnd.END)

    def client_gone(self, reason: str) -> None:
        """The client connection closed, or (HTTP/2) reset the stream."""
        self._end(f"client closed: {reason}", client=ClientEnd.KEEP)

    def backend_closed(self, error: str | None) -> None:
        """The backend connection closed (or, on HTTP/2, its stream was reset)."""
        if error is None:
            self._end("backend closed", client=ClientEnd.END, backend=BackendEnd.KEEP)
        else:
            reason = f"backend connection failed: {error}"
            self._end(reason, client=ClientEnd.ABORT, backend=BackendEnd.KEEP)

    def timer_fired(self) -> None:
        if self.move(TunnelInput.IDLE_TIMER) is None:
            return
        fx = self.fx
        due = self.last_activity + fx.config.timeouts.tunnel_idle
        if fx.now < due:
            fx.set_timer(self.timer, due)
            return
        self._end("idle timeout", client=ClientEnd.ABORT)

    def _end(
        self, outcome: str, *, client: ClientEnd, backend: BackendEnd = BackendEnd.ABORT
    ) -> None:
        # CLOSED first: whatever the ends below lead to finds the tunnel over.
        if self.move(TunnelInput.CLOSE) is not None:
            self._closed(outcome, client=client, backend=backend)

    def _closed(self, outcome: str, *, client: ClientEnd, backend: BackendEnd) -> None:
        """The tunnel is CLOSED now: end both sides as ``client`` and ``backend`` say."""
        fx = self.fx
        fx.cancel_timer(self.timer)
        if isinstance(self.backend, RawBackend):
            self.tunnels.pop(self.backend.conn, None)
        downstream = self.client
        if self.kind is ClientKind.RAW:
            self.tunnels.pop(downstream.conn, None)
        downstream.release(self.exchange)
        credit = self.client_flow.take()
        if credit:
            downstream.acknowledge(self.stream, credit)
        if client is not ClientEnd.KEEP:
            if self.kind is ClientKind.RAW:
                # Flushes first: the last frames (a Close frame) still reach the client.
                downstream.request_close()
            elif client is ClientEnd.END:
                downstream.send_end(self.stream, [])
            else:
                # RFC 8441 §5: a TCP reset (or an abandoned tunnel) is a stream reset.
                downstream.abort(self.stream)
        self.backend.close(backend)
        fx.emit(
            Log(
                event="tunnel_closed",
                fields={
                    "conn": downstream.conn,
                    "stream": self.stream,
                    "bytes_up": self.bytes_up,
                    "bytes_down": self.bytes_down,
                    "reason": outcome,
                },
            )
        )
        self.ended(outcome)
