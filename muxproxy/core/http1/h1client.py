"""HTTP/1.1 client adapter: one ``h11.Connection`` facing a backend, as core messages.

The backend side of an HTTP/1.1 connection (``pool.UpstreamConn`` holds one): one request at a
time, kept alive when h11 says both messages completed (RFC 9112 §9.3). What it obeys, beside
h11's own rules:

- A response head is bounded like a request head (``max_head``): past it h11 raises, which
  becomes an ``Abort`` (the exchange answers 502).
- A chunked body is decoded here (``chunked.py``), so that every chunk a read completed becomes
  one ``Body`` at once, and a chunk-size line is bounded (RFC 9112 §7.1).
- Bytes after the end of a response, before the next request went out, are the backend's error
  (RFC 9112 §9.3, §9.4: a server sends nothing the client did not ask for): whether they came in
  the read that ended the response or in a later one, ``extra`` is set and the connection is
  never reused. Kept, they would be read as the answer to the next request, another client's
  (response splitting); this holds for every framing h11 knows the end of: Content-Length,
  chunked, and no body at all (HEAD, 1xx before the final response, 204, 304).
- A server that answers in HTTP/2 (a gRPC server, most often, behind a server left at the
  default ``protocol = "h1"``) starts with its SETTINGS frame (RFC 9113 §3.4), which h11
  rejects as a status line: the ``Abort`` then names the likely cause and the fix, so that
  the log says more than "illegal status line".
- Request heads go out through ``h1.head_bytes``: h11 frames them, the other fields follow as
  given.
"""

from __future__ import annotations

import h11

from muxproxy.core.http1.chunked import ChunkedDecoder, ChunkedError
from muxproxy.core.http1.h1 import DEFAULT_MAX_HEAD, h11_data, head_bytes
from muxproxy.core.messages import Abort, Body, End, Headers, Message, ResponseHead

H2_HINT = (
    "the server answered in HTTP/2 (its first bytes are an HTTP/2 SETTINGS frame) but is "
    'configured as HTTP/1.1: set protocol = "h2" on this server of the group '
    "(gRPC servers speak HTTP/2 only)"
)
"""Added to the reason of a broken response whose first bytes ``speaks_h2``."""

_FRAME_HEADER = 9
"""RFC 9113 §4.1: length (24 bits), type, flags, stream id (32 bits)."""


def speaks_h2(first: bytes) -> bool:
    """Whether a response's ``first`` bytes begin an HTTP/2 server's opening SETTINGS frame
    (RFC 9113 §3.4, §6.5): type 0x4, no flags, on stream 0, its length a multiple of 6 (and
    below 64 KiB: there are few settings). h11 gives up on the first byte (below 0x21, no
    status line), so a read may have brought only part of the frame header: from its first
    4 bytes on, what is there must fit."""
    if len(first) < 4 or first[0] != 0 or first[3] != 0x4:
        return False
    if int.from_bytes(first[1:3], "big") % 6:
        return False
    # The flags (none) and the stream id (0), as far as they came.
    header = first[:_FRAME_HEADER]
    return header[4:] == bytes(len(header) - 4)


