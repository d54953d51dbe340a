"""Request intake: what a client sent, validated and turned into a ``RequestHead``.

Pure functions, run once per request. A request the client got wrong raises
``MalformedRequest`` with the HTTP/1.1 status to answer (the HTTP/2 adapter resets the stream
instead). What they obey:

* RFC 9113 §8.2 / §8.2.1 (field validity), §8.2.2 (connection-specific fields), §8.3.1 (request
  pseudo-headers) and §8.1.1 (malformed messages) for HTTP/2 requests, which h2 hands us
  unvalidated and unnormalized.
* RFC 9112 §3.2 (Host, request-target forms) and §6.1 / §6.3 (Transfer-Encoding with
  Content-Length is refused: a smuggling vector) for HTTP/1.1.
* RFC 6585 §5 / RFC 9110 §15.5.14: limits on field count (431) and declared body size (413).

Translation for the other side (hop-by-hop removal, Host, cookies, X-Forwarded-*, Via) is
``headers.py``'s.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from muxproxy.core.http.headers import CONNECTION_SPECIFIC, header_value
from muxproxy.core.messages import Headers, RequestHead

__all__ = [
    "MalformedRequest",
    "check_request_limits",
    "request_from_h1",
    "request_from_h2",
    "valid_h2_fields",
]


class MalformedRequest(Exception):
    """A request the client got wrong; `status` is the HTTP/1.1 status to answer with (400
    usually, 431 for a too large head, 501 for unsupported transfer coding...), `reason` short
    fixed text: it becomes the body of the answer, so it never quotes the client's bytes;
    ``smuggling``: ambiguous framing (a refused smuggling attempt)."""

    def __init__(self, reason: str, status: int = 400, *, smuggling: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.smuggling = smuggling

    def __repr__(self) -> str:
        return f"MalformedRequest({self.reason!r}, status={self.status})"


# --- character classes ---------------------------------------------------------------------

# RFC 9110 §5.6.2 tchar, without upper case: RFC 9113 §8.2.1 forbids 0x00-0x20, 0x41-0x5a and
# 0x7f-0xff in names, and §8.2.1 says to validate against RFC 9110 §5.1 too, so a name must be a
# lower-case token. (Anything else would also be refused by h11 when we forward it.)
_LOWER_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9a-z]+")
# RFC 9110 §5.6.2 token, as :method must be (RFC 9110 §9.1).
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# RFC 9110 §5.5 field-value: field-vchar (VCHAR / obs-text) with SP / HTAB only inside. This
# covers RFC 9113 §8.2.1 (no NUL, CR, LF; no leading or trailing SP / HTAB) and also refuses the
# other control characters, as RFC 9110 §5.5 defines them out (h11 would refuse VT and FF).
_FIELD_VALUE = re.compile(
    rb"(?:[\x21-\x7e\x80-\xff](?:[\t\x20-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?"
)
# RFC 3986 §3.1 scheme.
_SCHEME = re.compile(rb"[A-Za-z][A-Za-z0-9+\-.]*")
# RFC 3986 §3.2 authority without userinfo (RFC 9110 §4.2.4 / RFC 9113 §8.3.1 forbid it):
# host (IP-literal or reg-name / IPv4address) and an optional port.
_AUTHORITY = re.compile(
    rb"(?:\[[0-9A-Za-z:.!$&'()*+,;=\-_~%]+\]|[0-9A-Za-z\-._~!$&'()*+,;=%]*)(?::[0-9]*)?"
)
# RFC 9112 §3.2.1 origin-form / RFC 9113 §8.3.1 :path: path-absolute [ "?" query ], all VCHAR.
_ORIGIN_FORM = re.compile(rb"/[\x21-\x7e]*")
# RFC 9112 §3.2.2 absolute-form; we take the scheme and authority and keep path and query.
_ABSOLUTE_FORM = re.compile(rb"([A-Za-z][A-Za-z0-9+\-.]*)://([^/?#]*)([^#]*)")

# RFC 9112 §3.2, RFC 3986 §3.5: a fragment is the client's own and is never sent; a target
# with one is malformed (forwarded, a backend could route on it, or cut the path there while
# we routed on the whole).
_FRAGMENT = "fragment in the request target"
_HTTP_SCHEMES = (b"http", b"https")

# --- field name sets -------------------------------------------------------------------

# RFC 9113 §8.3.1 request pseudo-headers, plus :protocol from RFC 8441 §4 (extended CONNECT).
_REQUEST_PSEUDO = frozenset({b":method", b":scheme", b":authority", b":path", b":protocol"})
# RFC 9113 §8.3.2: the one response pseudo-header; in a request it is malformed (§8.1.1).
_RESPONSE_PSEUDO = frozenset({b":status"})


def _check_name(name: bytes) -> None:
    # RFC 9113 §8.2.1 / §8.2: field names are lower-case tokens; an empty name is malformed.
    if _LOWER_TOKEN.fullmatch(name) is not None:
        return
    if not name:
        raise MalformedRequest("empty field name")
    if name.lower() != name:
        raise MalformedRequest("upper-case character in a field name")
    raise MalformedRequest("invalid character in a field name")


def _check_authority(authority: bytes) -> None:
    # RFC 9113 §8.3.1 / RFC 9110 §4.2.4: no userinfo; RFC 9112 §3.2: an invalid Host is a 400.
    # RFC 9110 §4.2.1: an http(s) URI with an empty host is invalid and its recipient must
    # reject it ("", ":443"); a reg-name holds no ":", so a host part is empty exactly then.
    if not authority or authority[:1] == b":":
        raise MalformedRequest("empty host")
    if b"@" in authority:
        raise MalformedRequest("userinfo in authority")
    if _AUTHORITY.fullmatch(authority) is None:
        raise MalformedRequest("invalid authority")


def _check_content_length(value: bytes, seen: bytes | None) -> bytes:
    # RFC 9110 §8.6: Content-Length = 1*DIGIT; RFC 9113 §8.1.1 / RFC 9112 §6.3: differing
    # values make the message malformed (we also refuse the "5, 5" list form, and "05" next to
    # "5", which h11 would refuse upstream).
    if not value.isdigit():
        raise MalformedRequest("invalid content-length")
    if seen is not None and seen != value:
        raise MalformedRequest("conflicting content-length")
    return value


# --- intake --------------------------------------------------------------------------------


def request_from_h2(
    stream: int, headers: Headers, *, scheme_default: bytes, end_stream: bool = False
) -> RequestHead:
    """Validate an HTTP/2 request header block and build its RequestHead; ``end_stream``:
    its HEADERS frame ended the stream (the request has no body).

    The block is as hpack decoded it (h2 with validate_inbound_headers=False and
    normalize_inbound_headers=False). Everything RFC 9113 §8.1.1 calls malformed raises
    MalformedRequest. A plain CONNECT is returned as valid (target b""); the caller decides.
    """
    pseudo: dict[bytes, bytes] = {}
    hosts: list[bytes] = []
    content_length: bytes | None = None
    regular: Headers = []
    append = regular.append
    lower_token = _LOWER_TOKEN.fullmatch
    field_value = _FIELD_VALUE.fullmatch

    for field in headers:
        name, value = field
        if name[:1] == b":":
            # RFC 9113 §8.3: pseudo-headers come first, once each, from the defined set.
            if regular:
                raise MalformedRequest("pseudo-header after a regular field")
            if name not in _REQUEST_PSEUDO:
                if name in _RESPONSE_PSEUDO:
                    raise MalformedRequest("response pseudo-header in a request")
                raise MalformedRequest("unknown pseudo-header")
            if field_value(value) is None:
                raise MalformedRequest(f"invalid value for {name.decode()}")
            if name in pseudo:
                raise MalformedRequest(f"duplicated {name.decode()}")
            pseudo[name] = value
            continue

        # RFC 9113 §8.2.1: lower-case token names, clean values.
        if lower_token(name) is None:
            _check_name(name)
        if field_value(value) is None:
            raise MalformedRequest(f"invalid value for field {name.decode()}")
        if name in CONNECTION_SPECIFIC:
            # RFC 9113 §8.2.2: connection-specific fields make the message malformed.
            raise MalformedRequest(f"connection-specific field {name.decode()}")
        if name == b"te":
            # RFC 9113 §8.2.2: TE may be present with no value other than "trailers".
            if value.lower() != b"trailers":
                raise MalformedRequest("te other than trailers")
        elif name == b"host":
            hosts.append(value)
        elif name == b"content-length":
            content_length = _check_content_length(value, content_length)
        append(field)

    method = pseudo.get(b":method")
    scheme = pseudo.get(b":scheme")
    authority = pseudo.get(b":authority")
    path = pseudo.get(b":path")
    protocol = pseudo.get(b":protocol")
    if method is None:
        raise MalformedRequest("missing :method")
    # RFC 9110 §9.1: the method is a token (h11 would refuse anything else upstream).
    if _TOKEN.fullmatch(method) is None:
        raise MalformedRequest("invalid :method")

    pseudo_authority = authority is not None
    if authority is not None:
        # RFC 9113 §8.3.1: :authority wins over Host; the Host field stays in `headers`
        # untouched (it is rebuilt from `authority` on the way upstream). With no authority to
        # convey a client omits :authority, so an empty one is malformed.
        if not authority:
            raise MalformedRequest("empty :authority")
        _check_authority(authority)
        # RFC 9113 §8.3.1: a Host field next to :authority names the same origin, else the
        # request is malformed: a backend or log that reads Host would see another origin
        # than the one routed on (host names compare case-insensitively, RFC 9110 §4.2.3).
        if hosts and any(host.lower() != authority.lower() for host in hosts):
            raise MalformedRequest(":authority and host differ")
    elif hosts:
        # RFC 9113 §8.3.1: without :authority the Host field carries it (RFC 9112 §3.2: one).
        if len(hosts) > 1:
            raise MalformedRequest("more than one host field")
        authority = hosts[0]
        _check_authority(authority)

    if method == b"CONNECT" and protocol is None:
        # RFC 9113 §8.5: CONNECT has :authority (a Host field does not do) and neither :scheme
        # nor :path.
        if authority is None or not pseudo_authority:
            raise MalformedRequest("CONNECT without :authority")
        if scheme is not None or path is not None:
            raise MalformedRequest("CONNECT with :scheme or :path")
        return RequestHead(
            stream=stream,
            method=method,
            target=b"",
            authority=authority,
            scheme=scheme_default,
            headers=regular,
            http_version=b"2",
            end_stream=end_stream,
        )

    if protocol is not None and method != b"CONNECT":
        # RFC 8441 §4: :protocol only on an extended CONNECT.
        raise MalformedRequest(":protocol on a non-CONNECT request")
    # RFC 9113 §8.3.1 (and RFC 8441 §4 for extended CONNECT): :scheme and :path are required,
    # :path not empty.
    if scheme is None:
        raise MalformedRequest("missing :scheme")
    if path is None:
        raise MalformedRequest("missing :path")
    if not path:
        raise MalformedRequest("empty :path")
    if _SCHEME.fullmatch(scheme) is None:
        raise MalformedRequest("invalid :scheme")
    if scheme.lower() not in _HTTP_SCHEMES:
        # RFC 9113 §8.3.1: what follows holds for http and https; the proxy serves nothing
        # else (a "javascript:" or "file:" scheme reaching a backend or a log is a hazard).
        raise MalformedRequest("unsupported :scheme")
    # RFC 9113 §8.3.1: for http / https, :path is origin-form, or "*" for OPTIONS.
    if _ORIGIN_FORM.fullmatch(path) is None and not (path == b"*" and method == b"OPTIONS"):
        raise MalformedRequest("invalid :path")
    if b"#" in path:
        raise MalformedRequest(_FRAGMENT)
    return RequestHead(
        stream=stream,
        method=method,
        target=path,
        authority=b"" if authority is None else authority,
        scheme=scheme,
        headers=regular,
        http_version=b"2",
        end_stream=end_stream,
        protocol=protocol,
    )


def request_from_h1(
    stream: int,
    method: bytes,
    target: bytes,
    headers: Iterable[tuple[bytes, bytes]],
    *,
    scheme: bytes,
    http_version: bytes,
) -> RequestHead:
    """Build a RequestHead from an h11.Request's parts (h11 validated syntax, lower-cased names).

    Authority is the Host value (RFC 9112 §3.2), or the absolute-form target's authority, which
    wins over Host (RFC 9112 §3.2.2). A CONNECT's authority-form target becomes the authority,
    with target b"" as for HTTP/2. ``end_stream`` is set when the request has no body: no
    Transfer-Encoding and no Content-Length, or Content-Length 0 (RFC 9112 §6.3).
    """
    if http_version[:2] != b"1.":
        # RFC 9112 §2.3, RFC 9110 §15.6.6: we speak major version 1 on this connection; a
        # request line that names another ("HTTP/2.0": HTTP/2 has no request line at all,
        # RFC 9113 §3) gets 505. A higher minor version is served as 1.1 (§2.3).
        raise MalformedRequest("HTTP version not supported", 505)
    fields: Headers = list(headers)
    host: bytes | None = None
    host_count = 0
    content_length = transfer_encoding = False
    empty_body = True
    for name, value in fields:
        if name == b"host":
            host = value
            host_count += 1
        elif name == b"content-length":
            content_length = True
            empty_body = empty_body and value.strip() == b"0"
        elif name == b"transfer-encoding":
            transfer_encoding = True
            empty_body = False
    if transfer_encoding:
        # RFC 9112 §6.1: a message with both "ought to be handled as an error" by a server
        # (it is the classic request-smuggling shape; preferring Transfer-Encoding, as §6.3
        # would, leaves a front-end that preferred Content-Length out of step with us). An
        # HTTP/1.0 message with Transfer-Encoding has faulty framing (§6.1) as well.
        if content_length:
            raise MalformedRequest("both content-length and transfer-encoding", smuggling=True)
        if http_version == b"1.0":
            raise MalformedRequest("transfer-encoding in an HTTP/1.0 request", smuggling=True)
    # RFC 9112 §3.2: 400 for an HTTP/1.1 request without Host, with several, or an invalid one.
    if host_count > 1:
        raise MalformedRequest("more than one host field")
    if host is None and http_version != b"1.0":
        raise MalformedRequest("missing host field")

    authority = b"" if host is None else host
    if b"#" in target:
        raise MalformedRequest(_FRAGMENT)
    if target[:1] == b"/":
        # RFC 9112 §3.2.1 origin-form: the common case.
        pass
    elif method == b"CONNECT":
        # RFC 9112 §3.2.3 authority-form, only for CONNECT.
        if not target:
            raise MalformedRequest("invalid CONNECT target")
        _check_authority(target)
        authority = target
        target = b""
    elif target == b"*":
        # RFC 9112 §3.2.4 asterisk-form, only for OPTIONS.
        if method != b"OPTIONS":
            raise MalformedRequest("asterisk-form target on a non-OPTIONS request")
    else:
        # RFC 9112 §3.2.2 absolute-form: its authority wins over Host.
        match = _ABSOLUTE_FORM.fullmatch(target)
        if match is None or match[1].lower() not in (b"http", b"https"):
            raise MalformedRequest("invalid request target")
        authority = match[2]
        path = match[3]
        if not path:
            # RFC 9112 §3.2.4: an empty path is "/" (or "*" for OPTIONS).
            path = b"*" if method == b"OPTIONS" else b"/"
        elif path[:1] != b"/":  # only a query: RFC 3986 §6.2.3 gives it the path "/".
            path = b"/" + path
        target = path
        if not authority:
            # RFC 9110 §4.2.1: an http(s) URI has a non-empty host.
            raise MalformedRequest("empty authority in absolute-form target")
        _check_authority(authority)
        host = None  # the target's authority wins: the Host field is not looked at
    if host is not None:
        _check_authority(host)
    return RequestHead(
        stream=stream,
        method=method,
        target=target,
        authority=authority,
        scheme=scheme,
        headers=fields,
        http_version=http_version,
        end_stream=empty_body,
    )


def valid_h2_fields(fields: Headers) -> bool:
    """Whether every regular field of an HTTP/2 header block h2 handed us unvalidated (a
    backend's response head) is valid by RFC 9113 §8.2.1: a lower-case token name and a
    value without NUL, CR, LF, other control characters, or SP / HTAB at either end. One that
    is not makes the response malformed (§8.1.1): it must not be forwarded, and h11 would
    refuse to write it (CR LF in a value would be a header injection)."""
    lower_token = _LOWER_TOKEN.fullmatch
    field_value = _FIELD_VALUE.fullmatch
    return all(
        lower_token(name) is not None and field_value(value) is not None for name, value in fields
    )


def check_request_limits(head: RequestHead, *, max_fields: int, max_body: int) -> None:
    """Refuse a request head with more than ``max_fields`` fields (431, RFC 6585 §5), a
    Content-Length above ``max_body`` (413, RFC 9110 §15.5.14) or, on HTTP/2, no authority
    at all (400), before it is forwarded: the client gets a response, on its stream."""
    if head.http_version == b"2" and not head.authority:
        # RFC 9113 §8.3.1: an http(s) request carries :authority or Host. Without either it
        # is malformed, and §8.1.1 lets a server send a response before it closes the stream:
        # a 400 that says what is missing, as the same request over HTTP/1.1 gets (RFC 9112
        # §3.2), tells the client more than a bare RST_STREAM(PROTOCOL_ERROR). Either way it
        # never reaches a backend (which would see an empty Host).
        raise MalformedRequest("no :authority or host field")
    if len(head.headers) > max_fields:
        raise MalformedRequest(f"more than {max_fields} header fields", 431)
    length = header_value(head.headers, b"content-length")
    if length is not None and length.isdigit():
        # Compared by its digits first: int() refuses a string of thousands of them.
        digits = length.lstrip(b"0")
        if len(digits) > len(str(max_body)) or int(digits or b"0") > max_body:
            raise MalformedRequest(f"content-length above {max_body} bytes", 413)
