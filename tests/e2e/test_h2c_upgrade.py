"""End to end: ``curl --http2 http://...`` upgrades to h2c (RFC 7540 §3.2) through the proxy.

curl offers ``Upgrade: h2c`` on plain http. A request without a body switches the connection
to HTTP/2 (``%{http_version}`` is 2); one with a body is served over HTTP/1.1, as curl expects
when the server ignores the offer.
"""

from __future__ import annotations

import json

import h11
import trio

from muxproxy.testing.fakellm import MODEL, reply_text

TOKENS = 5


async def curl(*args: str) -> tuple[str, str, str]:
    """(body, %{http_version}, stderr) of one curl run with ``--http2``."""
    result = await trio.run_process(
        [
            "curl",
            "--http2",
            "--silent",
            "--show-error",
            "--no-buffer",
            "--max-time",
            "10",
            "--verbose",
            "--write-out",
            "\n%{http_version}",
            *args,
        ],
        capture_stdout=True,
        capture_stderr=True,
    )
    body, _, version = result.stdout.decode().rpartition("\n")
    return body, version, result.stderr.decode()


def sse_content(body: str) -> tuple[str, bool]:
    text = ""
    done = False
    for line in body.splitlines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            done = True
            continue
        for choice in json.loads(payload)["choices"]:
            text += choice["delta"].get("content") or ""
    return text, done


async def test_curl_http2_upgrades_a_get_to_h2c(start_backend, start_proxy):
    fake, backend = await start_backend()
    proxy = await start_proxy([backend])
    with trio.fail_after(20):
        body, version, log = await curl(proxy.url + "/v1/models")
    assert "101 Switching Protocols" in log
    assert version == "2"
    assert json.loads(body)["data"][0]["id"] == MODEL
    headers = fake.last_request_headers
    assert "upgrade" not in headers and "http2-settings" not in headers


SSE_EVENTS = [f'data: {{"token": {i}}}\n\n'.encode() for i in range(TOKENS)] + [b"data: [DONE]\n\n"]


async def serve_sse_on_get(stream: trio.SocketStream) -> None:
    """A minimal SSE backend: every GET gets SSE_EVENTS, one chunk (and one write) each."""
    conn = h11.Connection(h11.SERVER)
    async with stream:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return
                conn.receive_data(data)
                continue
            if type(event) is h11.EndOfMessage:
                head = h11.Response(
                    status_code=200, headers=[("content-type", "text/event-stream")]
                )
                await stream.send_all(conn.send(head) or b"")
                for chunk in SSE_EVENTS:
                    await stream.send_all(conn.send(h11.Data(data=chunk)) or b"")
                    await trio.sleep(0.005)
                await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
                conn.start_next_cycle()
            elif type(event) is h11.ConnectionClosed or event is h11.PAUSED:
                return


async def test_curl_http2_streams_sse_over_the_upgraded_connection(nursery, start_proxy):
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    nursery.start_soon(trio.serve_listeners, serve_sse_on_get, listeners)
    proxy = await start_proxy([port])
    with trio.fail_after(20):
        body, version, log = await curl(proxy.url + "/v1/events")
    assert "101 Switching Protocols" in log
    assert version == "2"
    assert body.encode() == b"".join(SSE_EVENTS)


async def test_curl_http2_post_with_a_body_stays_on_http1(start_backend, start_proxy):
    fake, backend = await start_backend(delay=0.005)
    proxy = await start_proxy([backend])
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count"}],
        "stream": True,
        "max_tokens": TOKENS,
    }
    with trio.fail_after(20):
        body, version, log = await curl(
            "--header",
            "content-type: application/json",
            "--data-binary",
            json.dumps(request),
            proxy.url + "/v1/chat/completions",
        )
    assert "Upgrade: h2c" in log  # curl offered it
    assert "101 Switching Protocols" not in log  # (a bare "101" may be in a port number)
    assert version == "1.1"
    assert sse_content(body) == (reply_text(TOKENS), True)
    headers = fake.last_request_headers
    assert "upgrade" not in headers and "http2-settings" not in headers
