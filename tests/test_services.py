"""The real services of ``tests/services.py`` do what later tests will lean on.

Redis: coredis (Trio-native through anyio; a client is used inside ``async with``, which runs
its connection pool) appends to a stream and reads it back; a killed server makes the next
command fail with a connection error, and the restarted one answers again, empty.

Chromium: a page served by a Hypercorn app opens an ``EventSource``, reads three server-sent
events with their ids, and the test reads them back from the page; the app sees one request
for the stream (the page closes it after the third event, before any reconnection).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, cast

import attrs
import coredis
import coredis.exceptions
import pytest
import trio
from hypercorn.trio import serve as hypercorn_serve
from services import BrowserPage, RedisServer, lifespan

from muxproxy.testing.fakellm import hypercorn_config

if TYPE_CHECKING:
    from hypercorn.typing import Framework

TIMEOUT = 10.0
"""Seconds for one whole test (a cold browser start is the session fixture's, not the test's)."""


def redis_client(server: RedisServer) -> coredis.Redis[str]:
    return coredis.Redis.from_url(server.url, decode_responses=True)


async def test_redis_stream_entries_read_back_in_order(redis_server: RedisServer) -> None:
    with trio.fail_after(TIMEOUT):
        async with redis_client(redis_server) as client:
            ids = [
                await client.xadd("chat:1", {"token": token, "n": str(n)})
                for n, token in enumerate(["Hel", "lo", "!"])
            ]
            entries = await client.xrange("chat:1")
            after_first = await client.xrange("chat:1", start=f"({ids[0]}")
    assert [entry.identifier for entry in entries] == ids
    assert [dict(entry.field_values) for entry in entries] == [
        {"token": "Hel", "n": "0"},
        {"token": "lo", "n": "1"},
        {"token": "!", "n": "2"},
    ]
    assert [entry.identifier for entry in after_first] == ids[1:]


async def test_killed_redis_fails_commands_and_restarted_redis_answers_empty(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(TIMEOUT):
        async with redis_client(redis_server) as client:
            await client.xadd("chat:1", {"token": "a"})
            first_pid = redis_server.pid
            await redis_server.kill()
            assert not redis_server.running
            with pytest.raises(coredis.exceptions.ConnectionError):
                await client.xlen("chat:1")
            await redis_server.restart()
            assert redis_server.running
            assert redis_server.pid != first_pid
            # Nothing is persisted: a restarted server is empty, as after a crash.
            assert await client.xlen("chat:1") == 0
            await client.xadd("chat:1", {"token": "b"})
            assert await client.xlen("chat:1") == 1


EVENTS = [("1", "one"), ("2", "two"), ("3", "three")]

PAGE = b"""<!doctype html>
<title>sse</title>
<script>
  window.received = [];
  const source = new EventSource("/events");
  source.onmessage = (event) => {
    window.received.push({id: event.lastEventId, data: event.data});
    if (window.received.length === 3) source.close();
  };
</script>
"""


@attrs.define
class SSEApp:
    """An ASGI app: ``/`` is :data:`PAGE`; ``/events`` streams :data:`EVENTS`, then ends."""

    stream_requests: list[dict[str, str]] = attrs.Factory(list)
    """The headers of each ``/events`` request."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        assert scope["type"] == "http"
        if scope["path"] == "/events":
            self.stream_requests.append(
                {name.decode(): value.decode() for name, value in scope["headers"]}
            )
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream"),
                        (b"cache-control", b"no-cache"),
                    ],
                }
            )
            for event_id, data in EVENTS:
                chunk = f"id: {event_id}\ndata: {data}\n\n".encode()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        status, body = (200, PAGE) if scope["path"] == "/" else (404, b"not found\n")
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"text/html; charset=utf-8")],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def test_chromium_event_source_reads_three_events(
    nursery: trio.Nursery, browser_page: BrowserPage
) -> None:
    app = SSEApp()
    # Hypercorn types an app by the ASGI TypedDicts; this one reads its messages as plain dicts.
    serve = partial(hypercorn_serve, cast("Framework", app), hypercorn_config())
    binds: list[str] = await nursery.start(serve)
    with trio.fail_after(TIMEOUT):
        assert await browser_page.goto(binds[0] + "/") == 200
        await browser_page.wait_for("window.received.length === 3")
        received = await browser_page.evaluate("window.received")
    assert received == [{"id": event_id, "data": data} for event_id, data in EVENTS]
    assert len(app.stream_requests) == 1
    assert app.stream_requests[0]["accept"] == "text/event-stream"
    assert "last-event-id" not in app.stream_requests[0]
    assert not [line for line in browser_page.console if line.startswith("pageerror")]
