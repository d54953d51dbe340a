"""A browser's own reconnect resumes a chat stream: headless Chromium, ``EventSource``, a cut.

The page (served by a Hypercorn backend through the proxy) reads a token stream with an
``EventSource``. Between the browser and the proxy sits a TCP relay the test controls: once the
stream's fifth token went through, it cuts that connection. The browser reconnects by itself,
with the ``Last-Event-ID`` the proxy gave the last event it had; the proxy answers from the
stream it kept running (``route.resume``), and the page ends with every token exactly once, in
order, while the backend generated the answer once.

An ``EventSource`` also reconnects after a stream's normal end (WHATWG HTML §9.2.3); its resume
of a stream it read whole is answered 204, the one answer that makes it stop (readyState
CLOSED). An empty 200 made it reconnect every ``retry`` delay, for as long as the stream was
kept.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import attrs
import trio
from hypercorn.trio import serve as hypercorn_serve
from services import BrowserPage, lifespan

from muxproxy.config import Resume, Route, quick_config
from muxproxy.testing.fakellm import hypercorn_config

if TYPE_CHECKING:
    from hypercorn.typing import Framework

TOKENS = [f"tok{n}" for n in range(30)]
CUT_AFTER = b"data: tok4\n"

PAGE = b"""<!doctype html>
<title>chat</title>
<script>
  window.tokens = [];
  window.ids = [];
  window.opens = 0;
  window.done = false;
  const source = new EventSource("/v1/stream");
  source.onopen = () => { window.opens += 1; };
  source.onmessage = (event) => {
    if (event.data === "[DONE]") { window.done = true; source.close(); return; }
    window.tokens.push(event.data);
    window.ids.push(event.lastEventId);
  };
  source.addEventListener("error", (event) => {
    if (event.data) { window.failed = event.data; source.close(); }
  });
</script>
"""


# Reads the stream to its end and on, as a page that leaves its EventSource open does.
OPEN_PAGE = b"""<!doctype html>
<title>chat</title>
<script>
  window.tokens = [];
  window.opens = 0;
  window.errors = [];
  window.source = new EventSource("/v1/stream");
  source.onopen = () => { window.opens += 1; };
  source.onmessage = (event) => { window.tokens.push(event.data); };
  source.onerror = () => { window.errors.push(source.readyState); };
</script>
"""


@attrs.define
class ChatApp:
    """``/``: ``page``; ``/v1/stream``: :data:`TOKENS` as SSE, 10 ms apart, then ``[DONE]``."""

    page: bytes = PAGE
    streams: list[dict[str, str]] = attrs.Factory(list)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["path"] == "/v1/stream":
            self.streams.append({k.decode(): v.decode() for k, v in scope["headers"]})
            headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            # A short reconnection delay (WHATWG HTML §9.2.6 "retry"), so the test is quick.
            await send({"type": "http.response.body", "body": b"retry: 50\n\n", "more_body": True})
            for token in TOKENS:
                await trio.sleep(0.01)  # the model's pace, not a synchronisation
                body = f"data: {token}\n\n".encode()
                await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/html; charset=utf-8")],
            }
        )
        await send({"type": "http.response.body", "body": self.page})


@attrs.define
class Relay:
    """TCP from the browser to ``target``, cutting the first connection whose response
    carried ``CUT_AFTER`` (both sockets closed at once, as a network drop looks)."""

    target: int
    cuts: int = 0
    connections: int = 0

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, browser: trio.SocketStream) -> None:
        self.connections += 1
        proxy = await trio.open_tcp_stream("127.0.0.1", self.target)
        async with browser, proxy, trio.open_nursery() as nursery:

            async def upstream() -> None:
                while data := await browser.receive_some(65536):
                    await proxy.send_all(data)

            async def downstream() -> None:
                seen = b""
                while data := await proxy.receive_some(65536):
                    await browser.send_all(data)
                    seen = (seen + data)[-4096:]
                    if self.cuts == 0 and CUT_AFTER in seen:
                        self.cuts += 1
                        return  # both sockets close on the way out

            async def pump(direction: Any) -> None:
                # Either peer may reset its side (Chromium resets idle keep-alive
                # connections): that ends this connection, not the relay.
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await direction()
                nursery.cancel_scope.cancel()

            nursery.start_soon(pump, upstream)
            nursery.start_soon(pump, downstream)


async def _resumable_proxy(app: ChatApp, nursery: trio.Nursery, start_proxy: Any) -> Any:
    """The proxy in front of ``app`` (served by Hypercorn), every path resumable."""
    serve = partial(hypercorn_serve, cast("Framework", app), hypercorn_config())
    binds: list[str] = await nursery.start(serve)
    backend = binds[0].rsplit(":", 1)[1]
    config = quick_config("127.0.0.1:0", [f"127.0.0.1:{backend}"])
    route = Route(prefix="/", upstream="default", resume=Resume(linger=10))
    return await start_proxy(config=attrs.evolve(config, routes=(route,)))


async def test_event_source_reconnects_through_a_cut_and_gets_every_token_once(
    nursery: trio.Nursery, start_proxy: Any, browser_page: BrowserPage
) -> None:
    app = ChatApp()
    proxy = await _resumable_proxy(app, nursery, start_proxy)
    relay = Relay(target=proxy.port)
    port: int = await nursery.start(relay.serve)
    with trio.fail_after(30):
        assert await browser_page.goto(f"http://127.0.0.1:{port}/") == 200
        await browser_page.wait_for("window.done || window.failed !== undefined")
        page = await browser_page.evaluate(
            "({tokens: window.tokens, ids: window.ids, opens: window.opens, failed: window.failed})"
        )
    assert page["failed"] is None
    assert relay.cuts == 1
    assert page["opens"] == 2  # the first stream, and the browser's own reconnect
    assert page["tokens"] == TOKENS  # every token exactly once, in order
    token = page["ids"][0].split(".")[0]
    # The retry block is the stream's first numbered event; tokens follow from 2.
    assert page["ids"] == [f"{token}.{n}" for n in range(2, len(TOKENS) + 2)]
    assert len(app.streams) == 1  # one generation: the reconnect never reached the backend


async def test_event_source_stops_reconnecting_once_a_stream_it_read_whole_has_ended(
    nursery: trio.Nursery, start_proxy: Any, browser_page: BrowserPage
) -> None:
    app = ChatApp(page=OPEN_PAGE)
    proxy = await _resumable_proxy(app, nursery, start_proxy)
    with trio.fail_after(10):
        assert await browser_page.goto(f"http://127.0.0.1:{proxy.port}/") == 200
        # Closed (the 204), or opened again: an answer that lets it reconnect (an empty 200).
        await browser_page.wait_for("source.readyState === EventSource.CLOSED || opens > 1")
        page = await browser_page.evaluate("({state: source.readyState, opens, errors, tokens})")
    assert page["tokens"] == [*TOKENS, "[DONE]"]
    assert page["opens"] == 1  # the stream; its resume was no stream
    # The stream's end (CONNECTING: it reconnects), then the resume's 204 (CLOSED: it stops).
    assert page["errors"] == [0, 2]
    assert page["state"] == 2
    assert proxy.server.core.resumes.resumed == 1  # the one reconnect; CLOSED makes no more
    assert len(app.streams) == 1
