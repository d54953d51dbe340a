"""The heads an exchange writes: the backend's request head, the client's response heads.

What it obeys:

- The request head for the backend (``backend_fields``) is the client's as
  ``headers.upstream_h1_headers`` makes it (hop-by-hop fields dropped, RFC 9110 §7.6.1;
  the forwarded fields, ``forwarded.py``; Via, §7.6.3), then the group's ``set_headers``
  applied in order (``routing.sticky.apply_header_rules``, like nginx's
  ``proxy_set_header``).
- A relayed response head (``client_head``) carries the backend's fields as
  ``headers.response_headers`` makes them (hop-by-hop fields dropped; Via appended; the
  proxy's Date where the backend sent none, RFC 9110 §6.6.1), the exchange's
  ``X-Request-ID`` (``access.py``) and, on a group with a sticky cookie, the Set-Cookie that
  pins the client to the server that answered (``Failover.pin``). A backend's Trailers-Only
  response (``ResponseHead.end_stream``) stays one for an HTTP/2 client; for an HTTP/1.1
  client its gRPC status fields leave the head for the trailers (``grpc.py``).
- An error of our own (``send_error_answer``), only while no response head went out: a gRPC
  client (``grpc.is_grpc``) gets a gRPC answer, HTTP 200 with a Trailers-Only response whose
  ``grpc-status`` maps the HTTP status (grpc/doc/http-grpc-status-mapping.md), with Date and
  X-Request-ID; any other client the short response of ``errors.py`` through its connection
  (plain text, or the OpenAI error object on an ``api = "openai"`` route), without a body
  for HEAD (RFC 9110 §9.3.2).

Functions only: the exchange decides when; this module knows nothing of its phases.
"""

from __future__ import annotations

from muxproxy.config import Upstream
from muxproxy.core.http import grpc
from muxproxy.core.http.errors import ErrorShape
from muxproxy.core.http.headers import response_headers, upstream_h1_headers
from muxproxy.core.messages import AnswerRewrite, Fields, Headers, RequestHead, ResponseHead
from muxproxy.core.observe.access import REQUEST_ID, with_request_id
from muxproxy.core.ports import Answerer, ClientPeer
from muxproxy.routing.sticky import apply_header_rules

VIA = b"muxproxy"
"""Our pseudonym in Via (RFC 9110 §7.6.3), both ways."""


def backend_fields(
    head: RequestHead,
    client: ClientPeer,
    group: Upstream,
    *,
    session_key: bytes | None,
    has_body: bool,
) -> Headers:
    """The fields of ``head`` (from ``client``) for a server of ``group``; ``has_body``: the
    request has a body (without a Content-Length, the HTTP/1.1 side frames it chunked)."""
    fields = upstream_h1_headers(
        head,
        client_ip=client.peer_ip,
        proto=client.scheme,
        via=VIA,
        has_body=has_body,
        trusted=client.trusted,
    )
    if not group.set_headers:
        return fields
    return apply_header_rules(
        fields,
        group.set_headers,
        session_key=session_key,
        remote_addr=client.peer_ip,
        headers=head.headers,
        target=head.target,
    )


def client_head(
    head: ResponseHead,
    *,
    stream: int,
    upstream_version: bytes,
    to_h2: bool,
    date: bytes | None,
    request_id: bytes,
    pin: tuple[bytes, bytes] | None,
) -> ResponseHead:
    """The client's head for the backend's ``head`` (HTTP/``upstream_version``); ``pin``: a
    Set-Cookie field to add."""
    headers = response_headers(
        head.status,
        head.headers,
        via=VIA,
        upstream_version=upstream_version,
        to_h2=to_h2,
        date=date,
    )
    headers = with_request_id(headers, request_id)
    if pin is not None:
        headers.append(pin)
    end_stream = head.end_stream and to_h2
    if head.end_stream and not to_h2:
        # A Trailers-Only response for HTTP/1.1: the status fields follow as trailers (its
        # ``End`` repeats them), as a head cannot end an HTTP/1.1 response with them.
        headers = [f for f in headers if f[0] not in grpc.STATUS_FIELDS]
    return ResponseHead(
        stream=stream,
        status=head.status,
        headers=headers,
        reason=head.reason,
        end_stream=end_stream,
    )


def send_error_answer(
    client: Answerer,
    request: RequestHead,
    status: int,
    text: str,
    *,
    api: ErrorShape | None,
    request_id: bytes,
    date: bytes | None,
    extra: Fields = (),
    rewrite: AnswerRewrite | None = None,
) -> tuple[int, int]:
    """Answer ``request`` with ``status`` and ``text``; returns the status the client gets and
    the body bytes sent (as the access log counts them). ``extra``: more response fields;
    ``rewrite``: what the answer's fields become (the extensions')."""
    if grpc.is_grpc(request.headers):
        fields = grpc.trailers_only(grpc.status_for_http(status), text)
        if date is not None:
            fields.append((b"date", date))
        fields.append((REQUEST_ID, request_id))
        if rewrite is not None:
            fields = rewrite(200, fields)
        head = ResponseHead(stream=request.stream, status=200, headers=fields)
        client.send_head(head, end_stream=True)
        return 200, 0
    sent = client.send_error(
        request.stream,
        status,
        text,
        api=api,
        head_only=request.method == b"HEAD",
        request_id=request_id,
        extra=extra,
        rewrite=rewrite,
    )
    return status, sent
