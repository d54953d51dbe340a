"""HTTP/1.1 adapters: one ``h11.Connection`` each, translated to and from core messages.

Obeys RFC 9112 through h11, which owns the framing (Content-Length, chunked, read-until-close)
and the keep-alive cycle, with the two exceptions below. The adapters hold no buffers of their
own: bytes in become messages at once, messages out become bytes at once — that is what keeps
one SSE token one write (per-chunk flush).

``H1Server`` faces a client; ``H1Client`` (``h1client.py``) faces a backend. Errors by
blame: a peer's malformed bytes raise ``PeerError`` (with the status h11 suggests and a fixed
reason that quotes none of the peer's bytes, since it becomes the body of a 400), our own
misuse raises h11's ``LocalProtocolError`` and is a bug: nothing here catches it. What a peer
sends reaches h11's send side only after it was checked (``head_bytes``,
``headers.trailer_fields``; trailers go out only where the body is chunked).

Request smuggling (RFC 9112 §6.1, §6.3, §11.2): h11 is lenient where a front-end and we could
disagree on where a request ends. It accepts bare LF line endings (RFC 9112 §2.2 allows that,
but a peer that does not would see a different head), replaces obs-fold with SP (§5.2 allows
that too), and merges repeated or list-form Content-Length values ("5, 5") into one. Its parsed
``Request`` no longer shows any of that, so ``H1Server`` keeps the raw bytes of each request
head (bounded by ``max_head``) and ``check_raw_head`` refuses all three with 400 before the
head becomes a message. Content-Length next to Transfer-Encoding is refused by
``intake.request_from_h1``. Control characters in a field value (RFC 9110 §5.5), which h11
lets through but for NUL, CR and LF, are refused by ``check_raw_head`` too. h11 checks chunk
sizes only for hex digits (up to 20 of them, past 2**64); a chunked request body also goes
through a ``chunked.ChunkedDecoder``, which refuses sizes past ``chunked.MAX_SIZE_DIGITS``
(before h11 hands out a byte of them) and control characters in extensions and trailers. The
body always reaches the backend re-framed by our own h11 client, never as the client's bytes.

Two departures from "h11 owns the framing", both on the per-token path, where h11's state
machine cost more than everything else the proxy does for a token:

- a backend's *chunked response body* is decoded by ``chunked.ChunkedDecoder`` once h11 has
  parsed the head (the bytes h11 read past the head come from its public ``trailing_data``).
  h11 makes one event per chunk, and an LLM backend sends one chunk per token; the decoder
  hands the proxy everything a read completed as one ``Body``. The connection's next
  response gets a fresh ``h11.Connection``;
- a *chunked response body to a client* is framed by ``H1Server.send_body`` itself, once h11
  has chosen chunked framing for the head; h11 writes the head, the last chunk and the
  trailers, and keeps the keep-alive cycle.

And one on the request path (``head_bytes``): h11 is given only the fields it acts on when it
sends a head (framing, Host, Connection, Expect, Upgrade); it writes the start line and those
fields and keeps its state machine exact. The other fields are appended after them, checked
once against h11's own grammar (RFC 9110 §5.1, §5.5). h11 re-validates every field of a head
it sends, four times for a chunked response, and with the 10-20 fields of an LLM API request
that was the largest item of a request's cost.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import h11

from muxproxy.config import Api
from muxproxy.core.http.errors import error_response
from muxproxy.core.http.intake import MalformedRequest, request_from_h1
from muxproxy.core.http1.chunked import ChunkedDecoder, ChunkedError
from muxproxy.core.http1.h2c import UPGRADE_HEADERS, H2cUpgrade, h2c_offer
from muxproxy.core.http1.reasons import reason_phrase
from muxproxy.core.messages import Abort, Body, End, Headers, Message, ResponseHead

# What h11 adds to a response head when it frames the body chunked.
_H11_CHUNKED = b"\r\nTransfer-Encoding: chunked\r\n"
# Our interim answer to Expect: 100-continue, with its phrase (``reasons.py``).
_CONTINUE = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")

# How much of one h11.receive_data we let build up unparsed before the head is complete;
# RFC 9112 leaves the limit to us, h11's default is 16 KiB.
DEFAULT_MAX_HEAD = 64 * 1024


# RFC 9112 §5.2: an obs-fold is a line break followed by SP or HTAB inside the field section.
_OBS_FOLD = re.compile(rb"\n[ \t]")
# RFC 9112 §2.2: a bare LF is an LF not preceded by CR. (A bare CR h11 refuses itself.)
_BARE_LF = re.compile(rb"(?<!\r)\n")
# h11's end of a head: an empty line, CRLF or bare LF.
_HEAD_END = re.compile(rb"\n\r?\n")


# RFC 9110 §5.5: a field value holds no control character but HTAB (CR and LF end lines and
# are h11's). h11 refuses NUL, VT, FF and bare CR itself, not the others.
_CONTROL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def check_raw_head(head: bytes) -> None:
    """Refuse what h11 would normalise away or let through in a request head (see the module
    docstring), and control characters in it.

    ``head`` is the request line and field lines up to the empty line. Raises
    ``PeerError`` (400)."""
    if _CONTROL.search(head) is not None:
        # h11's request line grammar has no control characters either: one is in a value.
        raise PeerError("control character in a field value")
    if _BARE_LF.search(head) is not None:
        raise PeerError("bare LF line ending in the request head")
    if _OBS_FOLD.search(head) is not None:
        raise PeerError("obs-fold (line folding) in the request head")
    # With bare LF and obs-fold refused, every field line starts after a CRLF, and h11 allows
    # no whitespace before the colon: each Content-Length field is one "\r\ncontent-length:".
    # RFC 9110 §8.6 lets a recipient merge identical values; a front-end that does not would
    # frame the body differently, so we refuse both forms.
    lowered = head.lower()
    field = b"\r\ncontent-length:"
    first = lowered.find(field)
    if first < 0:
        return
    start = first + len(field)
    end = lowered.find(b"\r\n", start)
    if b"," in lowered[start : end if end >= 0 else len(lowered)]:
        raise PeerError("list of values in content-length")
    if lowered.find(field, start) >= 0:
        raise PeerError("more than one content-length field")


# Where h11's error text starts quoting the peer's bytes as a Python repr ("illegal header
# line: b'...'", "Illegal header name bytearray(b'...')").
_REPR = re.compile(r":? ?(?:bytearray\(b|b)['\"]")


def h11_reason(exc: h11.ProtocolError) -> str:
    """h11's error text without the bytes it quotes: an error response's body is fixed text
    and never echoes what the client sent."""
    text = str(exc)
    match = _REPR.search(text)
    return text[: match.start()] if match is not None else text


class PeerError(Exception):
    """The peer sent bytes that are not valid HTTP/1.1. ``status`` is the answer to give;
    ``smuggling``: framing that another parser could read differently (a refused smuggling
    attempt, which ``defencelog.py`` counts)."""

    def __init__(self, reason: str, status: int = 400, *, smuggling: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.smuggling = smuggling


class H1Server:
    """The server side of one client connection: requests in, responses out."""

    def __init__(self, *, scheme: bytes, max_head: int = DEFAULT_MAX_HEAD) -> None:
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_head)
        self.scheme = scheme
        self.stream = 0
        """Number of the current request on this connection (1, 2, ...)."""
        self.interim = b""
        """Bytes of an interim response (100 Continue) produced while receiving."""
        self.h2c: H2cUpgrade | None = None
        """An accepted h2c upgrade offer (h2c.py): its head and end are withheld until the
        owner calls ``switch_to_h2c`` or ``decline_h2c``."""
        self.max_head = max_head
        self.method = b""
        """The method of the current request, once h11 parsed its head."""
        self.chunking = False
        """The current response's body is chunked: ``send_body`` frames it itself."""
        self.chunks: ChunkedDecoder | None = None
        """While a chunked request body arrives: a decoder fed the same bytes as h11, for
        what h11 lets through (a size past ``chunked.MAX_SIZE_DIGITS``, control characters
        in an extension or a trailer). Its payload is dropped; h11's events carry the body."""
        self.raw_head: bytearray | None = bytearray()
        """The bytes received since the current request began, while its head is incomplete
        (None once h11 parsed it): what ``check_raw_head`` looks at. At most ``max_head``
        plus one read, since h11 refuses a longer head (431)."""

    def receive(self, data: bytes) -> list[Message]:
        """Feed bytes (b"" for EOF); return the messages they complete. Raises ``PeerError``."""
        raw = self.raw_head
        if raw is not None and len(raw) <= self.max_head:
            raw += data
        if self.chunks is not None:
            self._check_chunks(data)
        self.conn.receive_data(data)
        return self._drain()

    def _check_chunks(self, data: bytes) -> None:
        """Feed the request body's bytes to ``chunks`` before h11 sees them, so a bad chunk
        is refused before any of it is forwarded. Raises ``PeerError`` (400)."""
        chunks = self.chunks
        assert chunks is not None
        try:
            chunks.feed(data)
        except ChunkedError as exc:
            # Framing h11 would have read differently: a smuggling attempt, or a broken client.
            raise PeerError(str(exc), smuggling=True) from exc
        if chunks.done:
            self.chunks = None  # what follows is the next request's: h11 keeps it

    def next_cycle(self) -> list[Message]:
        """Start the next request on a kept-alive connection; parse what was pipelined."""
        self.raw_head = bytearray(self.conn.trailing_data[0])
        self.chunks = None
        self.method = b""
        self.chunking = False
        self.conn.start_next_cycle()
        return self._drain()

    def _drain(self) -> list[Message]:
        out: list[Message] = []
        conn = self.conn
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise PeerError(h11_reason(exc), exc.error_status_hint) from exc
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return out
            if type(event) is h11.Data:
                out.append(Body(stream=self.stream, data=h11_data(event)))
            elif type(event) is h11.Request:
                self.method = event.method
                # One walk over h11's ``Headers`` (a Sequence iterated in Python, an item at a
                # time), for the framing check and the head both.
                fields = list(event.headers)
                raw = self.raw_head
                if raw is not None:
                    self.raw_head = None
                    end = _HEAD_END.search(raw)
                    if end is None or end.start() > self.max_head:
                        # h11 bounds only a head that is still incomplete after a read; one
                        # that arrives whole is bounded here (RFC 6585 §5).
                        raise PeerError("request head too large", 431)
                    try:
                        check_raw_head(bytes(raw[: end.start() + 1]))
                    except PeerError as exc:
                        exc.smuggling = True  # every check there is one (module docstring)
                        raise
                    if any(name == b"transfer-encoding" for name, _ in fields):
                        # h11 accepts no transfer coding but chunked (RFC 9112 §6.1); the
                        # body starts after the empty line.
                        self.chunks = ChunkedDecoder(max_line=self.max_head)
                        if end.end() < len(raw):
                            self._check_chunks(bytes(raw[end.end() :]))
                self.stream += 1
                self.method = bytes(event.method)
                try:
                    head = request_from_h1(
                        self.stream,
                        event.method,
                        event.target,
                        fields,
                        scheme=self.scheme,
                        http_version=event.http_version,
                    )
                except MalformedRequest as exc:
                    raise PeerError(exc.reason, exc.status, smuggling=exc.smuggling) from exc
                head, self.h2c = h2c_offer(head, plain=self.scheme == b"http")
                if self.h2c is not None:
                    continue  # h11 pauses after its EndOfMessage: the switch is proposed
                out.append(head)
                if conn.they_are_waiting_for_100_continue:
                    # RFC 9110 §10.1.1: we will read the body, so tell the client to send it
                    # now instead of making it wait for a timeout.
                    self.interim += conn.send(_CONTINUE) or b""
            elif type(event) is h11.EndOfMessage:
                if self.h2c is None:
                    out.append(End(stream=self.stream, trailers=list(event.headers)))
            elif type(event) is h11.ConnectionClosed:
                if conn.their_state is not h11.DONE or conn.our_state is not h11.DONE:
                    out.append(Abort(stream=self.stream, reason="client closed the connection"))
                return out
            else:  # pragma: no cover - h11 has no other server-side events
                raise AssertionError(f"unexpected h11 event {event!r}")

    def switch_to_h2c(self) -> tuple[bytes, bytes]:
        """Accept the pending h2c offer: (our 101's bytes, what the client sent after its
        request — the start of its HTTP/2 preface). This connection is done with HTTP/1.1."""
        self.h2c = None
        switching = h11.InformationalResponse(
            status_code=101, headers=UPGRADE_HEADERS, reason=b"Switching Protocols"
        )
        out = self.conn.send(switching)
        return out or b"", bytes(self.conn.trailing_data[0])

    def switch_protocols(self, headers: Headers) -> tuple[bytes, bytes]:
        """Switch to the protocol of the request's Upgrade (a WebSocket tunnel): (our 101's
        bytes with ``headers``, what the client sent after its request — the new protocol's
        first bytes). RFC 9110 §15.2.2; h11 is SWITCHED_PROTOCOL from here on."""
        switching = h11.InformationalResponse(
            status_code=101, headers=headers, reason=b"Switching Protocols"
        )
        out = self.conn.send(switching)
        return out or b"", bytes(self.conn.trailing_data[0])

    def decline_h2c(self) -> list[Message]:
        """Serve the pending h2c offer over HTTP/1.1 after all: its head and end. The normal
        response that follows tells h11 the switch was refused (RFC 9110 §7.8)."""
        upgrade, self.h2c = self.h2c, None
        assert upgrade is not None
        return [upgrade.head, End(stream=upgrade.head.stream)]

    def send_head(self, head: ResponseHead) -> bytes:
        out = head_bytes(
            self.conn,
            lambda fields: h11.Response(
                status_code=head.status,
                headers=fields,
                reason=reason_phrase(head.status, head.reason),
            ),
            head.headers,
        )
        # The framing h11 chose for the body (RFC 9112 §6.3): chunked is the one it announces
        # itself. A response to HEAD, a 204 or a 304 has no body, whatever the head says.
        self.chunking = (
            _H11_CHUNKED in out and self.method != b"HEAD" and head.status not in (204, 304)
        )
        return out

    def send_body(self, data: bytes) -> bytes:
        if self.chunking:
            # One chunk per piece (RFC 9112 §7.1), written here rather than by h11: the same
            # bytes h11 writes, without a trip through its state machine per token. h11
            # stays in SEND_BODY and writes the last chunk and trailers in ``send_end``.
            return b"%x\r\n%s\r\n" % (len(data), data) if data else b""
        return self.conn.send(h11.Data(data=data)) or b""

    def send_end(self, trailers: Headers) -> bytes:
        # RFC 9112 §7.1.2: only a chunked body has a trailer section; with Content-Length,
        # read-until-close (an HTTP/1.0 client) or no body at all the trailers are dropped
        # (RFC 9110 §6.5.2 lets a recipient discard them), as h11 refuses to send them.
        if not self.chunking:
            trailers = []
        return self.conn.send(h11.EndOfMessage(headers=trailers)) or b""

    def send_error(
        self, status: int, text: str, *, api: Api | None = None, date: bytes | None = None
    ) -> bytes:
        """A complete short error response (``errors.error_response``: plain text, or the
        OpenAI error object with ``api``), when a response can still be started."""
        headers, body = error_response(status, text, api=api, date=date)
        return self.send_whole(status, headers, body)

    @property
    def head_only(self) -> bool:
        """The current request is a HEAD: a response to it carries no body (RFC 9110 §9.3.2)."""
        return self.method == b"HEAD" and self.conn.their_state is not h11.IDLE

    def send_whole(self, status: int, headers: Headers, body: bytes) -> bytes:
        """A complete response of the proxy's own, then a close (``connection: close``), when a
        response can still be started; b"" otherwise."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return b""
        headers = [*headers, (b"connection", b"close")]
        response = h11.Response(status_code=status, headers=headers, reason=reason_phrase(status))
        out = self.conn.send(response) or b""
        if not self.head_only:
            # RFC 9110 §9.3.2: no body in a response to HEAD (h11 raises on one).
            out += self.conn.send(h11.Data(data=body)) or b""
        out += self.conn.send(h11.EndOfMessage()) or b""
        return out

    @property
    def reusable(self) -> bool:
        """Request and response are both complete and the connection may carry another."""
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE

    @property
    def response_started(self) -> bool:
        return self.conn.our_state is not h11.SEND_RESPONSE and self.conn.our_state is not h11.IDLE

    @property
    def idle(self) -> bool:
        """Between requests: nothing received of the next one yet."""
        return self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]


# h11's grammar for what it sends: a field name is a token (RFC 9110 §5.1); a value has no
# NUL, CR, LF or other whitespace but SP and HTAB inside, and none at either end (§5.5).
_NAME_SYNTAX = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_VALUE_SYNTAX = rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?"

H11_FIELDS = frozenset(
    [b"host", b"content-length", b"transfer-encoding", b"connection", b"expect", b"upgrade"]
)
"""The fields h11 acts on when it sends a head: the body's framing (RFC 9112 §6), the
mandatory Host (§3.2), keep-alive (§9.3), 100-continue (RFC 9110 §10.1.1) and upgrades (§7.8)."""
_NAMES = re.compile(rb"(?:%s:)*" % _NAME_SYNTAX)
"""Field names, each followed by ":"."""
_VALUES = re.compile(rb"(?:%s\x00)*" % _VALUE_SYNTAX)
"""Field values, each followed by NUL."""


def h11_data(event: h11.Data) -> bytes:
    """The body bytes of an h11 ``Data`` event, as ``bytes``.

    h11 declares them ``bytes`` and hands out the ``bytearray`` its buffer was sliced from; the
    compiled build checks declared types at run time, so the value is read untyped here."""
    data: Any = event
    return bytes(data.data)


def head_bytes(
    conn: h11.Connection,
    make: Callable[[Headers], h11.Request | h11.Response],
    fields: Headers,
) -> bytes:
    """The bytes of a head: h11 sends ``make(fields it acts on)``, the other fields follow.

    Raises ``h11.LocalProtocolError`` for a field h11 would refuse, as ``conn.send`` does.
    """
    own: Headers = []
    rest: Headers = []
    for field in fields:
        (own if field[0].lower() in H11_FIELDS else rest).append(field)
    out = conn.send(make(own)) or b""
    if not rest:
        return out
    # One regex over all names and one over all values, each joined by a byte that a valid
    # one never contains; counting that byte catches an invalid one that does.
    names = b"".join([name + b":" for name, _ in rest])
    if names.count(b":") != len(rest) or not _NAMES.fullmatch(names):
        raise h11.LocalProtocolError(f"illegal header name in {[n for n, _ in rest]!r}")
    values = b"".join([value + b"\x00" for _, value in rest])
    if values.count(b"\x00") != len(rest) or not _VALUES.fullmatch(values):
        raise h11.LocalProtocolError("illegal header value")
    # h11's head ends with the empty line (RFC 9112 §2.1): the other fields go before it.
    lines = b"".join([name + b": " + value + b"\r\n" for name, value in rest])
    return out[:-2] + lines + b"\r\n"
