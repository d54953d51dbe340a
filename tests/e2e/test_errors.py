"""End to end: what clients see when something goes wrong.

Errors before a response head map to short text/plain responses (RFC 9110 §15.6.3 502 for a
refused or broken backend, §15.6.5 504 for a timeout, 404 for no route); a malformed HTTP/1.1
request is a 400 and the connection closes (RFC 9112 §9.6); a malformed HTTP/2 request is a
stream error, RST_STREAM(PROTOCOL_ERROR), that leaves the other streams alone (RFC 9113
§8.1.1); a frame-level violation is a connection error, GOAWAY(PROTOCOL_ERROR) (RFC 9113
§5.4.1).
"""

from __future__ import annotations

import email.utils
import json
import struct
import time
from typing import Any

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h11
import hpack
import openai
import pytest
import trio
from h2client import H2Client, h2_request_headers
from peers import (
    H2Stream,
    closed_port,
    h1_read_response,
    h1_request_bytes,
    hanging_port,
    never_answer,
    read_until_eof,
    serve_raw,
)

from muxproxy.config import Api, Config, Limits, Listener, Route, Server, Timeouts, Upstream
from muxproxy.core.commands import CloseConnection, Log, OpenConnection, SendData, SetTimer
from muxproxy.core.events import ConnectionAccepted, DataReceived, Wakeup
from muxproxy.core.http2.h2 import PREFACE
from muxproxy.core.proxy import ProxyCore

CHAT = b"/v1/chat/completions"
CHAT_BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
).encode()


# -- helpers --------------------------------------------------------------------------------


async def close_at_once(stream: trio.SocketStream) -> None:
    """A backend that accepts, reads the request head and hangs up without a response."""
    async with stream:
        await stream.receive_some(65536)


@attrs.define
class H1Result:
    status: int
    headers: dict[bytes, bytes]
    body: bytes
    closed: bool
    """The proxy closed the connection after the response."""


async def h1_request(
    port: int,
    target: bytes = b"/v1/models",
    method: bytes = b"GET",
    body: bytes = b"",
) -> H1Result:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        conn, data = h1_request_bytes(target, method, body)
        await stream.send_all(data)
        response, response_body = await h1_read_response(stream, conn)
        # After the response, is the connection closed by the proxy?
        closed = await stream.receive_some(1) == b""
        return H1Result(
            status=response.status_code,
            headers={bytes(k): bytes(v) for k, v in response.headers},
            body=response_body,
            closed=closed,
        )


async def start_chat(client: H2Client) -> int:
    """A streaming chat request (with its content-length) on a new stream of ``client``."""
    return await client.request(
        h2_request_headers(CHAT, b"POST", [(b"content-length", str(len(CHAT_BODY)).encode())]),
        CHAT_BODY,
    )


async def h2_get(port: int, path: bytes = b"/v1/models") -> H2Stream:
    client = await H2Client.connect(port, lenient=True)
    try:
        sid = await client.request(h2_request_headers(path))
        return await client.finish(sid)
    finally:
        await client.aclose()


def assert_short_plain(body: bytes, content_type: bytes | None) -> None:
    assert content_type is not None and content_type.startswith(b"text/plain")
    assert 0 < len(body) < 200


# -- upstream errors before the head ----------------------------------------------------------


async def test_refused_backend_is_502_over_h1(start_proxy):
    proxy = await start_proxy([await closed_port()])
    with trio.fail_after(10):
        result = await h1_request(proxy.port)
    assert result.status == 502
    assert_short_plain(result.body, result.headers.get(b"content-type"))
    assert int(result.headers[b"content-length"]) == len(result.body)


async def test_refused_backend_is_502_over_h2(start_proxy):
    proxy = await start_proxy([await closed_port()])
    with trio.fail_after(10):
        stream = await h2_get(proxy.port)
    assert stream.status == 502
    assert stream.ended and stream.reset is None
    assert_short_plain(stream.body, stream.field(b"content-type"))


