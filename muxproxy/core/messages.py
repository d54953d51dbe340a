"""The version-neutral messages between protocol adapters and exchanges.

An adapter turns bytes from one connection into these messages and these messages back into
bytes; an exchange relays them from one adapter to the other without knowing the HTTP version
on either side. Header names are lower-case bytes, values bytes (RFC 9110 §5.1: field names are
case-insensitive; HTTP/2 requires lower case on the wire, RFC 9113 §8.2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

Headers = list[tuple[bytes, bytes]]
Fields = Sequence[tuple[bytes, bytes]]
"""Fields only read (``Headers`` is what is built up and handed on)."""
AnswerRewrite = Callable[[int, Headers], Headers]
"""What the fields of one of the proxy's own answers (status, fields) become before they go
out: the extensions' ``on_response_head`` (``exchange/hooked.py``)."""


@attrs.frozen(kw_only=True, slots=True)
class OwnBody:
    """The body of one of the proxy's own answers that is not an error text (the model list
    of ``core/apis/modellist.py``), in place of the text's (``http/errors.py``)."""

    content_type: bytes
    data: bytes


@attrs.frozen(kw_only=True, slots=True)
class RequestHead:
    stream: int
    method: bytes
    target: bytes
    authority: bytes
    scheme: bytes
    headers: Headers
    http_version: bytes = b"1.1"
    end_stream: bool = False
    """The request has no body: its ``End`` follows at once."""
    protocol: bytes | None = None
    """HTTP/2 ``:protocol`` of an extended CONNECT (RFC 8441 §4), e.g. ``b"websocket"``."""


@attrs.frozen(kw_only=True, slots=True)
class ResponseHead:
    stream: int
    status: int
    headers: Headers
    reason: bytes = b""
    """An HTTP/1.1 backend's reason phrase (RFC 9112 §4); kept only for a code without a
    standard phrase (``reasons.py``)."""
    end_stream: bool = False
    """The response is complete with its head: an HTTP/2 HEADERS frame with END_STREAM (gRPC's
    Trailers-Only). Its ``End`` still follows, repeating the gRPC status fields as trailers
    for a client that cannot end a response with its head (``heads.client_head``)."""


@attrs.frozen(kw_only=True, slots=True)
class Body:
    """A chunk of body. ``flow_len`` is what it cost the sender's HTTP/2 window (with padding)."""

    stream: int
    data: bytes
    flow_len: int = 0


@attrs.frozen(kw_only=True, slots=True)
class End:
    stream: int
    trailers: Headers = attrs.field(factory=list)


@attrs.frozen(kw_only=True, slots=True)
class Abort:
    """The stream ended without a clean end: a reset, a broken connection, a protocol error."""

    stream: int
    reason: str


@attrs.frozen(kw_only=True, slots=True)
class Refused:
    """A request refused by the adapter before it became an exchange, to be answered with
    ``status`` (an HTTP/2 header list over the limit: 431)."""

    stream: int
    status: int
    reason: str
    end_stream: bool
    """The request has no body (else the rest of it is declined once answered)."""


Message = RequestHead | ResponseHead | Body | End | Abort | Refused
