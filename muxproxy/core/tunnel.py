"""One byte tunnel: a client side and a raw backend connection, after a WebSocket handshake.

What it obeys:

- RFC 9110 §7.8 / §15.2.2: after a 101 (Switching Protocols) the connection carries the new
  protocol; for the proxy that is opaque bytes both ways. An HTTP/1.1 client connection is
  raw from then on (its bytes reach the tunnel before h11, see ``ProxyCore.tunnels``); the
  backend connection is raw too and leaves the pool for good.
- RFC 6455: the WebSocket frames pass unchanged (masking, extensions, close codes are the two
  endpoints' business); the proxy never parses them.
- RFC 8441 §5: over HTTP/2 the client side is one stream; its DATA payloads are the bytes, and
  END_STREAM / RST_STREAM stand for the TCP FIN / RST of the backend connection.

Invariants, the same as for an exchange (design §4):

- Bounded buffers. Bytes taken from one side and not yet written to the other are counted:
  client to backend ``backend_pending`` (what the backend socket has not taken), backend to
  client ``client.buffered(stream)``. At ``high_water`` the reading side stops (HTTP/1.1
  client and backend: PauseReading; HTTP/2 client: its WINDOW_UPDATEs are withheld); at
  ``low_water`` it resumes.
- A close from either side closes the other, after what is pending for it is written
  (``CloseConnection`` flushes; on HTTP/2 END_STREAM queues behind the data). The driver has no
  half-close, so a FIN from one side ends the whole tunnel.
- ``timeouts.tunnel_idle`` without a byte either way closes both sides: a lazy timer, armed
  once and moved forward only when it fires (like the read timeout).
- It ends exactly once (``state``), and then tells its owner (``ended``), which logs it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

from .commands import CloseConnection, Log, PauseReading, ResumeReading
from .events import TimerId

if TYPE_CHECKING:
    from .downstream import Downstream
    from .exchange import Exchange
    from .proxy import ProxyCore


class TunnelState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class ClientEnd(enum.Enum):
    """What ending the tunnel does to the client side."""

    KEEP = "keep"
    """It is gone already (closed, or the stream was reset)."""
    END = "end"
    """A clean end: HTTP/1.1 close after the flush, or END_STREAM after the queued data."""
    ABORT = "abort"
    """HTTP/1.1 close after the flush, or RST_STREAM."""


class ClientKind(enum.Enum):
    RAW = "raw"
    """An HTTP/1.1 connection after its 101: the socket's bytes are the tunnel's."""
    H2_STREAM = "h2_stream"
    """One HTTP/2 stream after a 200 to an extended CONNECT (RFC 8441): DATA frames."""


class Tunnel:
    def __init__(
        self,
        core: ProxyCore,
        exchange: Exchange,
        *,
        backend: int,
        backend_pending: int,
        timer: TimerId,
        ended: Callable[[str], None],
    ) -> None:
        self.core = core
        self.exchange = exchange
        self.client: Downstream = exchange.client
        self.stream = exchange.stream
        self.kind = ClientKind.H2_STREAM if self.client.is_h2 else ClientKind.RAW
        self.backend = backend
        self.backend_pending = backend_pending
        """Bytes handed to the backend socket and not yet written."""
        self.timer = timer
        self.ended = ended
        self.state = TunnelState.OPEN
        self.unacked = 0
        """HTTP/2 flow-controlled bytes of the client's DATA not yet given back."""
        self.client_paused = False
        self.backend_paused = False
        self.bytes_up = 0
        self.bytes_down = 0
        self.last_activity = core.now
        core.tunnels[backend] = self
        if self.kind is ClientKind.RAW:
            core.tunnels[self.client.conn] = self
        core.set_timer(timer, core.now + core.config.timeouts.tunnel_idle)

    # -- client to backend -----------------------------------------------------------------

    def on_data(self, conn: int, data: bytes) -> None:
        """Raw bytes read from the backend or (HTTP/1.1) the client connection."""
        if conn == self.backend:
            self.from_backend(data)
        else:
            self.from_client(data, 0)

    def from_client(self, data: bytes, flow_len: int) -> None:
        """Bytes from the client: raw HTTP/1.1 bytes, or one DATA payload (``flow_len``)."""
        if self.state is TunnelState.CLOSED:
            if flow_len:
                self.client.acknowledge(self.stream, flow_len)
            return
        self.last_activity = self.core.now
        self.unacked += flow_len
        if data:
            self.bytes_up += len(data)
            self.backend_pending += len(data)
            self.core.send(self.backend, data)
        self._check_client_flow()

    def backend_sent(self, nbytes: int) -> None:
        """The backend socket took ``nbytes`` of what we handed it."""
        self.backend_pending -= nbytes
        if self.client_paused or self.unacked:
            self._check_client_flow()

    def _check_client_flow(self) -> None:
        if self.state is TunnelState.CLOSED:
            return
        limits = self.core.limits
        pending = self.backend_pending
        client = self.client
        if pending >= limits.high_water:
            if not self.client_paused:
                self.client_paused = True
                client.pause_source(self.exchange)
        elif pending <= limits.low_water or not self.client_paused:
            if self.client_paused:
                self.client_paused = False
                client.resume_source(self.exchange)
            if self.unacked:
                # RFC 9113 §6.9: the window opens again only once the bytes moved on.
                client.acknowledge(self.stream, self.unacked)
                self.unacked = 0

    # -- backend to client -----------------------------------------------------------------

    def from_backend(self, data: bytes) -> None:
        if self.state is TunnelState.CLOSED or not data:
            return
        self.last_activity = self.core.now
        self.bytes_down += len(data)
        client = self.client
        if self.kind is ClientKind.RAW:
            # Through the connection's own accounting (pending bytes, send timeout), not h11:
            # h11 is SWITCHED_PROTOCOL and has no say any more.
            client._send(data)
        else:
            client.send_body(self.stream, data)
        if not self.backend_paused and client.buffered(self.stream) >= self.core.limits.high_water:
            self.backend_paused = True
            self.core.emit(PauseReading(conn=self.backend))
            client.stalled.add(self.exchange)

    def client_drained(self) -> None:
        """The client side wrote some of its pending bytes; maybe read the backend again."""
        if (
            self.backend_paused
            and self.state is TunnelState.OPEN
            and self.client.buffered(self.stream) <= self.core.limits.low_water
        ):
            self.backend_paused = False
            self.core.emit(ResumeReading(conn=self.backend))
            self.client.stalled.discard(self.exchange)

    # -- endings ---------------------------------------------------------------------------

    def client_end(self) -> None:
        """HTTP/2 END_STREAM from the client: the FIN of the backend connection (RFC 8441 §5).

        Our half of the stream ends too: the driver cannot half-close the backend, so nothing
        more will come from it."""
        self._end("client ended the stream", client=ClientEnd.END)

    def client_gone(self, reason: str) -> None:
        """The client connection closed, or (HTTP/2) reset the stream."""
        self._end(f"client closed: {reason}", client=ClientEnd.KEEP)

    def backend_closed(self, error: str | None) -> None:
        if error is None:
            self._end("backend closed", client=ClientEnd.END, close_backend=False)
        else:
            reason = f"backend connection failed: {error}"
            self._end(reason, client=ClientEnd.ABORT, close_backend=False)

    def timer_fired(self) -> None:
        if self.state is TunnelState.CLOSED:
            return
        core = self.core
        due = self.last_activity + core.config.timeouts.tunnel_idle
        if core.now < due:
            core.set_timer(self.timer, due)
            return
        self._end("idle timeout", client=ClientEnd.ABORT)

    def _end(self, outcome: str, *, client: ClientEnd, close_backend: bool = True) -> None:
        if self.state is TunnelState.CLOSED:
            return
        # CLOSED first: closing the client side calls back into ``client_gone``.
        self.state = TunnelState.CLOSED
        core = self.core
        core.cancel_timer(self.timer)
        core.tunnels.pop(self.backend, None)
        downstream = self.client
        if self.kind is ClientKind.RAW:
            core.tunnels.pop(downstream.conn, None)
        downstream.stalled.discard(self.exchange)
        if self.unacked:
            downstream.acknowledge(self.stream, self.unacked)
            self.unacked = 0
        if client is not ClientEnd.KEEP:
            if self.kind is ClientKind.RAW:
                # Flushes first: the last frames (a Close frame) still reach the client.
                downstream.close()
            elif client is ClientEnd.END:
                downstream.send_end(self.stream, [])
            else:
                # RFC 8441 §5: a TCP reset (or an abandoned tunnel) is a stream reset.
                downstream.abort(self.stream)
        if close_backend:
            # Flushes first too (``CloseConnection``).
            core.emit(CloseConnection(conn=self.backend))
        core.emit(
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