async def test_backend_hanging_up_before_the_head_is_502(start_proxy, nursery):
    port = await serve_raw(nursery, close_at_once)
    proxy = await start_proxy([port])
    with trio.fail_after(10):
        result = await h1_request(proxy.port)
        stream = await h2_get(proxy.port)
    assert result.status == 502
    assert_short_plain(result.body, result.headers.get(b"content-type"))
    assert stream.status == 502
    assert_short_plain(stream.body, stream.field(b"content-type"))


async def test_response_head_timeout_is_504(start_proxy, nursery):
    port = await serve_raw(nursery, never_answer)
    proxy = await start_proxy([port], timeouts=Timeouts(response_head=0.3))
    with trio.fail_after(10):
        result = await h1_request(proxy.port, CHAT, b"POST", CHAT_BODY)
        stream = await h2_get(proxy.port)
    assert result.status == 504
    assert_short_plain(result.body, result.headers.get(b"content-type"))
    assert stream.status == 504
    assert_short_plain(stream.body, stream.field(b"content-type"))


def test_connect_timeout_is_504_at_the_core_level():
    """A connect that never completes: the core's connect timer answers 504.

    No local socket trick makes a TCP connect hang reliably, so the core is driven directly:
    the driver would have delivered the ``Wakeup`` at the ``SetTimer`` deadline.
    """
    config = Config(
        listeners=(Listener(address="127.0.0.1:0"),),
        upstreams={"default": Upstream(name="default", servers=(Server(address="10.0.0.1:80"),))},
        routes=(Route(prefix="/", upstream="default"),),
        timeouts=Timeouts(connect=2.0),
    )
    core = ProxyCore(config)
    core.handle(ConnectionAccepted(now=0.0, conn=1, listener="127.0.0.1:0", peer=("127.0.0.1", 1)))
    client = h11.Connection(h11.CLIENT)
    request = client.send(h11.Request(method="GET", target="/v1/models", headers=[("host", "a")]))
    request += client.send(h11.EndOfMessage())
    commands = core.handle(DataReceived(now=0.5, conn=1, data=request))

    opens = [c for c in commands if isinstance(c, OpenConnection)]
    assert len(opens) == 1 and (opens[0].origin.host, opens[0].origin.port) == ("10.0.0.1", 80)
    timers = [c for c in commands if isinstance(c, SetTimer) and c.timer[0] == "connect"]
    assert len(timers) == 1 and timers[0].at == pytest.approx(2.5)

    commands = core.handle(Wakeup(now=timers[0].at, timer=timers[0].timer))
    sent = b"".join(c.data for c in commands if isinstance(c, SendData) and c.conn == 1)
    client.receive_data(sent)
    response = client.next_event()
    assert isinstance(response, h11.Response) and response.status_code == 504
    body = client.next_event()
    assert isinstance(body, h11.Data) and 0 < len(body.data) < 200
    assert isinstance(client.next_event(), h11.EndOfMessage)
    closed = {c.conn for c in commands if isinstance(c, CloseConnection)}
    assert opens[0].conn in closed, "the abandoned connect must be cancelled"
    assert core.statistics().streams == []


async def test_connect_timeout_is_504_end_to_end(start_proxy):
    """The same through the Trio driver, with a connect that really hangs (a backend whose
    accept queue is full drops our SYN)."""
    with hanging_port() as port:
        proxy = await start_proxy([port], timeouts=Timeouts(connect=0.3))
        driver = proxy.server.driver
        with trio.fail_after(10):
            result = await h1_request(proxy.port)
            assert result.status == 504
            assert_short_plain(result.body, result.headers.get(b"content-type"))
            # The driver gave up on the connect attempt: no backend socket is left.
            assert not [ident for ident in driver.conns if ident < 0]
            stream = await h2_get(proxy.port)
        assert stream.status == 504
        assert_short_plain(stream.body, stream.field(b"content-type"))
        assert not [ident for ident in driver.conns if ident < 0]


# -- routing --------------------------------------------------------------------------------


