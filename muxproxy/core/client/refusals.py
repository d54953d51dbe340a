"""The proxy's own refusals on a client connection: what it answers instead of forwarding.

Obeys:

- RFC 9110 §15.5.14 (413) and RFC 6585 §5 (431): a request past ``limits`` is answered here
  and never forwarded; a body that grows past ``max_request_body`` once a response began
  cannot be answered any more: its stream is reset (HTTP/2), its connection closed (HTTP/1.1).
- RFC 9110 §15.5.9 (408): a request body that stops coming for ``client_header``, or is not
  complete within ``client_body``, is the client's fault, not the backend's: 408 and close on
  HTTP/1.1; on HTTP/2 RST_STREAM(CANCEL) for the first, a 408 for the second.
- RFC 9112 §9.6 and §11.2: an HTTP/1.1 peer error (a 400, a refused smuggling shape) is
  answered with ``Connection: close`` and the connection closes, since a framing it read
  differently leaves no next request to trust; the exchange whose body it broke is aborted.
- RFC 9113 §8.1: on HTTP/2 a refusal is one stream's response; the rest of a request body it
  would send is not wanted (``cancel_request``), and the connection goes on.

The bodies are ``errors.error_response`` (plain text, or the OpenAI error object for the route's
``api``); every refusal is logged (``request_refused``, ``client_protocol_error``) or counted as
a defence (``defencelog.py``). These are functions over ``Refusing``, the few things of a
client connection they need (``Downstream`` has them), so they hold no state of their own.
"""

from __future__ import annotations

from typing import Protocol

import h2.errors

from muxproxy.config import Api, Config
from muxproxy.core.commands import Log
from muxproxy.core.effects import Effects
from muxproxy.core.http.bodyclock import SlowBody
from muxproxy.core.http.errors import ErrorShape, error_response
from muxproxy.core.http.intake import MalformedRequest
from muxproxy.core.http.paths import normalise_target
from muxproxy.core.http1.h1 import H1Server, PeerError
from muxproxy.core.http2.h2 import H2Server
from muxproxy.core.messages import (
    AnswerRewrite,
    Fields,
    Headers,
    Refused,
    RequestHead,
    ResponseHead,
)
from muxproxy.core.ports import ClientHost, ClientStream, Phase


class Refusing(Protocol):
    """What a refusal needs of its client connection."""

    fx: Effects
    host: ClientHost
    conn: int
    peer_ip: str
    h1: H1Server | None
    h2: H2Server | None
    exchanges: dict[int, ClientStream]

    def send_raw(self, data: bytes) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    def request_close(self) -> None: ...


def send_error(
    client: Refusing,
    stream: int,
    status: int,
    text: str,
    *,
    api: ErrorShape | None = None,
    head_only: bool = False,
    request_id: bytes | None = None,
    extra: Fields = (),
    rewrite: AnswerRewrite | None = None,
) -> int:
    """``Answerer.send_error``: the proxy's own short response on ``stream``; returns the
    body bytes sent, for the access log. ``extra``: fields it carries besides its own
    (``Retry-After`` and the ``x-ratelimit-*`` fields of a 429); ``rewrite``: what its fields
    become (the extensions' ``on_response_head``)."""
    h2s = client.h2
    if h2s is not None:
        headers, body = own_answer(client, status, text, api, request_id, extra, rewrite)
        # RFC 9110 §9.3.2, RFC 9113 §8.1: a response to HEAD is one HEADERS frame that ends
        # the stream, no DATA frame.
        h2s.send_head(
            ResponseHead(stream=stream, status=status, headers=headers), end_stream=head_only
        )
        if not head_only:
            h2s.send_body(stream, body)
            h2s.send_end(stream, [])
        client.flush()
        return 0 if head_only else len(body)
    if client.h1 is not None:
        return h1_error(client, status, text, api, request_id, extra, rewrite)
    return 0


def h1_error(
    client: Refusing,
    status: int,
    text: str,
    api: ErrorShape | None = None,
    request_id: bytes | None = None,
    extra: Fields = (),
    rewrite: AnswerRewrite | None = None,
) -> int:
    """The proxy's own response on HTTP/1.1, with ``Connection: close`` (nothing if a
    response began already); returns the body bytes it carried."""
    h1 = client.h1
    assert h1 is not None
    headers, body = own_answer(client, status, text, api, request_id, extra, rewrite)
    out = h1.send_whole(status, headers, body)
    client.send_raw(out)
    return len(body) if out and not h1.head_only else 0


def own_answer(
    client: Refusing,
    status: int,
    text: str,
    api: ErrorShape | None,
    request_id: bytes | None,
    extra: Fields,
    rewrite: AnswerRewrite | None,
) -> tuple[Headers, bytes]:
    """The head fields and body of one of the proxy's own answers, either protocol: the
    error body, ``Date``, the request id, ``extra``, then the extensions' ``rewrite``."""
    headers, body = error_response(status, text, api=api, date=client.fx.http_date())
    if request_id is not None:
        headers.append((b"x-request-id", request_id))
    headers.extend(extra)
    if rewrite is not None:
        headers = rewrite(status, headers)
    return headers, body