class H1Client:
    """The client side of one backend connection: one request at a time, kept alive."""

    def __init__(self, *, max_head: int = DEFAULT_MAX_HEAD) -> None:
        # A backend's response head is bounded like a client's request head: past
        # ``max_head`` unparsed bytes h11 raises, which ``receive`` turns into an Abort (502).
        self.max_head = max_head
        self.conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=max_head)
        self.stream = 0
        self.method = b""
        self.chunked: ChunkedDecoder | None = None
        """Decodes the current response's chunked body, once h11 has parsed its head."""
        self.extra = False
        """The backend sent bytes after the end of the response (RFC 9112 §9.3)."""
        self.chunking = False
        """The current request's body is chunked: it may end with trailers."""
        self.first = b""
        """The first bytes of the current response (up to a frame header): ``speaks_h2``."""
        self.request_sent = False
        """The request was complete when h11 was let go of a chunked response (``receive``):
        ``conn`` is already the next cycle's."""

    def send_head(self, stream: int, method: bytes, target: bytes, headers: Headers) -> bytes:
        self.stream = stream
        self.method = method
        self.first = b""
        # h11 frames a request body chunked exactly when the head says so (RFC 9112 §6.1).
        self.chunking = any(name.lower() == b"transfer-encoding" for name, _ in headers)
        return head_bytes(
            self.conn,
            lambda fields: h11.Request(method=method, target=target, headers=fields),
            headers,
        )

    def send_body(self, data: bytes) -> bytes:
        return self.conn.send(h11.Data(data=data)) or b""

    def send_end(self, trailers: Headers) -> bytes:
        # ``trailers`` are what ``headers.trailer_fields`` let through. RFC 9112 §7.1.2: only a
        # chunked body has a trailer section; next to a Content-Length they are dropped (RFC
        # 9110 §6.5.2), as h11 refuses to send them.
        if not self.chunking:
            trailers = []
        return self.conn.send(h11.EndOfMessage(headers=trailers)) or b""

    def receive(self, data: bytes) -> list[Message]:
        """Feed bytes (b"" for EOF); return the messages they complete.

        A broken response (bad framing, EOF inside a chunked body) ends in ``Abort``: the
        truncation must stay visible to the client.
        """
        out: list[Message] = []
        if self.chunked is not None:
            self._receive_chunked(data, out)
            return out
        conn = self.conn
        if len(self.first) < _FRAME_HEADER and conn.their_state is h11.SEND_RESPONSE:
            self.first += data[: _FRAME_HEADER - len(self.first)]
        conn.receive_data(data)
        stream = self.stream
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                out.append(
                    Abort(stream=stream, reason=self._broken(f"bad response from backend: {exc}"))
                )
                return out
            if event is h11.NEED_DATA:
                return out
            if event is h11.PAUSED:
                # h11 pauses on bytes after a complete response (and after a 101, which
                # returned already): what follows the response the backend owed us.
                self.extra = self.extra or bool(conn.trailing_data[0])
                return out
            if type(event) is h11.Data:
                out.append(Body(stream=stream, data=h11_data(event)))
            elif type(event) is h11.Response:
                headers = list(event.headers)
                out.append(
                    ResponseHead(
                        stream=stream,
                        status=event.status_code,
                        headers=headers,
                        reason=bytes(event.reason),
                    )
                )
                if self._body_is_chunked(event.status_code, headers):
                    # RFC 9112 §6.3: h11 accepts no transfer coding but chunked, so the body
                    # is chunked. It is ours from the byte after the head.
                    self.chunked = ChunkedDecoder(max_line=self.max_head)
                    rest, closed = conn.trailing_data
                    if conn.our_state is h11.DONE:
                        # Both sides of this cycle are over for h11, whose receive buffer
                        # still holds ``rest`` (the whole read, but the head) for as long as
                        # the body streams: a stalled stream held it twice. The fresh state
                        # machine ``next_cycle`` would make is made now.
                        self.conn = h11.Connection(
                            h11.CLIENT, max_incomplete_event_size=self.max_head
                        )
                        self.request_sent = True
                    if rest:
                        self._receive_chunked(rest, out)
                    if closed:
                        self._receive_chunked(b"", out)
                    return out
            elif type(event) is h11.EndOfMessage:
                out.append(End(stream=stream, trailers=list(event.headers)))
            elif type(event) is h11.InformationalResponse:
                if event.status_code == 101:
                    # RFC 9110 §15.2.2: h11 accepts a 101 only for an upgrade we proposed (a
                    # WebSocket handshake); what follows it is no longer HTTP: the bytes h11
                    # already read wait in ``conn.trailing_data`` for the tunnel.
                    out.append(ResponseHead(stream=stream, status=101, headers=list(event.headers)))
                    return out
                # Other 1xx are hop-by-hop for our purposes: the client got its own
                # 100 Continue from us (RFC 9110 §15.2).
                continue
            elif type(event) is h11.ConnectionClosed:
                if conn.their_state is not h11.DONE:
                    reason = self._broken("backend closed the connection")
                    out.append(Abort(stream=stream, reason=reason))
                return out
            else:  # pragma: no cover
                raise AssertionError(f"unexpected h11 event {event!r}")

    def _broken(self, reason: str) -> str:
        """The reason of an ``Abort``, with the likely cause when the server speaks HTTP/2."""
        if speaks_h2(self.first):
            return f"{reason}: {H2_HINT}"
        return reason

    def _body_is_chunked(self, status: int, headers: Headers) -> bool:
        # RFC 9112 §6.3: no body for HEAD, 1xx, 204, 304, whatever the headers say.
        if self.method == b"HEAD" or status < 200 or status in (204, 304):
            return False
        return any(name == b"transfer-encoding" for name, _ in headers)

    def _receive_chunked(self, data: bytes, out: list[Message]) -> None:
        decoder = self.chunked
        assert decoder is not None
        stream = self.stream
        if decoder.done:
            self.extra = self.extra or bool(data)
            return
        if not data:
            out.append(Abort(stream=stream, reason="backend closed the connection"))
            return
        try:
            payload, after = decoder.feed(data)
        except ChunkedError as exc:
            out.append(Abort(stream=stream, reason=f"bad response from backend: {exc}"))
            return
        if payload:
            out.append(Body(stream=stream, data=payload))
        if decoder.done:
            self.extra = bool(after)
            out.append(End(stream=stream, trailers=decoder.trailers))

    @property
    def reusable(self) -> bool:
        conn = self.conn
        if not self.request_sent and conn.our_state is not h11.DONE:
            return False
        if self.extra:
            return False
        if self.chunked is not None:
            return self.chunked.done
        return conn.their_state is h11.DONE

    def next_cycle(self) -> None:
        if self.chunked is not None:
            # h11 never saw the body: the next response starts on a fresh state machine.
            if not self.request_sent:
                self.conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=self.max_head)
            self.request_sent = False
            self.chunked = None
            self.extra = False
        else:
            self.conn.start_next_cycle()

    @property
    def response_started(self) -> bool:
        return self.conn.their_state is not h11.SEND_RESPONSE

    def trailing_data(self) -> bytes:
        """Bytes read past the response that switched protocols (a 101): the tunnel's."""
        return bytes(self.conn.trailing_data[0])