async def test_no_route_is_404(start_backend, start_proxy):
    fake, backend = await start_backend()
    config = Config(
        listeners=(Listener(address="127.0.0.1:0"),),
        upstreams={"llm": Upstream(name="llm", servers=(Server(address=f"127.0.0.1:{backend}"),))},
        routes=(Route(prefix="/only-here/", upstream="llm"),),
    )
    proxy = await start_proxy(config=config)
    with trio.fail_after(10):
        result = await h1_request(proxy.port, b"/v1/models")
        stream = await h2_get(proxy.port, b"/v1/models")
    assert result.status == 404
    assert_short_plain(result.body, result.headers.get(b"content-type"))
    assert stream.status == 404
    assert_short_plain(stream.body, stream.field(b"content-type"))
    assert fake.requests == 0


# -- malformed HTTP/1.1 ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(b"GET / HTTP/1.1\r\nHost: a\r\nBad Header\r\n\r\n", id="field-without-colon"),
        pytest.param(b"GET / HTTP/1.1\r\n\r\n", id="no-host"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", id="two-hosts"),
        pytest.param(b"NOT HTTP AT ALL\r\n\r\n", id="garbage"),
    ],
)
async def test_malformed_h1_request_is_400_and_closes(start_backend, start_proxy, request_bytes):
    fake, backend = await start_backend()
    proxy = await start_proxy([backend])
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        async with stream:
            await stream.send_all(request_bytes)
            received = await read_until_eof(stream)  # until the proxy closes
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("host", "a")]))
    client.send(h11.EndOfMessage())
    client.receive_data(received)
    client.receive_data(b"")
    response = client.next_event()
    assert isinstance(response, h11.Response) and response.status_code == 400
    assert dict(response.headers)[b"content-type"].startswith(b"text/plain")
    assert fake.requests == 0


# -- malformed HTTP/2 ------------------------------------------------------------------------


MALFORMED_H2 = {
    "upper-case-name": h2_request_headers(extra=[(b"X-Upper", b"1")]),
    "connection-field": h2_request_headers(extra=[(b"connection", b"keep-alive")]),
    "missing-path": [
        (b":method", b"GET"),
        (b":scheme", b"http"),
        (b":authority", b"proxy.test"),
    ],
    "te-gzip": h2_request_headers(extra=[(b"te", b"gzip")]),
    "pseudo-after-regular": [
        (b":method", b"GET"),
        (b":scheme", b"http"),
        (b"x-a", b"1"),
        (b":path", b"/v1/models"),
    ],
}


@pytest.mark.parametrize("kind", sorted(MALFORMED_H2))
async def test_malformed_h2_request_resets_only_its_stream(start_backend, start_proxy, kind):
    fake, backend = await start_backend(tokens=4, delay=0.02)
    proxy = await start_proxy([backend])
    with trio.fail_after(10):
        client = await H2Client.connect(proxy.port, lenient=True)
        try:
            good = await start_chat(client)
            # The good stream is under way before the bad one arrives.
            await client.wait(lambda: client.streams[good].headers is not None)
            bad = await client.request(MALFORMED_H2[kind])
            bad_state = await client.finish(bad)
            good_state = await client.finish(good)
        finally:
            await client.aclose()
    assert bad_state.reset == h2.errors.ErrorCodes.PROTOCOL_ERROR
    assert bad_state.headers is None
    assert good_state.status == 200 and good_state.ended and good_state.reset is None
    assert good_state.body.endswith(b"data: [DONE]\n\n")
    assert client.goaway is None
    assert fake.requests == 1


