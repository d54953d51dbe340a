"""Header translation for a proxy: what goes to the backend, what goes back to the client.

Intake validation of what a client sent is ``intake.py``'s.

Pure functions, run once per request or response; they avoid needless copies and look names up
in frozensets. What they obey:

* RFC 9110 §7.6.1 (hop-by-hop fields): Connection, Proxy-Connection, Keep-Alive, TE,
  Transfer-Encoding, Upgrade, HTTP2-Settings (RFC 9113 §3.2.1: it belongs to one hop's h2c
  offer, so it goes even when no Connection header names it) and every field a Connection
  header nominates are removed before forwarding, in both directions. ``TE: trailers`` is
  the one exception we forward (it is meaningful end to end for gRPC, RFC 9113 §8.2.2).
* RFC 6455 §4.1 / RFC 9110 §7.8 (Upgrade): the one exception to dropping Upgrade and
  Connection is a WebSocket opening handshake (``is_websocket_upgrade``): a GET without a body
  whose Upgrade is exactly ``websocket`` and whose Connection names ``upgrade`` is forwarded
  with ``connection: upgrade`` and ``upgrade: websocket`` (and nothing else those fields held),
  because the backend, not the proxy, answers the handshake. The tunnel after the 101 is
  ``tunnel.py``'s.
* RFC 9110 §7.6.2 (Max-Forwards) is not needed: we answer no TRACE or OPTIONS ourselves.
* RFC 9110 §7.6.3 (Via): we append ``<received-protocol> <pseudonym>`` in both directions.
* RFC 9113 §8.2 / §8.2.1 (field validity), §8.2.2 (connection-specific fields), §8.2.3 (cookie
  crumbs, joined with "; " for HTTP/1.1), §8.3.1 (request pseudo-headers) and §8.1.1 (malformed
  messages) for HTTP/2 requests, which h2 hands us unvalidated and unnormalized.
* RFC 9112 §3.2 (Host, request-target forms) and §6.3 (Transfer-Encoding overrides
  Content-Length; an intermediary removes Content-Length in that case) for HTTP/1.1.
* RFC 9110 §6.5.1 (trailer fields): what a trailer section must not carry, and what the other
  protocol cannot carry, is dropped, whichever way the message goes (``trailer_fields``).
* The forwarded fields (X-Forwarded-For, -Proto, -Host, -Port, X-Real-IP, RFC 7239
  Forwarded) are ``forwarded.py``'s: dropped and set from the connection for an untrusted
  peer, appended to for a proxy the listener trusts (``trusted_proxies``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from operator import itemgetter

from muxproxy.core.http.forwarded import FORWARDED_FIELDS, append_list, forwarded_fields
from muxproxy.core.messages import Headers, RequestHead

_NAME = itemgetter(0)

__all__ = [
    "CONNECTION_SPECIFIC",
    "header_value",
    "is_event_stream",
    "is_websocket_upgrade",
    "response_headers",
    "trailer_fields",
    "upstream_h1_headers",
    "upstream_h2_headers",
]


# --- field name sets -----------------------------------------------------------------------
# RFC 9113 §8.2.2 connection-specific fields: malformed in an HTTP/2 message. TE is checked
# separately (allowed with the value "trailers" only).
CONNECTION_SPECIFIC = frozenset(
    {b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding", b"upgrade"}
)
# RFC 9110 §7.6.1 hop-by-hop fields (Proxy-Connection and Keep-Alive being the legacy ones it
# names too), and HTTP2-Settings, which RFC 9113 §3.2.1 makes hop-by-hop (an h2c offer to us,
# whether we took it or not).
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"proxy-connection",
        b"keep-alive",
        b"te",
        b"transfer-encoding",
        b"upgrade",
        b"http2-settings",
    }
)
# Names a Connection header may not take away from the message here: Content-Length frames the
# body we relay (dropping it would change the message, RFC 9110 §7.6.1 forbids nominating fields
# meant for all recipients), Host is ours (rebuilt from the authority) and TE keeps its own rule
# (only "trailers" travels). The X-Forwarded-* and Via fields we add are never removed either
# (a nominated one is the previous hop's, and goes: ``forwarded.py`` then sets ours).
_NOT_NOMINATABLE = frozenset({b"content-length", b"te", b"host"})

# Every request field name upstream_h1_headers treats specially; one set lookup per field on
# the common path.
_UPSTREAM_SPECIAL = _HOP_BY_HOP | FORWARDED_FIELDS | {b"host", b"cookie", b"content-length", b"via"}
# Every response field name response_headers treats specially.
_RESPONSE_SPECIAL = _HOP_BY_HOP | {
    b"date",
    b"content-length",
    b"content-type",
    b"cache-control",
    b"x-accel-buffering",
    b"via",
}

_EVENT_STREAM = b"text/event-stream"


# --- helpers -------------------------------------------------------------------------------


def _tokens(value: bytes) -> set[bytes]:
    """The lower-cased tokens of a comma-separated list (RFC 9110 §5.6.1), parameters dropped."""
    out: set[bytes] = set()
    for item in value.split(b","):
        token = item.split(b";", 1)[0].strip(b" \t").lower()
        if token:
            out.add(token)
    return out


# --- upstream (to an HTTP/1.1 backend) -----------------------------------------------------


def upstream_h1_headers(
    head: RequestHead,
    *,
    client_ip: str,
    proto: bytes,
    via: bytes,
    has_body: bool = False,
    trusted: bool = False,
) -> Headers:
    """The field list to send to an HTTP/1.1 backend for `head`.

    Host first (from head.authority); hop-by-hop fields dropped (RFC 9110 §7.6.1) except
    ``te: trailers``; cookies joined (RFC 9113 §8.2.3); the forwarded fields as
    ``forwarded.forwarded_fields`` makes them for a peer at ``client_ip`` over ``proto``
    (``b"https"`` when the client's connection is TLS, ``b"http"`` otherwise; never
    ``head.scheme``, which on HTTP/2 is the client's claim), ``trusted`` when the peer is a
    proxy the listener trusts; Via appended (RFC 9110 §7.6.3).

    Body framing (RFC 9112 §6): Content-Length is kept. A client's Transfer-Encoding (h11 only
    accepts chunked) is replaced by our own ``transfer-encoding: chunked`` and any Content-Length
    next to it is removed (RFC 9112 §6.3). An HTTP/2 request has no Transfer-Encoding: pass
    ``has_body=True`` when its HEADERS did not end the stream, so that a body without
    Content-Length is sent chunked (h11 frames a request without either as having no body).
    """
    # RFC 9112 §3.2: Host first; an empty authority is sent as an empty Host.
    out: Headers = [(b"host", head.authority)]
    append = out.append
    special = _UPSTREAM_SPECIAL
    cookies: list[bytes] | None = None
    cookie_index = 0
    forwarded: Headers = []
    vias: list[bytes] = []
    nominated: set[bytes] = set()
    te_sent = False
    chunked = False
    content_length = False

    for field in head.headers:
        name = field[0]
        if name not in special:
            append(field)
            continue
        if name == b"cookie":
            # RFC 9113 §8.2.3: crumbs are joined with "; " for HTTP/1.1, which allows one
            # Cookie line (RFC 6265 §5.4); the joined field takes the first one's place.
            if cookies is None:
                cookies = [field[1]]
                cookie_index = len(out)
                append(field)
            else:
                cookies.append(field[1])
        elif name == b"content-length":
            content_length = True
            append(field)
        elif name in FORWARDED_FIELDS:
            forwarded.append(field)
        elif name == b"via":
            vias.append(field[1])
        elif name == b"te":
            # RFC 9110 §7.6.1 / RFC 9113 §8.2.2: TE is hop-by-hop, but "trailers" says the
            # client takes trailers, which matters end to end (gRPC); any coding is dropped.
            if not te_sent and b"trailers" in _tokens(field[1]):
                append((b"te", b"trailers"))
                te_sent = True
        elif name == b"connection":
            # RFC 9110 §7.6.1: the fields it names are hop-by-hop too.
            nominated |= _tokens(field[1])
        elif name == b"transfer-encoding":
            # RFC 9112 §6.1: a proxy re-frames; we send chunked ourselves (below).
            chunked = True
        # host (rebuilt), proxy-connection, keep-alive, upgrade, http2-settings: dropped.

    if cookies is not None and len(cookies) > 1:
        # Empty crumbs carry no cookie; joining them would leave a stray "; " (and h11 refuses
        # a value ending in SP).
        out[cookie_index] = (b"cookie", b"; ".join([c for c in cookies if c]))
    if nominated:
        nominated -= _NOT_NOMINATABLE
        if nominated:
            out = [field for field in out if field[0] not in nominated]
            forwarded = [field for field in forwarded if field[0] not in nominated]
            if b"via" in nominated:
                vias = []
    if chunked and content_length:
        # RFC 9112 §6.3: Transfer-Encoding overrides Content-Length, and an intermediary removes
        # the Content-Length before forwarding (request smuggling otherwise).
        out = [field for field in out if field[0] != b"content-length"]
        content_length = False
    if chunked or (has_body and not content_length):
        out.append((b"transfer-encoding", b"chunked"))
    if is_websocket_upgrade(head):
        # RFC 6455 §4.1 / RFC 9110 §7.8: the handshake goes to the backend, which answers it;
        # only this upgrade is passed (the client's Connection / Upgrade values are dropped
        # above like any hop-by-hop field, and rebuilt here from the known-good ones).
        out.append((b"connection", b"upgrade"))
        out.append((b"upgrade", b"websocket"))

    out.extend(forwarded_fields(forwarded, peer_ip=client_ip, proto=proto, trusted=trusted))
    # RFC 9110 §7.6.3: received-protocol is the client's version ("HTTP/" omitted), then our
    # pseudonym; appended to what earlier hops put there.
    ours = head.http_version + b" " + via
    out.append((b"via", append_list(vias, ours)))
    return out


def is_websocket_upgrade(head: RequestHead) -> bool:
    """Whether ``head`` is an HTTP/1.1 WebSocket opening handshake (RFC 6455 §4.1).

    A GET without a body, ``Upgrade`` exactly ``websocket`` (case-insensitive; a list offering
    other protocols too is not, since only this one is tunnelled) and ``Connection`` naming
    ``upgrade`` (RFC 9110 §7.8: Upgrade is only honoured when Connection nominates it). Such a
    request is tunnelled; any other Upgrade is dropped as a hop-by-hop field.
    """
    # HTTP/1.0 has no Upgrade (RFC 6455 §4.1 asks for 1.1 or later). An HTTP/2 request cannot
    # carry these fields (RFC 9113 §8.2.2); one that does is ``websocket.bridged_head``'s.
    if head.method != b"GET" or not head.end_stream or head.http_version == b"1.0":
        return False
    fields = head.headers
    if b"upgrade" not in map(_NAME, fields):  # the common case, found in C
        return False
    upgrade: set[bytes] = set()
    connection: set[bytes] = set()
    for name, value in fields:
        if name == b"upgrade":
            upgrade |= _tokens(value)
        elif name == b"connection":
            connection |= _tokens(value)
    return upgrade == {b"websocket"} and b"upgrade" in connection


# --- downstream (to the client) ------------------------------------------------------------


def response_headers(
    status: int,
    headers: Iterable[tuple[bytes, bytes]],
    *,
    via: bytes,
    upstream_version: bytes,
    to_h2: bool,
    date: bytes | None = None,
) -> Headers:
    """The field list to send to the client for a backend response.

    Hop-by-hop fields dropped (RFC 9110 §7.6.1), Transfer-Encoding always (the client side
    frames the body itself), Content-Length kept except where RFC 9110 §8.6 / RFC 9112 §6.3 say
    it must go; Via appended (RFC 9110 §7.6.3); ``date`` (the proxy's clock, ``dates.py``)
    added as Date when the backend sent none and the status is not 1xx (RFC 9110 §6.6.1: a
    recipient with a clock adds the Date a forwarded response lacks); for text/event-stream,
    cache-control: no-cache
    (unless the backend set one) and x-accel-buffering: no. For HTTP/2 the names come out
    lower-case with no connection-specific field (RFC 9113 §8.2, §8.2.2).
    """
    out: Headers = []
    append = out.append
    special = _RESPONSE_SPECIAL
    vias: list[bytes] = []
    nominated: set[bytes] = set()
    content_type: bytes | None = None
    cache_control = False
    accel = False
    chunked = False
    content_length = False
    dated = False
    # RFC 9110 §8.6: no Content-Length in a 1xx or 204 response.
    no_length = status < 200 or status == 204

    for field in headers:
        name = field[0]
        if not name.islower() and name.lower() != name:
            # RFC 9113 §8.2: lower case on the HTTP/2 wire; and our lookups need it.
            name = name.lower()
            field = (name, field[1])
        if name not in special:
            append(field)
            continue
        if name == b"content-type":
            if content_type is None:
                content_type = field[1]
            append(field)
        elif name == b"content-length":
            if not no_length:
                content_length = True
                append(field)
        elif name == b"cache-control":
            cache_control = True
            append(field)
        elif name == b"x-accel-buffering":
            accel = True
            append(field)
        elif name == b"date":
            dated = True
            append(field)
        elif name == b"via":
            vias.append(field[1])
        elif name == b"connection":
            # RFC 9110 §7.6.1: the fields it names are hop-by-hop too.
            nominated |= _tokens(field[1])
        elif name == b"transfer-encoding":
            chunked = True
        # te, keep-alive, proxy-connection, upgrade, http2-settings: dropped (RFC 9110 §7.6.1,
        # RFC 9113 §3.2.1; RFC 9113 §8.2.2 makes the first four malformed in HTTP/2).

    if nominated:
        nominated -= _NOT_NOMINATABLE
        if nominated:
            out = [field for field in out if field[0] not in nominated]
            if b"via" in nominated:
                vias = []
            if content_type is not None and b"content-type" in nominated:
                content_type = None
            if b"cache-control" in nominated:
                cache_control = False
            if b"date" in nominated:
                dated = False
    if chunked and content_length:
        # RFC 9112 §6.3: with Transfer-Encoding the Content-Length is wrong or ignored; an
        # intermediary removes it before forwarding.
        out = [field for field in out if field[0] != b"content-length"]

    # RFC 9110 §7.6.3: received-protocol is the backend's version, then our pseudonym.
    ours = upstream_version + b" " + via
    append = out.append
    append((b"via", append_list(vias, ours)))
    if date is not None and not dated and status >= 200:
        append((b"date", date))
    if content_type is not None and _is_event_stream_type(content_type):
        # Server-sent events (HTML Living Standard §9.2): keep caches and buffering proxies
        # (nginx's X-Accel-Buffering) from holding tokens back.
        if not cache_control:
            append((b"cache-control", b"no-cache"))
        if accel:
            out = [field for field in out if field[0] != b"x-accel-buffering"]
            out.append((b"x-accel-buffering", b"no"))
        else:
            append((b"x-accel-buffering", b"no"))
    return out


def _is_event_stream_type(content_type: bytes) -> bool:
    # RFC 9110 §8.3.1: media type = type "/" subtype *( OWS ";" OWS parameter ), type and
    # subtype case-insensitive.
    return content_type.split(b";", 1)[0].strip(b" \t").lower() == _EVENT_STREAM


def is_event_stream(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether the (first) content-type is text/event-stream, parameters allowed."""
    content_type = header_value(headers, b"content-type")
    return content_type is not None and _is_event_stream_type(content_type)


def header_value(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of field `name` (lower-case), or None."""
    if type(headers) is list and name not in map(_NAME, headers):
        return None  # the common case (a field most requests lack), found in C
    for field_name, value in headers:
        if field_name == name:
            return value
    return None


# --- upstream (to an HTTP/2 backend) -------------------------------------------------------


def upstream_h2_headers(method: bytes, scheme: bytes, target: bytes, fields: Headers) -> Headers:
    """The HTTP/2 field block for a request whose forwarded fields are ``fields``.

    ``fields`` is what :func:`upstream_h1_headers` produced (plus any configured rules): the
    hop-by-hop work is done there. Here (RFC 9113 §8.3.1) Host becomes ``:authority``, the
    pseudo-fields come first, names are lower-cased (§8.2) and connection-specific fields,
    including the Transfer-Encoding added for HTTP/1.1 framing, are dropped (§8.2.2);
    ``te: trailers`` is kept (gRPC needs it).
    """
    authority = b""
    rest: Headers = []
    for name, value in fields:
        name = name.lower()
        if name == b"host":
            authority = value
        elif name not in CONNECTION_SPECIFIC and (
            name != b"te" or value.strip().lower() == b"trailers"
        ):
            rest.append((name, value))
    out: Headers = [(b":method", method), (b":scheme", scheme)]
    if authority:
        out.append((b":authority", authority))
    out.append((b":path", target if target.startswith(b"/") or target == b"*" else b"/" + target))
    out.extend(rest)
    return out


# --- trailers (both directions) ------------------------------------------------------------

# RFC 9110 §6.5.1: a trailer field is processed after the content, so a field whose meaning a
# recipient needs before it (framing, routing, authentication, request modifiers, response
# control, content format) has no place in a trailer section; nor has a hop-by-hop field
# (§7.6.1), a connection-specific one (RFC 9113 §8.2.2) or HTTP2-Settings (RFC 9113 §3.2.1).
# h11 raises on a bad Transfer-Encoding or Content-Length in trailers it sends, and h2 on a
# connection-specific field or a pseudo-header (RFC 9113 §8.1): they are dropped.
_NOT_IN_TRAILERS = _HOP_BY_HOP | {
    # framing and routing
    b"content-length",
    b"trailer",
    b"host",
    b"http2-settings",
    # content format
    b"content-type",
    b"content-encoding",
    b"content-range",
    # authentication
    b"authorization",
    b"proxy-authorization",
    b"www-authenticate",
    b"proxy-authenticate",
    b"cookie",
    b"set-cookie",
    # request modifiers and response control data
    b"cache-control",
    b"expect",
    b"max-forwards",
    b"range",
    b"age",
    b"expires",
    b"date",
    b"location",
    b"retry-after",
    b"vary",
}
# RFC 9110 §5.1 token (any case; lower-cased on the way out) and §5.5 field-value: VCHAR and
# obs-text, SP / HTAB only inside. A pseudo-header (":status") is not a token.
_TRAILER_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TRAILER_VALUE = re.compile(
    rb"(?:[\x21-\x7e\x80-\xff](?:[\t\x20-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?"
)


def trailer_fields(trailers: Iterable[tuple[bytes, bytes]]) -> Headers:
    """The trailer fields of a message that may be forwarded, names lower-cased.

    Dropped (RFC 9110 §6.5.1, §6.5.2 lets a recipient discard trailers): fields that must not
    be trailers (``_NOT_IN_TRAILERS``), pseudo-headers, and names or values outside RFC 9110
    §5.1 / §5.5, which neither h11 nor h2 would send. What is left is valid in an HTTP/1.1
    chunked trailer section and an HTTP/2 trailing HEADERS frame alike, so this runs once per
    message, whatever the two protocols are.
    """
    out: Headers = []
    for name, value in trailers:
        name = name.lower()
        if (
            name not in _NOT_IN_TRAILERS
            and _TRAILER_NAME.fullmatch(name) is not None
            and _TRAILER_VALUE.fullmatch(value) is not None
        ):
            out.append((name, value))
    return out
