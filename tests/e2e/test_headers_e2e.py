"""End to end: header translation through a real proxy to a real fake backend.

The backend (``FakeLLM`` with ``x-fake-echo-headers: 1``) reports the request headers it
received, so these tests see exactly what the proxy forwarded: hop-by-hop fields removed
(RFC 9110 §7.6.1), Host from ``:authority`` (RFC 9113 §8.3.1), cookie crumbs joined
(RFC 9113 §8.2.3), X-Forwarded-For / X-Forwarded-Proto / Via added. On the way back, an SSE
response carries the anti-buffering fields and Via, and nothing connection-specific on HTTP/2
(RFC 9113 §8.2.2).
"""

from __future__ import annotations

import json

import h11
import trio
from h2client import H2Client
from peers import h1_read_response, h1_request_bytes, sse_events

CHAT = b"/v1/chat/completions"


def chat_body(*, stream: bool, tokens: int = 2) -> bytes:
    return json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": stream,
            "max_tokens": tokens,
        }
    ).encode()


# -- a minimal HTTP/1.1 client (h11) ---------------------------------------------------------


async def h1_request(
    port: int, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes = b""
) -> tuple[h11.Response, bytes]:
    """One request on a fresh connection; the response head and its whole body."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        conn, data = h1_request_bytes(target, method, body, headers)
        await stream.send_all(data)
        return await h1_read_response(stream, conn)


def h11_headers(response: h11.Response) -> dict[bytes, list[bytes]]:
    out: dict[bytes, list[bytes]] = {}
    for name, value in response.headers:
        out.setdefault(bytes(name), []).append(bytes(value))
    return out


# -- one request over HTTP/2 (the suite's client, tests/h2client.py) ------------------------


async def h2_request(
    port: int, headers: list[tuple[bytes, bytes]], body: bytes = b""
) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """One request on a fresh h2c connection; the response header block and body. The client
    is lenient: it checks no response field itself, the tests do."""
    client = await H2Client.connect(port, lenient=True)
    async with client.stream:
        state = await client.finish(await client.request(headers, body))
    assert state.ended and state.reset is None, f"stream reset: {state.reset!r}"
    assert client.goaway is None, f"unexpected GOAWAY: {client.goaway!r}"
    assert state.headers is not None
    return state.headers, state.body


def field_values(headers: list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [value for field, value in headers if field == name]


# -- requests as the backend saw them ---------------------------------------------------------

HOP_BY_HOP_REQUEST = [
    (b"host", b"api.example"),
    (b"connection", b"keep-alive, x-secret"),
    (b"x-secret", b"1"),
    (b"keep-alive", b"5"),
    (b"proxy-connection", b"keep-alive"),
    (b"te", b"gzip"),
    (b"x-fake-echo-headers", b"1"),
    (b"content-type", b"application/json"),
    (b"x-end-to-end", b"kept"),
]


async def test_h1_client_hop_by_hop_fields_are_not_forwarded(start_backend, start_proxy):
    _, backend = await start_backend(tokens=2, delay=0)
    proxy = await start_proxy([backend])
    with trio.fail_after(10):
        response, body = await h1_request(
            proxy.port, b"POST", CHAT, HOP_BY_HOP_REQUEST, chat_body(stream=False)
        )
    assert response.status_code == 200
    seen = json.loads(body)["request_headers"]
    for name in ("connection", "x-secret", "keep-alive", "proxy-connection", "te"):
        assert name not in seen, f"hop-by-hop field {name!r} reached the backend: {seen}"
    assert seen["host"] == "api.example"
    assert seen["x-end-to-end"] == "kept"
    assert seen["x-forwarded-for"] == "127.0.0.1"
    assert seen["x-forwarded-proto"] == "http"
    assert "1.1 muxproxy" in seen["via"]


async def test_h1_client_forwarded_fields_from_an_untrusted_peer_are_replaced(
    start_backend, start_proxy
):
    _, backend = await start_backend(tokens=2, delay=0)
    proxy = await start_proxy([backend])
    headers = [
        (b"host", b"api.example"),
        (b"x-forwarded-for", b"203.0.113.7"),
        (b"x-forwarded-proto", b"https"),  # a client's claim is replaced by what we saw
        (b"via", b"1.0 edge"),
        (b"x-fake-echo-headers", b"1"),
    ]
    with trio.fail_after(10):
        response, body = await h1_request(
            proxy.port, b"POST", CHAT, headers, chat_body(stream=False)
        )
    assert response.status_code == 200
    seen = json.loads(body)["request_headers"]
    assert seen["x-forwarded-for"] == "127.0.0.1"  # no trusted_proxies: the client's dropped
    assert seen["x-forwarded-proto"] == "http"
    assert seen["via"] == "1.0 edge, 1.1 muxproxy"


async def test_h1_client_sse_response_fields(start_backend, start_proxy):
    _, backend = await start_backend(tokens=3, delay=0)
    proxy = await start_proxy([backend])
    headers = [(b"host", b"api.example"), (b"x-fake-echo-headers", b"1")]
    with trio.fail_after(10):
        response, body = await h1_request(
            proxy.port, b"POST", CHAT, headers, chat_body(stream=True)
        )
    assert response.status_code == 200
    fields = h11_headers(response)
    assert fields[b"content-type"][0].startswith(b"text/event-stream")
    assert b"no-cache" in fields[b"cache-control"]
    assert fields[b"x-accel-buffering"] == [b"no"]
    assert b"muxproxy" in b", ".join(fields[b"via"])
    events = sse_events(body)
    assert events[-1] == "[DONE]"
    seen = events[0]["request_headers"]
    assert "1.1 muxproxy" in seen["via"]
    assert seen["x-forwarded-proto"] == "http"


async def test_h2_client_authority_cookies_and_forwarded_fields(start_backend, start_proxy):
    _, backend = await start_backend(tokens=3, delay=0)
    proxy = await start_proxy([backend])
    body = chat_body(stream=True)
    request = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":authority", b"llm.example:8443"),
        (b":path", CHAT),
        (b"cookie", b"a=1"),
        (b"cookie", b"b=2"),
        (b"x-forwarded-for", b"198.51.100.1"),
        (b"x-fake-echo-headers", b"1"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    with trio.fail_after(10):
        headers, data = await h2_request(proxy.port, request, body)

    # What the client got back.
    assert field_values(headers, b":status") == [b"200"]
    assert field_values(headers, b"content-type")[0].startswith(b"text/event-stream")
    assert b"no-cache" in field_values(headers, b"cache-control")
    assert field_values(headers, b"x-accel-buffering") == [b"no"]
    assert any(b"muxproxy" in value for value in field_values(headers, b"via"))
    for name in (b"transfer-encoding", b"connection", b"keep-alive", b"proxy-connection"):
        assert not field_values(headers, name), f"{name!r} in an HTTP/2 response"
    for name, _ in headers:
        assert name == name.lower()

    # What the backend got.
    events = sse_events(data)
    assert events[-1] == "[DONE]"
    seen = events[0]["request_headers"]
    assert seen["host"] == "llm.example:8443"
    assert seen["cookie"] == "a=1; b=2"
    assert seen["x-forwarded-for"] == "127.0.0.1"
    assert seen["x-forwarded-proto"] == "http"
    assert "2 muxproxy" in seen["via"]
    assert "1.1 muxproxy" not in seen["via"]


async def test_h2_client_get_without_cookies_or_xff(start_backend, start_proxy):
    fake, backend = await start_backend(tokens=1, delay=0)
    proxy = await start_proxy([backend])
    request = [
        (b":method", b"GET"),
        (b":scheme", b"http"),
        (b":authority", b"models.example"),
        (b":path", b"/v1/models"),
        (b"te", b"trailers"),
    ]
    with trio.fail_after(10):
        headers, data = await h2_request(proxy.port, request)
    assert field_values(headers, b":status") == [b"200"]
    assert json.loads(data)["object"] == "list"
    assert not field_values(headers, b"transfer-encoding")
    assert not field_values(headers, b"connection")
    assert any(b"muxproxy" in value for value in field_values(headers, b"via"))
    seen = fake.last_request_headers
    assert seen is not None
    assert seen["host"] == "models.example"
    assert "cookie" not in seen
    assert seen["x-forwarded-for"] == "127.0.0.1"
    assert seen["te"] == "trailers"  # the one TE value that travels (RFC 9113 §8.2.2)
    assert seen["via"] == "2 muxproxy"


async def test_h2_client_scheme_claim_does_not_set_x_forwarded_proto(start_backend, start_proxy):
    # A cleartext client claiming ":scheme: https": the backend still learns the truth
    # (X-Forwarded-Proto comes from the transport, as on HTTP/1.1). Schemes other than
    # http(s) are refused (tests/e2e/test_refused_inputs_e2e.py).
    fake, backend = await start_backend(tokens=1, delay=0)
    proxy = await start_proxy([backend])
    for claimed in (b"https", b"HTTPS"):
        request = [
            (b":method", b"GET"),
            (b":scheme", claimed),
            (b":authority", b"models.example"),
            (b":path", b"/v1/models"),
        ]
        with trio.fail_after(10):
            headers, _ = await h2_request(proxy.port, request)
        assert field_values(headers, b":status") == [b"200"]
        seen = fake.last_request_headers
        assert seen is not None
        assert seen["x-forwarded-proto"] == "http", claimed


async def test_http2_settings_never_reaches_the_backend(start_backend, start_proxy):
    # RFC 9113 §3.2.1: HTTP2-Settings is hop-by-hop; without an Upgrade it is still dropped,
    # on both client protocols.
    fake, backend = await start_backend(tokens=1, delay=0)
    proxy = await start_proxy([backend])
    with trio.fail_after(10):
        response, _ = await h1_request(
            proxy.port,
            b"GET",
            b"/v1/models",
            [(b"host", b"api.example"), (b"http2-settings", b"AAMAAABkAAQAAP__")],
        )
        assert response.status_code == 200
        seen = fake.last_request_headers
        assert seen is not None and "http2-settings" not in seen, seen
        request = [
            (b":method", b"GET"),
            (b":scheme", b"http"),
            (b":authority", b"models.example"),
            (b":path", b"/v1/models"),
            (b"http2-settings", b"AAMAAABkAAQAAP__"),
        ]
        headers, _ = await h2_request(proxy.port, request)
    assert field_values(headers, b":status") == [b"200"]
    seen = fake.last_request_headers
    assert seen is not None and "http2-settings" not in seen, seen
