"""Tests of the fake LLM backend (muxproxy.testing.fakellm), over real sockets on 127.0.0.1.

HTTP/1.1 goes through httpx or a raw h11 client, h2c (prior knowledge) through a raw
h2 client; the openai SDK runs in a worker thread. Every IO test runs under fail_after.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import h11
import httpx
import openai
import pytest
import trio
import trio.testing
from h2client import H2Client, h2_request_headers

from muxproxy.testing import fakellm
from muxproxy.testing.fakellm import FakeLLM, reply_text, serve_fakellm

Start = Callable[..., Awaitable[tuple[FakeLLM, int]]]
CHAT = "/v1/chat/completions"
CHAT_POST = h2_request_headers(CHAT.encode(), b"POST")


@pytest.fixture
async def start(nursery: trio.Nursery) -> Start:
    """Start a FakeLLM server (constructor kwargs) in the test's nursery: (fake, port)."""

    async def _start(**kwargs: Any) -> tuple[FakeLLM, int]:
        fake = FakeLLM(**kwargs)
        port = await nursery.start(serve_fakellm, fake)
        return fake, port

    return _start


def chat_body(stream: bool, **extra: Any) -> bytes:
    body = {"model": "m1", "messages": [{"role": "user", "content": "say hi"}], "stream": stream}
    return json.dumps({**body, **extra}).encode()


