"""gRPC awareness: what the proxy must do differently for a gRPC call (a request whose
content-type is ``application/grpc`` or ``application/grpc+...``).

Obeys "gRPC over HTTP/2" (grpc/doc/PROTOCOL-HTTP2.md) and the gRPC status code list:

- A call the proxy itself fails (no backend, refused, timeout) is answered the gRPC way: HTTP
  200, ``content-type: application/grpc`` and a Trailers-Only response carrying ``grpc-status``
  and ``grpc-message``. gRPC clients map an HTTP error page to a vaguer status (and lose the
  message), so a 502 page would hide why the call failed.
- A backend's Trailers-Only response (one HEADERS frame with END_STREAM: the status fields
  and any custom metadata, such as ``grpc-retry-pushback-ms``) reaches an HTTP/2 client as
  Trailers-Only, whole: grpcio reads the metadata of such a response as trailing metadata,
  which a head split from its status would hide. An HTTP/1.1 client, which cannot end a
  response with its head, gets the status fields (``STATUS_FIELDS``) as trailers instead.
- ``grpc-timeout`` (1-8 digits and a unit H M S m u n) bounds the whole call: the proxy gives
  up at the smaller of it and its own deadline, with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from muxproxy.core.messages import Headers

STATUS_FIELDS = frozenset({b"grpc-status", b"grpc-message", b"grpc-status-details-bin"})
"""The status fields of gRPC's trailers ("gRPC over HTTP/2", "Trailers")."""

OK = 0
DEADLINE_EXCEEDED = 4
UNIMPLEMENTED = 12
UNAVAILABLE = 14

_TIMEOUT = re.compile(rb"([0-9]{1,8})([HMSmun])")
_UNIT_SECONDS = {
    b"H": 3600.0,
    b"M": 60.0,
    b"S": 1.0,
    b"m": 1e-3,
    b"u": 1e-6,
    b"n": 1e-9,
}


def is_grpc(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether the request's content-type is application/grpc, with or without +format."""
    for name, value in headers:
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return media == b"application/grpc" or media.startswith(b"application/grpc+")
    return False


def grpc_timeout(headers: Iterable[tuple[bytes, bytes]]) -> float | None:
    """The ``grpc-timeout`` in seconds, or None when absent or malformed (then ignored)."""
    for name, value in headers:
        if name == b"grpc-timeout":
            match = _TIMEOUT.fullmatch(value.strip())
            if match is None:
                return None
            return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    return None


def status_for_http(status: int) -> int:
    """The gRPC status for a failure the proxy would answer with HTTP ``status``.

    Follows grpc/doc/http-grpc-status-mapping.md: 404 UNIMPLEMENTED, 504 (our timeouts)
    DEADLINE_EXCEEDED, every other proxy failure UNAVAILABLE (the client may retry).
    """
    if status == 404:
        return UNIMPLEMENTED
    if status == 504:
        return DEADLINE_EXCEEDED
    return UNAVAILABLE


def status_fields(code: int, message: str) -> Headers:
    """``grpc-status`` and a percent-encoded ``grpc-message`` (PROTOCOL-HTTP2.md)."""
    encoded = "".join(
        c if " " <= c <= "~" and c != "%" else "".join(f"%{b:02X}" for b in c.encode())
        for c in message
    )
    return [(b"grpc-status", str(code).encode()), (b"grpc-message", encoded.encode("ascii"))]


def trailers_only(code: int, message: str) -> Headers:
    """The fields of a Trailers-Only response (after ``:status 200``)."""
    return [(b"content-type", b"application/grpc"), *status_fields(code, message)]