def peer_error(client: Refusing, exc: PeerError, api: Api | None = None) -> None:
    """HTTP/1.1: the client broke the protocol (a smuggling shape is a defence): the error
    response, the exchange it concerns aborted, and the close."""
    h1 = client.h1
    assert h1 is not None
    if exc.smuggling:
        client.host.defences.record(
            "smuggling_refused", client.peer_ip, conn=client.conn, error=exc.reason
        )
    else:
        fields = {"conn": client.conn, "error": exc.reason}
        client.fx.emit(Log(event="client_protocol_error", fields=fields))
    exchange = client.exchanges.get(h1.stream)
    if exchange is not None:
        exchange.client_aborted(f"malformed request body: {exc.reason}")
    h1_error(client, exc.status, exc.reason, api)
    client.close()


def head_timeout(client: Refusing) -> None:
    """HTTP/1.1: a request head begun and not complete within ``client_header``: 408 (RFC
    9110 §15.5.9); the caller closes."""
    client.host.defences.record("request_header_timeout", client.peer_ip, conn=client.conn)
    h1_error(client, 408, "request header timeout")


def refuse_head(client: Refusing, head: RequestHead, exc: MalformedRequest) -> None:
    """A request past a limit (431, 413): answered here, never forwarded."""
    api = api_of(client.fx.config, head)
    if client.h1 is not None:
        peer_error(client, PeerError(exc.reason, exc.status), api)
        return
    _refuse_stream(
        client,
        head.stream,
        exc.status,
        exc.reason,
        api,
        end_stream=head.end_stream,
        head_only=head.method == b"HEAD",
    )


def refuse_undecoded(client: Refusing, refused: Refused) -> None:
    """HTTP/2: a head the adapter refused undecoded (a header list over the limit): no route,
    so a plain-text answer."""
    _refuse_stream(
        client, refused.stream, refused.status, refused.reason, None, end_stream=refused.end_stream
    )


def _refuse_stream(
    client: Refusing,
    stream: int,
    status: int,
    reason: str,
    api: Api | None,
    *,
    end_stream: bool,
    head_only: bool = False,
) -> None:
    client.fx.emit(Log(event="request_refused", fields={"conn": client.conn, "error": reason}))
    send_error(client, stream, status, reason, api=api, head_only=head_only)
    if not end_stream:
        h2s = client.h2
        assert h2s is not None
        # RFC 9113 §8.1: the response is complete; the body it would send is not wanted.
        h2s.cancel_request(stream)
        client.flush()


def api_of(config: Config, head: RequestHead) -> Api | None:
    """The ``api`` of the route ``head`` would take, for a refusal before its exchange."""
    try:
        target = normalise_target(head.target)
    except MalformedRequest:
        return None
    route = config.route_for(target)
    return None if route is None else route.api


def body_too_large(client: Refusing, exchange: ClientStream, flow_len: int) -> None:
    """The request body grew past ``limits.max_request_body``: 413 while no response began,
    otherwise the stream is reset (HTTP/2) or the connection closed (HTTP/1.1)."""
    fx = client.fx
    reason = f"request body above {fx.config.limits.max_request_body} bytes"
    fx.emit(Log(event="request_refused", fields={"conn": client.conn, "error": reason}))
    api = exchange.route.api if exchange.route is not None else None
    if client.h1 is not None:
        # The 413 first (h11 sends nothing once a response began): the abort below
        # closes the connection, which flushes it (RFC 9112 §9.6).
        h1_error(client, 413, reason, api)
        exchange.client_aborted(reason)
        client.close()
        return
    h2s = client.h2
    assert h2s is not None
    h2s.acknowledge(exchange.stream, flow_len)
    answered = exchange.phase in (Phase.STREAMING, Phase.DONE)
    stream = exchange.stream
    exchange.client_aborted(reason)
    if answered:
        h2s.abort(stream, h2.errors.ErrorCodes.CANCEL)
    else:
        send_error(client, stream, 413, reason, api=api)
        h2s.cancel_request(stream)
    client.flush()


def slow_body(
    client: Refusing, stream: int, slow: SlowBody, *, api: Api | None, request_id: bytes
) -> int | None:
    """``ExchangeClient.refuse_slow_body``: the request body is too ``slow`` while no response
    began (``bodyclock.py``), counted as the defence ``slow.value``. 408 and close on HTTP/1.1
    (the close after the current event, which flushes the 408 first, RFC 9112 §9.6). On
    HTTP/2 a body past its deadline gets a 408 and RST_STREAM(NO_ERROR) for the rest of it
    (RFC 9113 §8.1), one that stopped coming RST_STREAM(CANCEL). Returns the 408's body
    bytes (None for a reset, which sends no response)."""
    client.host.defences.record(slow.value, client.peer_ip, conn=client.conn, stream=stream)
    text = "request body timeout"
    if client.h1 is not None:
        sent = h1_error(client, 408, text, api, request_id)
        client.request_close()
        return sent
    h2s = client.h2
    assert h2s is not None
    if slow is SlowBody.TOO_SLOW:
        sent = send_error(client, stream, 408, text, api=api, request_id=request_id)
        h2s.cancel_request(stream)
        client.flush()
        return sent
    h2s.abort(stream, h2.errors.ErrorCodes.CANCEL)
    client.flush()
    return None