def parse_sse(raw: bytes) -> list[Any]:
    """SSE ``data:`` events: JSON objects, or the string ``"[DONE]"``."""
    events: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def contents(events: Sequence[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content", "")
        for e in events
        if isinstance(e, dict) and e["choices"]
    )


# ---- raw HTTP/1.1 ------------------------------------------------------------------------


@attrs.define
class H11Result:
    response: h11.Response
    body: bytes
    complete: bool
    raw: bytes


async def h11_exchange(
    port: int,
    target: str,
    headers: Sequence[tuple[str, str]] = (),
    body: bytes = b"",
    method: str = "POST",
) -> H11Result:
    """One request on a fresh connection; reads until the message ends or the peer closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        all_headers = [("host", "fake"), ("content-length", str(len(body))), *headers]
        await stream.send_all(
            conn.send(h11.Request(method=method, target=target, headers=all_headers))
        )
        await stream.send_all(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        raw = bytearray()
        response: h11.Response | None = None
        chunks = bytearray()
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                assert response is not None
                return H11Result(response, bytes(chunks), False, bytes(raw))
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                raw += data
                conn.receive_data(data)
            elif isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                chunks += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert response is not None
                return H11Result(response, bytes(chunks), True, bytes(raw))


def header(response: h11.Response, name: str) -> str | None:
    for n, v in response.headers:
        if n.decode() == name:
            return str(v.decode())
    return None


# ---- raw h2c (prior knowledge) ---------------------------------------------------------


@pytest.fixture
async def h2_factory() -> AsyncIterator[Callable[[int], Awaitable[H2Client]]]:
    clients: list[H2Client] = []

    async def connect(port: int) -> H2Client:
        client = await H2Client.connect(port)
        clients.append(client)
        return client

    yield connect
    for client in clients:
        await client.aclose()


# ---- the ASGI app directly -------------------------------------------------------------


async def call_app(
    fake: FakeLLM, method: str, path: str, headers: Sequence[tuple[bytes, bytes]], body: bytes
) -> list[dict[str, Any]]:
    """Run the ASGI app in-process; returns the messages it sent."""
    sent: list[dict[str, Any]] = []
    incoming = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": list(headers)}
    await fake.app(scope, receive, send)
    return sent


async def test_asgi_one_body_message_per_sse_event() -> None:
    fake = FakeLLM(backend_id="b1", tokens=3, delay=0)
    with trio.fail_after(5):
        sent = await call_app(fake, "POST", CHAT, [], chat_body(True))
    assert sent[0]["type"] == "http.response.start"
    assert (b"x-backend-id", b"b1") in sent[0]["headers"]
    bodies = [m["body"] for m in sent[1:]]
    assert all(m["more_body"] for m in sent[1:-1]) and not sent[-1]["more_body"]
    # 3 token events, the finish chunk, [DONE]: five messages, one SSE event each.
    assert len(bodies) == 5
    assert all(
        b.startswith(b"data: ") and b.endswith(b"\n\n") and b.count(b"\n\n") == 1 for b in bodies
    )
    assert bodies[-1] == b"data: [DONE]\n\n"


async def test_asgi_lifespan() -> None:
    sent: list[dict[str, Any]] = []
    messages = [{"type": "lifespan.shutdown"}, {"type": "lifespan.startup"}]

    async def receive() -> dict[str, Any]:
        return messages.pop()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with trio.fail_after(5):
        await FakeLLM().app({"type": "lifespan"}, receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


# ---- OpenAI format over HTTP/1.1 -------------------------------------------------------


async def test_streaming_completion_http11(start: Start) -> None:
    fake, port = await start(backend_id="gpu0", tokens=4, delay=0.001)
    with trio.fail_after(5):
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
            client.stream("POST", CHAT, content=chat_body(True)) as response,
        ):
            raw = b"".join([chunk async for chunk in response.aiter_bytes()])
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-backend-id"] == "gpu0"
    events = parse_sse(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 5
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["model"] == "m1"
        assert chunk["id"] == chunks[0]["id"]
        assert isinstance(chunk["created"], int)
        assert chunk["choices"][0]["index"] == 0
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "tok0 "}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["stop"]
    assert contents(chunks) == reply_text(4) == "tok0 tok1 tok2 tok3 "
    assert (fake.requests, fake.streams_started, fake.streams_completed) == (1, 1, 1)
    assert (fake.disconnects, fake.aborts) == (0, 0)


async def test_model_version_names_the_version_on_every_response(start: Start) -> None:
    _, port = await start(backend_id="gpu0", tokens=2, delay=0.001, model_version="v2")
    _, plain = await start(backend_id="gpu1", tokens=2, delay=0.001)
    with trio.fail_after(5):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            async with client.stream("POST", CHAT, content=chat_body(True)) as streamed:
                await streamed.aread()
            health = await client.get("/health")
            missing = await client.get("/nowhere")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{plain}") as client:
            unversioned = await client.get("/health")
    for response in (streamed, health, missing):
        assert response.headers["x-model-version"] == "v2"
    assert "x-model-version" not in unversioned.headers


async def test_non_streaming_completion_http11(start: Start) -> None:
    fake, port = await start(backend_id="gpu1", tokens=3, delay=0.001)
    with trio.fail_after(5):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            response = await client.post(CHAT, content=chat_body(False))
    assert response.status_code == 200
    assert response.headers["x-backend-id"] == "gpu1"
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "tok0 tok1 tok2 "}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert fake.streams_started == 0


async def test_stream_options_include_usage(start: Start) -> None:
    _, port = await start(tokens=2, delay=0)
    body = chat_body(True, stream_options={"include_usage": True})
    with trio.fail_after(5):
        result = await h11_exchange(port, CHAT, body=body)
    events = parse_sse(result.body)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 2


async def test_openai_sdk_consumes_both(start: Start) -> None:
    _, port = await start(tokens=3, delay=0.001)

    def use_sdk() -> tuple[list[str], str | None, int | None]:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=5)
        messages: Any = [{"role": "user", "content": "hello"}]
        stream = client.chat.completions.create(model="fake-llm", messages=messages, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        whole = client.chat.completions.create(model="fake-llm", messages=messages)
        usage = whole.usage.completion_tokens if whole.usage else None
        models = [m.id for m in client.models.list()]
        assert models == ["fake-llm"]
        client.close()
        return pieces, whole.choices[0].message.content, usage

    with trio.fail_after(20):
        pieces, text, usage = await trio.to_thread.run_sync(use_sdk)
    assert pieces == ["tok0 ", "tok1 ", "tok2 ", ""]
    assert text == reply_text(3)
    assert usage == 3


async def test_models_health_and_errors(start: Start) -> None:
    _, port = await start(backend_id="g")
    with trio.fail_after(5):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            models = await client.get("/v1/models")
            health = await client.get("/health")
            missing = await client.get("/nope")
            wrong = await client.get(CHAT)
            wrong_health = await client.post("/health", content=b"x")
    assert models.json() == {
        "object": "list",
        "data": [{"id": "fake-llm", "object": "model", "created": 0, "owned_by": "muxproxy"}],
    }
    assert (health.status_code, health.text) == (200, "ok")
    assert missing.status_code == 404
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong_health.status_code == 405
    for response in (models, health, missing, wrong, wrong_health):
        assert response.headers["x-backend-id"] == "g"


# ---- knobs -----------------------------------------------------------------------------


async def test_token_count_header_max_tokens_and_default(start: Start) -> None:
    _, port = await start(tokens=5, delay=0)

    async def n_tokens(client: httpx.AsyncClient, headers: dict[str, str], **extra: Any) -> int:
        response = await client.post(CHAT, content=chat_body(False, **extra), headers=headers)
        return int(response.json()["usage"]["completion_tokens"])

    with trio.fail_after(5):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert await n_tokens(client, {}) == 5
            assert await n_tokens(client, {"x-fake-tokens": "2"}) == 2
            assert await n_tokens(client, {}, max_tokens=4) == 4
            assert await n_tokens(client, {}, max_completion_tokens=3) == 3
            assert await n_tokens(client, {"x-fake-tokens": "1"}, max_tokens=4) == 1
            assert await n_tokens(client, {"x-fake-tokens": "0"}) == 0


async def test_zero_tokens_stream(start: Start) -> None:
    _, port = await start(tokens=0, delay=0)
    with trio.fail_after(5):
        result = await h11_exchange(port, CHAT, body=chat_body(True))
    events = parse_sse(result.body)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[0]["choices"][0]["finish_reason"] == "stop"


async def test_role_chunk_starts_the_stream_with_a_role_only_delta(start: Start) -> None:
    fake, port = await start(tokens=2, delay=0, role_chunk=True)
    with trio.fail_after(5):
        result = await h11_exchange(port, CHAT, body=chat_body(True))
        # The header turns it off again for one request.
        plain = await h11_exchange(
            port, CHAT, body=chat_body(True), headers=[("x-fake-role-chunk", "0")]
        )
    chunks = parse_sse(result.body)[:-1]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": "tok0 "},
        {"content": "tok1 "},
        {},
    ]
    assert contents(chunks) == reply_text(2)
    assert parse_sse(plain.body)[0]["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "tok0 ",
    }
    assert fake.streams_completed == 2


async def test_delays(start: Start) -> None:
    # Default delays too slow to finish under fail_after: the headers must override them.
    _, port = await start(tokens=3, delay=10, first_delay=10)
    knobs = [("x-fake-first-delay", "0.1"), ("x-fake-delay", "0.03")]
    with trio.fail_after(5):
        t0 = trio.current_time()
        whole = await h11_exchange(port, CHAT, knobs, chat_body(False))
        elapsed = trio.current_time() - t0
        streamed = await h11_exchange(
            port, CHAT, [("x-fake-first-delay", "0"), ("x-fake-delay", "0")], chat_body(True)
        )
    assert whole.complete and streamed.complete
    assert elapsed >= 0.1 + 2 * 0.03  # first token after 0.1 s, then two gaps of 0.03 s
    assert contents(parse_sse(streamed.body)) == reply_text(3)


async def test_status_header_and_default(start: Start) -> None:
    fake, port = await start(backend_id="s")
    with trio.fail_after(5):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            r503 = await client.post(
                CHAT, content=chat_body(True), headers={"x-fake-status": "503"}
            )
            fake.status = 500
            health = await client.get("/health")
            ok = await client.get("/health", headers={"x-fake-status": "200"})
    assert r503.status_code == 503
    assert r503.headers["x-backend-id"] == "s"
    assert r503.headers["content-type"] == "application/json"
    assert r503.json()["error"]["code"] == 503
    assert health.status_code == 500
    assert ok.status_code == 200
    assert fake.streams_started == 0


async def test_malformed_knob_and_body_answer_400(start: Start) -> None:
    _, port = await start()
    with trio.fail_after(5):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            bad_knob = await client.post(
                CHAT, content=chat_body(True), headers={"x-fake-tokens": "x"}
            )
            bad_delay = await client.post(
                CHAT, content=chat_body(True), headers={"x-fake-delay": "-1"}
            )
            bad_json = await client.post(CHAT, content=b"{not json")
    for response in (bad_knob, bad_delay, bad_json):
        assert response.status_code == 400
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert "x-fake-tokens" in bad_knob.json()["error"]["message"]


async def test_echo_headers(start: Start) -> None:
    fake, port = await start(tokens=2, delay=0)
    headers = [("x-fake-echo-headers", "1"), ("x-dup", "a"), ("X-Dup", "b"), ("X-Mixed", "V")]
    with trio.fail_after(5):
        whole = await h11_exchange(port, CHAT, headers, chat_body(False))
        streamed = await h11_exchange(port, CHAT, headers, chat_body(True))
    echoed = json.loads(whole.body)["request_headers"]
    assert echoed["x-dup"] == "a, b"
    assert echoed["x-mixed"] == "V"
    assert echoed["host"] == "fake"
    events = parse_sse(streamed.body)
    assert events[0]["request_headers"] == {**echoed, "content-length": str(len(chat_body(True)))}
    assert all("request_headers" not in e for e in events[1:-1])
    assert fake.last_request_headers == events[0]["request_headers"]
    # Without the header nothing is echoed.
    plain = await h11_exchange(port, CHAT, body=chat_body(False))
    assert "request_headers" not in json.loads(plain.body)


async def test_sink_http11(start: Start) -> None:
    _, port = await start(backend_id="up")
    payload = bytes(range(256)) * 4096  # 1 MiB

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(payload), 65536):
            yield payload[i : i + 65536]

    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            response = await client.post("/upload", content=chunks(), headers={"x-fake-sink": "1"})
    assert response.status_code == 200
    assert response.headers["x-backend-id"] == "up"
    assert response.json() == {
        "received_bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }


# ---- HTTP/2 (h2c prior knowledge) ------------------------------------------------------


async def test_h2c_and_http11_on_one_port(start: Start, h2_factory: Any) -> None:
    fake, port = await start(backend_id="h2", tokens=3, delay=0.001)
    with trio.fail_after(5):
        h1 = await h11_exchange(port, CHAT, body=chat_body(True))
        client: H2Client = await h2_factory(port)
        stream = await client.exchange(CHAT, body=chat_body(True))
        sink = await client.exchange(CHAT, headers=[("x-fake-sink", "1")], body=b"z" * 40000)
    assert contents(parse_sse(h1.body)) == contents(parse_sse(stream.body)) == reply_text(3)
    assert stream.ended
    assert stream.header(":status") == "200"
    assert stream.header("x-backend-id") == "h2"
    assert stream.header("content-type") == "text/event-stream"
    assert json.loads(sink.body)["received_bytes"] == 40000
    assert fake.streams_completed == 2


async def test_h2_many_concurrent_streams_one_connection(start: Start, h2_factory: Any) -> None:
    fake, port = await start(tokens=3, delay=0.01)
    n = 150
    with trio.fail_after(15):
        client: H2Client = await h2_factory(port)
        await client.wait(lambda: client.settings_received)
        assert client.conn.remote_settings.max_concurrent_streams >= 1000
        sids = [await client.request(CHAT_POST, chat_body(True)) for _ in range(n)]
        # The client has not read a byte yet, so its h2 state holds all n streams open at
        # once: opening them at all needs the server's SETTINGS_MAX_CONCURRENT_STREAMS >= n.
        await fake.wait_until(lambda: fake.streams_started == n)
        await client.wait(lambda: all(client.streams[s].done for s in sids))
    for sid in sids:
        assert client.streams[sid].ended
        assert contents(parse_sse(client.streams[sid].body)) == reply_text(3)
    assert fake.streams_completed == n


# ---- die-after -------------------------------------------------------------------------


async def test_die_after_http11_closes_without_last_chunk(start: Start) -> None:
    fake, port = await start(tokens=5, delay=0.001)
    with trio.fail_after(5):
        result = await h11_exchange(port, CHAT, [("x-fake-die-after", "2")], chat_body(True))
    assert result.response.status_code == 200
    assert not result.complete  # the peer closed mid-body: h11 reports incomplete chunked read
    assert not result.raw.endswith(b"0\r\n\r\n")
    events = parse_sse(result.body)
    assert contents(events) == "tok0 tok1 "
    assert len(events) == 2
    assert (fake.aborts, fake.streams_completed, fake.disconnects) == (1, 0, 0)


async def test_die_after_boundaries(start: Start) -> None:
    _, port = await start(tokens=3, delay=0, die_after=3)  # constructor default
    with trio.fail_after(5):
        at_end = await h11_exchange(port, CHAT, body=chat_body(True))
        beyond = await h11_exchange(port, CHAT, [("x-fake-die-after", "4")], chat_body(True))
        disabled = await h11_exchange(port, CHAT, [("x-fake-die-after", "none")], chat_body(True))
        at_zero = await h11_exchange(port, CHAT, [("x-fake-die-after", "0")], chat_body(True))
    # die-after == tokens: every token, then the abort instead of the finish chunk.
    assert not at_end.complete and contents(parse_sse(at_end.body)) == reply_text(3)
    assert b"[DONE]" not in at_end.body
    assert beyond.complete and parse_sse(beyond.body)[-1] == "[DONE]"
    assert disabled.complete
    assert not at_zero.complete and at_zero.body == b""
    assert at_zero.response.status_code == 200


async def test_die_after_non_streaming_truncates_body(start: Start) -> None:
    fake, port = await start(tokens=4, delay=0)
    with trio.fail_after(5):
        result = await h11_exchange(port, CHAT, [("x-fake-die-after", "1")], chat_body(False))
    assert result.response.status_code == 200
    assert not result.complete
    length = int(header(result.response, "content-length") or 0)
    assert 0 < len(result.body) < length
    assert fake.aborts == 1


async def test_die_after_h2_resets_stream(start: Start, h2_factory: Any) -> None:
    fake, port = await start(tokens=5, delay=0.001)
    with trio.fail_after(5):
        client: H2Client = await h2_factory(port)
        died = await client.exchange(
            CHAT, headers=[("x-fake-die-after", "2")], body=chat_body(True)
        )
        # The connection survives: only the stream was reset.
        after = await client.exchange(CHAT, body=chat_body(True))
    assert died.reset == h2.errors.ErrorCodes.INTERNAL_ERROR
    assert not died.ended
    assert died.header(":status") == "200"
    assert contents(parse_sse(died.body)) == "tok0 tok1 "
    assert after.ended and contents(parse_sse(after.body)) == reply_text(5)
    assert (fake.aborts, fake.streams_completed) == (1, 1)


# ---- disconnect detection --------------------------------------------------------------


async def test_http11_client_close_is_seen_at_once(start: Start) -> None:
    # 30 s between tokens: only http.disconnect (not a failing write) can explain detection.
    fake, port = await start(tokens=5, delay=30)
    with trio.fail_after(5):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        conn = h11.Connection(h11.CLIENT)
        body = chat_body(True)
        request = h11.Request(
            method="POST",
            target=CHAT,
            headers=[("host", "fake"), ("content-length", str(len(body)))],
        )
        await stream.send_all(
            conn.send(request) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
        )
        received = b""
        while b"\n\n" not in received:  # the first token event
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Data):
                received += event.data
        await stream.aclose()
    with trio.fail_after(1):
        await fake.wait_disconnect()
    assert (fake.disconnects, fake.streams_started, fake.streams_completed) == (1, 1, 0)


async def test_h2_client_reset_is_seen_at_once(start: Start, h2_factory: Any) -> None:
    fake, port = await start(tokens=5, delay=30)
    with trio.fail_after(5):
        client: H2Client = await h2_factory(port)
        sid = await client.request(CHAT_POST, chat_body(True))
        await client.wait(lambda: b"\n\n" in client.streams[sid].body)
        client.conn.reset_stream(sid, error_code=h2.errors.ErrorCodes.CANCEL)
        await client.flush()
    with trio.fail_after(1):
        await fake.wait_disconnect()
    with trio.fail_after(5):
        health = await client.exchange("/health", method="GET")
    assert health.body == b"ok"
    assert (fake.disconnects, fake.streams_completed) == (1, 0)


async def test_non_streaming_client_close_counts_as_disconnect(start: Start) -> None:
    fake, port = await start(tokens=5, first_delay=30)
    with trio.fail_after(5):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        body = chat_body(False)
        head = f"POST {CHAT} HTTP/1.1\r\nhost: fake\r\ncontent-length: {len(body)}\r\n\r\n"
        await stream.send_all(head.encode() + body)
        await fake.wait_until(lambda: fake.requests == 1)
        await stream.aclose()
    with trio.fail_after(1):
        await fake.wait_disconnect()
    assert fake.streams_started == 0


async def test_wait_disconnect_counts() -> None:
    fake = FakeLLM()
    fake.disconnects = 2
    with trio.fail_after(1):
        await fake.wait_disconnect(2)  # already satisfied: returns at once
    async with trio.open_nursery() as nursery:
        done = trio.Event()

        async def waiter() -> None:
            await fake.wait_disconnect(3)
            done.set()

        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()
        fake.disconnects = 3
        fake._notify()
        with trio.fail_after(1):
            await done.wait()


# ---- serving and the command line ------------------------------------------------------


async def test_serve_reports_real_port(nursery: trio.Nursery) -> None:
    fake = FakeLLM()
    with trio.fail_after(5):
        port = await nursery.start(serve_fakellm, fake)
        assert isinstance(port, int) and port > 0
        result = await h11_exchange(port, "/health", method="GET")
    assert result.body == b"ok"


def test_add_arguments() -> None:
    parser = argparse.ArgumentParser()
    fakellm.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.host, args.port, args.backend_id, args.tokens) == ("127.0.0.1", 0, "fake", 16)
    assert (args.delay, args.first_delay, args.die_after, args.status) == (0.02, 0.0, None, 200)
    argv = "--port 9 --id gpu0 --tokens 3 --delay 0.5 --first-delay 1 --die-after 2 --status 503"
    args = parser.parse_args(argv.split(" "))
    assert (args.port, args.backend_id, args.tokens, args.delay) == (9, "gpu0", 3, 0.5)
    assert (args.first_delay, args.die_after, args.status) == (1.0, 2, 503)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tokens", "-1"])


async def ready_line(nursery: trio.Nursery, *options: str) -> tuple[trio.Process, bytes]:
    """Start ``muxproxy fakellm OPTIONS`` as a process; it and its first stdout line."""
    command = [sys.executable, "-m", "muxproxy.testing.fakellm", *options]
    process: trio.Process = await nursery.start(
        lambda task_status: trio.run_process(
            command, stdout=subprocess.PIPE, check=False, task_status=task_status
        )
    )
    with trio.fail_after(30):
        assert process.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            data = await process.stdout.receive_some(1024)
            assert data, "fakellm exited before printing its ready line"
            line += data
    return process, line


async def test_cli_prints_ready_line_and_serves() -> None:
    async with trio.open_nursery() as nursery:
        process, line = await ready_line(nursery, "--id", "gpu7", "--tokens", "2")
        try:
            match = re.fullmatch(r"fakellm gpu7 listening on 127\.0\.0\.1:(\d+)\n", line.decode())
            assert match, line
            with trio.fail_after(5):
                result = await h11_exchange(int(match[1]), CHAT, body=chat_body(False))
            assert header(result.response, "x-backend-id") == "gpu7"
            assert json.loads(result.body)["usage"]["completion_tokens"] == 2
        finally:
            process.terminate()
