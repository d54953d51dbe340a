"""One proxied request/response: from the client's request head to the end of the response.

The exchange relays version-neutral messages between a client stream (``Downstream``) and one
backend connection (``UpstreamConn``); it never sees bytes of either protocol. Its rules:

- Per-chunk flush: every upstream body chunk is handed to the client side in the same call
  that received it. Nothing waits for more data.
- Bounded buffers: bytes accepted from one side and not yet written to the other are counted;
  at ``high_water`` the source is stopped (backend: PauseReading; HTTP/1.1 client:
  PauseReading; HTTP/2 client: its WINDOW_UPDATEs are withheld), below ``low_water`` it
  resumes.
- Cancellation propagates: a client that goes away closes the backend connection at once,
  which is what stops a GPU generating tokens nobody reads.
- Truncation is visible: a backend that fails after the response head went out makes the
  client side abort the stream (RST_STREAM on HTTP/2, no final chunk on HTTP/1.1).
- Errors before the head map to short plain responses: refused or broken backend 502,
  timeout 504 (RFC 9110 §15.6.3, §15.6.5).

The phase of the response is an enum, the transitions are the methods below; the request side
has its own small enum because the two directions progress independently (a response may end
before the request body does).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from .commands import Log, Origin
from .headers import response_headers, upstream_h1_headers
from .messages import Headers, RequestHead, ResponseHead

if TYPE_CHECKING:
    from .downstream import Downstream
    from .pool import UpstreamConn
    from .proxy import ProxyCore

VIA = b"muxproxy"


class Phase(enum.Enum):
    CONNECTING = "connecting"
    """Waiting for a backend connection; request body bytes are held (bounded)."""
    WAITING_HEAD = "waiting_head"
    """The request head went to the backend; waiting for its response head."""
    STREAMING = "streaming"
    """The response head went to the client; body chunks are relayed as they come."""
    DONE = "done"


class RequestPhase(enum.Enum):
    BODY = "body"
    COMPLETE = "complete"


class Exchange:
    def __init__(self, core: ProxyCore, client: Downstream, head: RequestHead, ident: int) -> None:
        self.core = core
        self.client = client
        self.stream = head.stream
        self.head = head
        self.ident = ident
        self.phase = Phase.CONNECTING
        self.request = RequestPhase.COMPLETE if head.end_stream else RequestPhase.BODY
        self.upstream: UpstreamConn | None = None
        self.origin: Origin | None = None
        self.held: list[bytes] = []
        self.held_size = 0
        self.request_trailers: Headers = []
        self.unacked = 0
        self.source_paused = False
        self.started = core.now
        self.last_upstream_activity = core.now
        self.first_byte_at: float | None = None
        self.status = 0
        self.bytes_out = 0
        self.outcome = ""

    # -- request direction -----------------------------------------------------------------

    def start(self) -> None:
        core = self.core
        group = core.config.route_for(self.head.target)
        if group is None:
            self.fail(404, "no route for this path")
            return
        server = group.servers[core.balancer(group).pick()]
        self.origin = Origin(host=server.host, port=server.port)
        core.set_timer(("connect", self.ident), core.now + core.config.timeouts.connect)
        core.pool.acquire(self.origin, group, self)

    def upstream_ready(self, upstream: UpstreamConn) -> None:
        """A backend connection is ours: send the head and whatever body was held."""
        if self.phase is not Phase.CONNECTING:
            upstream.core.pool.release(upstream)
            return
        core = self.core
        core.cancel_timer(("connect", self.ident))
        self.upstream = upstream
        head = self.head
        # An HTTP/2 request body has no framing of its own (RFC 9113 §8.1); without a
        # Content-Length the HTTP/1.1 side frames it chunked (RFC 9112 §7.1).
        headers = upstream_h1_headers(
            head, client_ip=self.client.peer_ip, via=VIA, has_body=not head.end_stream
        )
        upstream.send_head(self.stream, head.method, head.target, headers)
        for chunk in self.held:
            upstream.send_body(chunk)
        self.held.clear()
        self.held_size = 0
        if self.request is RequestPhase.COMPLETE:
            upstream.send_end(self.request_trailers)
        self.phase = Phase.WAITING_HEAD
        core.set_timer(("head", self.ident), core.now + core.config.timeouts.response_head)
        self._check_request_flow()

    def request_body(self, data: bytes, flow_len: int) -> None:
        if self.phase is Phase.DONE:
            self.client.acknowledge(self.stream, flow_len)
            return
        self.unacked += flow_len
        upstream = self.upstream
        if upstream is None:
            self.held.append(data)
            self.held_size += len(data)
        else:
            upstream.send_body(data)
        self._check_request_flow()

    def request_end(self, trailers: Headers) -> None:
        if self.request is RequestPhase.COMPLETE:
            return  # a request without a body was complete with its head
        self.request = RequestPhase.COMPLETE
        if self.phase is Phase.DONE:
            return
        self.request_trailers = trailers
        if self.upstream is not None:
            self.upstream.send_end(trailers)

    def request_buffered(self) -> int:
        """Request bytes taken from the client and not yet written to the backend."""
        return self.held_size + (self.upstream.pending if self.upstream else 0)

    def _check_request_flow(self) -> None:
        buffered = self.request_buffered()
        limits = self.core.limits
        if buffered >= limits.high_water:
            if not self.source_paused:
                self.source_paused = True
                self.client.pause_source(self)
        elif buffered <= limits.low_water or not self.source_paused:
            if self.source_paused:
                self.source_paused = False
                self.client.resume_source(self)
            if self.unacked:
                self.client.acknowledge(self.stream, self.unacked)
                self.unacked = 0

    def upstream_drained(self) -> None:
        """The backend connection wrote some of its pending bytes."""
        if self.source_paused or self.unacked:
            self._check_request_flow()

    def client_aborted(self, reason: str) -> None:
        """The client reset the stream or went away: stop the backend at once."""
        if self.phase is Phase.DONE:
            return
        self._release_upstream(close=True)
        self._finish(f"client aborted: {reason}")

    # -- response direction ----------------------------------------------------------------

    def response_head(self, head: ResponseHead) -> None:
        if self.phase is not Phase.WAITING_HEAD:
            return
        core = self.core
        core.cancel_timer(("head", self.ident))
        self.phase = Phase.STREAMING
        self.status = head.status
        headers = response_headers(
            head.status, head.headers, via=VIA, upstream_version=b"1.1", to_h2=self.client.is_h2
        )
        self.client.send_head(ResponseHead(stream=self.stream, status=head.status, headers=headers))
        self.last_upstream_activity = core.now
        core.set_timer(("read", self.ident), core.now + core.config.timeouts.read)

    def response_body(self, data: bytes) -> None:
        if self.phase is not Phase.STREAMING:
            return
        now = self.core.now
        self.last_upstream_activity = now
        if self.first_byte_at is None:
            self.first_byte_at = now
        self.bytes_out += len(data)
        client = self.client
        client.send_body(self.stream, data)
        if client.buffered(self.stream) >= self.core.limits.high_water:
            upstream = self.upstream
            if upstream is not None:
                upstream.pause()
                client.stalled.add(self)

    def client_drained(self) -> None:
        """The client side wrote some of this stream's bytes; maybe read the backend again."""
        upstream = self.upstream
        if (
            upstream is not None
            and upstream.paused
            and self.client.buffered(self.stream) <= self.core.limits.low_water
        ):
            upstream.resume()
            self.client.stalled.discard(self)

    def response_end(self, trailers: Headers) -> None:
        if self.phase is not Phase.STREAMING:
            return
        self.client.send_end(self.stream, trailers)
        self._release_upstream(close=False)
        self._finish("ok")

    def upstream_failed(self, reason: str, *, timeout: bool = False) -> None:
        """The backend connection broke, could not be opened, or timed out."""
        if self.phase is Phase.DONE:
            return
        self._release_upstream(close=True)
        if self.phase is Phase.STREAMING:
            # Truncation must be visible: never a clean end for a broken stream.
            self.client.abort(self.stream)
            self._finish(f"upstream failed mid-stream: {reason}")
        elif timeout:
            self.fail(504, "upstream timed out", reason)
        else:
            self.fail(502, "upstream unavailable", reason)

    def timer_fired(self, kind: str) -> None:
        core = self.core
        if kind == "read":
            if self.phase is not Phase.STREAMING:
                return
            due = self.last_upstream_activity + core.config.timeouts.read
            if core.now < due:
                # Lazy timer: the deadline moves with every chunk, but we re-arm only here,
                # so relaying a chunk costs no timer command.
                core.set_timer(("read", self.ident), due)
                return
            self.upstream_failed("no data from upstream within the read timeout", timeout=True)
        elif kind == "connect":
            self.upstream_failed("connect timeout", timeout=True)
        elif kind == "head":
            self.upstream_failed("response head timeout", timeout=True)

    # -- endings ---------------------------------------------------------------------------

    def fail(self, status: int, text: str, reason: str = "") -> None:
        """Answer with a short plain response (only while no response head went out)."""
        self.status = status
        self.client.send_error(self.stream, status, text)
        self._finish(reason or text)

    def _release_upstream(self, *, close: bool) -> None:
        upstream = self.upstream
        self.upstream = None
        if upstream is not None:
            upstream.exchange = None
            if close or self.request is not RequestPhase.COMPLETE:
                upstream.close()
            else:
                self.core.pool.release(upstream)
        elif self.origin is not None and self.phase is Phase.CONNECTING:
            self.core.pool.forget(self)

    def _finish(self, outcome: str) -> None:
        core = self.core
        self.phase = Phase.DONE
        self.outcome = outcome
        for kind in ("connect", "head", "read"):
            core.cancel_timer((kind, self.ident))
        if self.unacked:
            self.client.acknowledge(self.stream, self.unacked)
            self.unacked = 0
        if self.source_paused:
            self.source_paused = False
            self.client.resume_source(self)
        core.exchange_finished(self)
        self.client.exchange_finished(self)
        head = self.head
        core.emit(
            Log(
                event="access",
                fields={
                    "client": self.client.peer_ip,
                    "method": head.method.decode("latin-1"),
                    "target": head.target.decode("latin-1"),
                    "version": head.http_version.decode("latin-1"),
                    "status": self.status,
                    "upstream": str(self.origin) if self.origin else None,
                    "bytes": self.bytes_out,
                    "duration": round(core.now - self.started, 6),
                    "ttfb": None
                    if self.first_byte_at is None
                    else round(self.first_byte_at - self.started, 6),
                    "outcome": outcome,
                },
            )
        )