def raw_frame(frame_type: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    """An HTTP/2 frame as bytes (RFC 9113 §4.1), bypassing h2's state machine."""
    header = struct.pack(">I", len(payload))[1:] + bytes([frame_type, flags])
    return header + struct.pack(">I", stream_id & 0x7FFFFFFF) + payload


FRAME_VIOLATIONS = {
    "data-on-stream-0": raw_frame(0x0, 0x1, 0, b"x"),
    "headers-on-even-stream": raw_frame(
        0x1,
        0x5,  # END_STREAM | END_HEADERS
        2,
        hpack.Encoder().encode(h2_request_headers()),
    ),
    "window-update-of-zero": raw_frame(0x8, 0x0, 0, struct.pack(">I", 0)),
}


@pytest.mark.parametrize("kind", sorted(FRAME_VIOLATIONS))
async def test_frame_level_violation_is_goaway_protocol_error(start_backend, start_proxy, kind):
    _, backend = await start_backend()
    proxy = await start_proxy([backend])
    with trio.fail_after(10):
        client = await H2Client.connect(proxy.port, lenient=True)
        try:
            await client.stream.send_all(FRAME_VIOLATIONS[kind])
            await client.until_eof()
        finally:
            await client.aclose()
    assert client.goaway is not None
    assert client.goaway.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR


@pytest.mark.parametrize("kind", sorted(FRAME_VIOLATIONS))
async def test_frame_level_violation_with_open_streams_is_goaway(start_backend, start_proxy, kind):
    """The GOAWAY must go out even when the connection error aborts running exchanges."""
    fake, backend = await start_backend(tokens=50, delay=0.05)
    proxy = await start_proxy([backend])
    with trio.fail_after(10):
        client = await H2Client.connect(proxy.port, lenient=True)
        try:
            sid = await start_chat(client)
            await client.wait(lambda: b"tok0" in client.streams[sid].body)
            await client.stream.send_all(FRAME_VIOLATIONS[kind])
            await client.until_eof()
        finally:
            await client.aclose()
        await fake.wait_disconnect()  # the running generation was stopped
    assert client.goaway is not None
    assert client.goaway.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR
    assert not client.streams[sid].ended


async def test_garbage_after_the_h2_preface_is_goaway(start_backend, start_proxy):
    _, backend = await start_backend()
    proxy = await start_proxy([backend])
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        async with stream:
            await stream.send_all(PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x01")  # bad id
            received = await read_until_eof(stream)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    events = client.receive_data(received)
    goaways = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert goaways and goaways[0].error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR


# RFC 9113 §8.1.1: "A request or response is also malformed if the value of a content-length
# header field does not equal the sum of the DATA frame payload lengths", and malformed
# requests are stream errors, not connection errors. RFC 9110 §8.6: Content-Length = 1*DIGIT.
CONTENT_LENGTH_MISMATCH = {
    "body-shorter": ([(b"content-length", b"10")], b"12345"),
    "body-longer": ([(b"content-length", b"3")], b"12345"),
    "not-a-number": ([(b"content-length", b"abc")], b"12345"),
    "plus-sign": ([(b"content-length", b"+5")], b"12345"),
}


@pytest.mark.parametrize("kind", sorted(CONTENT_LENGTH_MISMATCH))
async def test_h2_content_length_mismatch_resets_only_its_stream(start_backend, start_proxy, kind):
    # The healthy stream is an SSE stream still running when the bad request arrives.
    _, backend = await start_backend(tokens=40, delay=0.01)
    proxy = await start_proxy([backend])
    fields, body = CONTENT_LENGTH_MISMATCH[kind]
    with trio.fail_after(10):
        client = await H2Client.connect(proxy.port, lenient=True)
        try:
            good = await start_chat(client)
            await client.wait(lambda: b"tok0" in client.streams[good].body)
            bad = await client.request(
                h2_request_headers(b"/v1/chat/completions", b"POST", fields), body
            )
            await client.wait(
                lambda: (
                    client.streams[bad].reset is not None
                    or client.streams[bad].ended
                    or client.goaway is not None
                )
            )
            bad_state = client.streams[bad]
            assert client.goaway is None, "a stream error became a connection error"
            assert not client.streams[good].ended, "the SSE stream was not running any more"
            good_state = await client.finish(good)
        finally:
            await client.aclose()
    assert bad_state.reset == h2.errors.ErrorCodes.PROTOCOL_ERROR
    assert good_state.status == 200 and good_state.ended and good_state.reset is None
    assert all(f"tok{i}".encode() in good_state.body for i in range(40))
    assert good_state.body.endswith(b"data: [DONE]\n\n")


# -- the proxy's own responses: Date, access-log bytes, the OpenAI error shape ----------------


def capture_logs(proxy) -> list[Log]:
    records: list[Log] = []
    proxy.server.driver.on_log = records.append
    return records


def route_config(port: int, **route: Any) -> Config:
    return Config(
        listeners=(Listener(address="127.0.0.1:0"),),
        upstreams={"llm": Upstream(name="llm", servers=(Server(address=f"127.0.0.1:{port}"),))},
        routes=(Route(prefix="/v1/", upstream="llm", **route),),
    )


def assert_http_date(value: bytes | None) -> None:
    # RFC 9110 §5.6.7 IMF-fixdate, close to now.
    assert value is not None
    when = email.utils.parsedate_to_datetime(value.decode())
    assert value.endswith(b" GMT")
    assert abs(when.timestamp() - time.time()) < 60


async def answer_without_date(stream: trio.SocketStream) -> None:
    """A backend that answers every request 200 with no Date field (h11 adds none)."""
    conn = h11.Connection(h11.SERVER)
    async with stream:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return
                conn.receive_data(data)
            elif type(event) is h11.EndOfMessage:
                head = h11.Response(status_code=200, headers=[("content-length", "2")])
                out = conn.send(head) + conn.send(h11.Data(data=b"{}"))
                await stream.send_all(out + conn.send(h11.EndOfMessage()))
                conn.start_next_cycle()
            elif type(event) is not h11.Request:
                return


async def test_responses_without_date_get_one(start_proxy, nursery):
    # RFC 9110 §6.6.1: a recipient with a clock adds the Date a forwarded response lacks.
    port = await serve_raw(nursery, answer_without_date)
    proxy = await start_proxy([port])
    with trio.fail_after(10):
        client = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        async with client:
            conn, data = h1_request_bytes(b"/v1/models")
            await client.send_all(data)
            response, _ = await h1_read_response(client, conn)
        stream = await h2_get(proxy.port)
    assert response.status_code == 200
    assert_http_date(dict(response.headers).get(b"date"))
    assert stream.status == 200
    assert_http_date(stream.field(b"date"))


async def own_responses(proxy) -> tuple[H1Result, H1Result, H2Stream]:
    """A 404 (no route) and a 502 (refused backend) over HTTP/1.1, a 502 over HTTP/2."""
    with trio.fail_after(10):
        missing = await h1_request(proxy.port, b"/elsewhere")
        refused = await h1_request(proxy.port, b"/v1/models")
        refused_h2 = await h2_get(proxy.port, b"/v1/models")
    assert missing.status == 404 and refused.status == 502 and refused_h2.status == 502
    return missing, refused, refused_h2


async def test_own_responses_have_a_date(start_proxy):
    proxy = await start_proxy(config=route_config(await closed_port()))
    missing, refused, refused_h2 = await own_responses(proxy)
    assert_http_date(missing.headers.get(b"date"))
    assert_http_date(refused.headers.get(b"date"))
    assert_http_date(refused_h2.field(b"date"))


async def test_access_log_counts_the_bytes_of_own_responses(start_proxy):
    proxy = await start_proxy(config=route_config(await closed_port()))
    records = capture_logs(proxy)
    missing, refused, refused_h2 = await own_responses(proxy)
    logged = [r.fields["bytes_out"] for r in records if r.event == "access"]
    assert logged == [len(missing.body), len(refused.body), len(refused_h2.body)]
    assert all(logged)


def openai_client(port: int) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=10
    )


def chat(port: int) -> None:
    with openai_client(port) as client:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


async def test_openai_sdk_shows_the_reason_of_a_502(start_proxy):
    proxy = await start_proxy(config=route_config(await closed_port(), api=Api.OPENAI))
    with trio.fail_after(20), pytest.raises(openai.InternalServerError) as info:
        await trio.to_thread.run_sync(chat, proxy.port, abandon_on_cancel=True)
    error = info.value
    assert error.status_code == 502
    # The SDK's exception text carries the proxy's reason (with a plain body: the code only).
    assert str(error) == "Error code: 502 - upstream unavailable"
    assert error.body == {
        "message": "upstream unavailable",
        "type": "server_error",
        "param": None,
        "code": "no_server",
    }
    assert error.type == "server_error" and error.code == "no_server"
    assert error.response.headers["content-type"] == "application/json"
    assert error.response.headers["x-muxproxy-reason"] == "no_server"


async def test_openai_sdk_shows_the_reason_of_a_504(start_proxy, nursery):
    port = await serve_raw(nursery, never_answer)
    config = attrs.evolve(route_config(port, api=Api.OPENAI), timeouts=Timeouts(response_head=0.3))
    proxy = await start_proxy(config=config)
    with trio.fail_after(20), pytest.raises(openai.InternalServerError) as info:
        await trio.to_thread.run_sync(chat, proxy.port, abandon_on_cancel=True)
    assert info.value.status_code == 504
    assert info.value.body == {
        "message": "upstream timed out",
        "type": "server_error",
        "param": None,
        "code": "gateway_timeout",
    }


async def test_openai_sdk_shows_the_reason_of_a_413(start_backend, start_proxy):
    fake, backend = await start_backend()
    config = attrs.evolve(route_config(backend, api=Api.OPENAI), limits=Limits(max_request_body=16))
    proxy = await start_proxy(config=config)
    with trio.fail_after(20), pytest.raises(openai.APIStatusError) as info:
        await trio.to_thread.run_sync(chat, proxy.port, abandon_on_cancel=True)
    assert info.value.status_code == 413
    assert info.value.body == {
        "message": "content-length above 16 bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }
    assert fake.requests == 0


async def test_openai_errors_over_h2_and_plain_text_elsewhere(start_proxy):
    port = await closed_port()
    config = attrs.evolve(
        route_config(port, api=Api.OPENAI),
        routes=(
            Route(prefix="/v1/", upstream="llm", api=Api.OPENAI),
            Route(prefix="/plain/", upstream="llm"),
        ),
    )
    proxy = await start_proxy(config=config)
    with trio.fail_after(10):
        shaped = await h2_get(proxy.port, b"/v1/models")
        plain = await h2_get(proxy.port, b"/plain/models")
        unrouted = await h1_request(proxy.port, b"/nowhere")
    assert shaped.status == 502 and shaped.field(b"content-type") == b"application/json"
    assert json.loads(shaped.body)["error"]["message"] == "upstream unavailable"
    assert int(shaped.field(b"content-length") or 0) == len(shaped.body)
    assert plain.status == 502
    assert_short_plain(plain.body, plain.field(b"content-type"))
    # No route: not bound to any route's API, so plain text.
    assert unrouted.status == 404
    assert_short_plain(unrouted.body, unrouted.headers.get(b"content-type"))


async def test_h2_sse_stream_completes_after_the_clients_goaway(start_backend, start_proxy):
    """RFC 9113 §6.8: a client's GOAWAY(NO_ERROR) only says it opens no more streams."""
    _, backend = await start_backend(tokens=40, delay=0.01)
    proxy = await start_proxy([backend])
    with trio.fail_after(10):
        client = await H2Client.connect(proxy.port, lenient=True)
        try:
            sid = await start_chat(client)
            await client.wait(lambda: b"tok0" in client.streams[sid].body)
            client.conn.close_connection()
            # h2 would refuse to send the WINDOW_UPDATEs that keep the stream going.
            client.conn.state_machine.state = h2.connection.ConnectionState.CLIENT_OPEN
            await client.flush()
            state = await client.finish(sid)
            await client.until_eof()  # then the proxy closes: nothing is left to serve
        finally:
            await client.aclose()
    assert client.goaway is None
    assert state.status == 200 and state.ended and state.reset is None
    assert state.body.endswith(b"data: [DONE]\n\n")


async def test_invalid_h2_preface_on_the_plain_port_is_goaway(start_backend, start_proxy):
    _, backend = await start_backend()
    proxy = await start_proxy([backend])
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        async with stream:
            await stream.send_all(PREFACE[:16] + b"\r\nXX\r\n\r\n")
            received = await read_until_eof(stream)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    events = client.receive_data(received)
    goaways = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert [g.error_code for g in goaways] == [h2.errors.ErrorCodes.PROTOCOL_ERROR]
