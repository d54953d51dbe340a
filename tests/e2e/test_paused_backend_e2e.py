"""End to end: a backend the proxy stopped reading, because its client is behind, is not timed
out for it, is not failed and is not counted against its server's health.

A real proxy in this process, real sockets, under a ``MockClock`` that jumps to the next
deadline once every task has been blocked for 10 ms of real time (as ``test_timeouts.py``):
the backend timeouts are 5 s and each client holds back three times that, in virtual time.
Every server is taken out by a single failure (``max_fails = 1``) for longer than the test
lasts, and both what the admin API answers (status, metrics) and the access log are checked.

- An HTTP/2 client that opens no stream window (SETTINGS_INITIAL_WINDOW_SIZE 0): its backend
  is paused at the first chunk that does not fit (``core/client/windowwait.py``); the ``read``
  timer does not count the pause (``core/exchange/deadlines.py``). Once the client opens its window
  it gets the whole answer.
- An HTTP/2 client that stops reading its connection while another of its streams is busy:
  the connection's output passes ``limits.connection_buffer`` and every backend feeding it is
  paused (``core/client/output.py``), also one whose response head, or first token, has not come
  yet; neither the ``response_head`` nor the group's ``first_token`` timer counts the pause.
  The client stops reading; it does not shrink its socket buffers: the kernel's own buffers
  fill, as they do in front of any client that is behind.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any, Literal

import attrs
import h2.settings
import h11
import httpx
import pytest
import trio
import trio.testing
from h2client import H2Client, H2Stream
from peers import open_h2, serve_raw

from muxproxy.config import GroupTimeouts, Limits, Server, Timeouts, quick_config
from muxproxy.core.commands import Log
from muxproxy.testing.fakellm import reply_text
from muxproxy.trio.admin import serve_admin
from muxproxy.trio.control import LocalControl

TIMEOUT = 5.0
"""Every backend timeout: ``response_head``, ``read`` and the group's ``first_token``."""
HOLD = 3 * TIMEOUT
"""How long a client stays behind: three timeouts, so each timer would have fired."""
CHAT = "/v1/chat/completions"


@pytest.fixture
def clock() -> trio.testing.MockClock:
    # pytest-trio runs the test under any Clock among its fixtures' values.
    return trio.testing.MockClock(autojump_threshold=0.01)


CONNECTION_BUFFER = 64 * 1024
"""Below ``limits.stream_buffer`` (256 KiB): one busy stream fills its connection."""


def one_strict_server(port: int) -> Any:
    """One server, out after a single failure for longer than the test; short timeouts (the
    ``send`` timeout stays long: a client that is behind for ``HOLD`` is not cut); a small
    ``connection_buffer``."""
    config = quick_config("127.0.0.1:0", [])
    server = Server(address=f"127.0.0.1:{port}", max_fails=1, fail_timeout=3600.0)
    group = attrs.evolve(
        config.upstreams["default"],
        servers=(server,),
        timeouts=GroupTimeouts(first_token=TIMEOUT),
    )
    return attrs.evolve(
        config,
        upstreams={"default": group},
        timeouts=Timeouts(response_head=TIMEOUT, read=TIMEOUT, send=20 * TIMEOUT),
        limits=Limits(connection_buffer=CONNECTION_BUFFER),
    )


def record_logs(proxy: Any) -> list[Log]:
    logs: list[Log] = []
    driver = proxy.server.driver
    assert driver is not None
    driver.on_log = logs.append
    return logs


async def assert_never_failed(
    proxy: Any, port: int, logs: list[Log], requests: int, nursery: trio.Nursery
) -> None:
    """What an operator sees on the admin API: the server up with no failure, no failure in
    the metrics; and every access line ``ok``."""
    host, admin_port = await nursery.start(
        partial(serve_admin, "127.0.0.1:0", LocalControl(proxy.server), None)
    )
    async with httpx.AsyncClient(base_url=f"http://{host}:{admin_port}") as admin:
        status = (await admin.get("/status")).raise_for_status().json()
        metrics = (await admin.get("/metrics")).raise_for_status().text
    (entry,) = status["groups"]["default"]["servers"]
    assert entry["address"] == f"127.0.0.1:{port}"
    assert (entry["state"], entry["health"], entry["failures"]) == ("up", "healthy", 0)
    assert "muxproxy_upstream_failures_total{" not in metrics
    accesses = [log.fields for log in logs if log.event == "access"]
    assert [(a["status"], a["outcome"]) for a in accesses] == [(200, "ok")] * requests
    assert not [log.event for log in logs if "timeout" in log.event or log.event == "health"]


# -- the stream's own window ----------------------------------------------------------------


def sse_text(body: bytes) -> str:
    """The content of an OpenAI chat stream's chunks, joined."""
    text = []
    for line in body.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                text.append(choice["delta"].get("content") or "")
    return "".join(text)


async def test_backend_paused_for_a_closed_stream_window_is_not_timed_out(
    start_backend, start_proxy, nursery, clock
):
    """The read timer does not run while the proxy does not read the backend."""
    fake, port = await start_backend(tokens=8, delay=0.5)
    proxy = await start_proxy(config=one_strict_server(port))
    logs = record_logs(proxy)
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    json_type = ("content-type", "application/json")
    closed = {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
    with trio.fail_after(100):
        async with open_h2(proxy.port, settings=closed, connection_window=1 << 24) as peer:
            sid = await peer.request("POST", CHAT, [json_type], json.dumps(request).encode())
            state = peer.streams[sid]
            await peer.wait_until(lambda: state.headers is not None)
            assert state.status == 200
            # The backend writes all its answer (into the kernel's buffers: the proxy stopped
            # reading it at its first chunk) and then stays silent: three read timeouts.
            await fake.wait_until(lambda: fake.streams_completed == 1)
            await trio.sleep(HOLD)
            down = proxy.server.core.clients[min(proxy.server.core.clients)]
            assert down.output.windowed == {sid}, "the backend was not paused"
            assert state.body == b"" and not state.done
            peer.conn.increment_flow_control_window(1 << 20, stream_id=sid)
            await peer.flush()
            await peer.wait_done(sid)
    assert state.ended and state.reset is None
    assert state.body.endswith(b"data: [DONE]\n\n")
    assert sse_text(state.body) == reply_text(8)
    await assert_never_failed(proxy, port, logs, 1, nursery)


# -- a congested connection -----------------------------------------------------------------

TOKENS = [f"tok{i} " for i in range(8)]
ANSWER = b"".join(
    b"data: %s\n\n" % json.dumps({"choices": [{"delta": {"content": t}}]}).encode() for t in TOKENS
) + (b"data: [DONE]\n\n")
FLOOD_EVENT = b"data: " + b"x" * 65000 + b"\n\n"


@attrs.define
class Backend:
    """An HTTP/1.1 backend that answers ``/flood`` as fast as the proxy reads, until
    ``enough``, and ``/held`` with an SSE answer whose ``head`` (or whose body, after an
    immediate head) it holds until ``release``."""

    hold: Literal["head", "first_token"]
    """What of ``/held``'s answer waits for ``release``."""
    enough: trio.Event = attrs.field(factory=trio.Event)
    release: trio.Event = attrs.field(factory=trio.Event)
    held_request: trio.Event = attrs.field(factory=trio.Event)
    flooded: int = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            request = None
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.EndOfMessage):
                    break
            assert request is not None
            head = h11.Response(status_code=200, headers=[("content-type", "text/event-stream")])
            try:
                if request.target == b"/flood":
                    await stream.send_all(conn.send(head))
                    while not self.enough.is_set():
                        await stream.send_all(conn.send(h11.Data(data=FLOOD_EVENT)))
                        self.flooded += len(FLOOD_EVENT)
                    await stream.send_all(conn.send(h11.EndOfMessage()))
                    return
                self.held_request.set()
                if self.hold == "head":
                    await self.release.wait()
                await stream.send_all(conn.send(head))
                await self.release.wait()
                await stream.send_all(conn.send(h11.Data(data=ANSWER)))
                await stream.send_all(conn.send(h11.EndOfMessage()))
            except trio.BrokenResourceError:
                pass


def stalled_event(proxy: Any, predicate: Any) -> trio.Event:
    """Set once ``predicate()`` holds after a batch of the driver's commands."""
    event = trio.Event()
    driver = proxy.server.driver
    assert driver is not None and driver.on_settled is None

    def settled(now: float) -> None:
        if predicate():
            event.set()

    driver.on_settled = settled
    return event


@pytest.mark.parametrize("hold", ["head", "first_token"])
async def test_backend_paused_by_a_congested_connection_is_not_timed_out(
    start_proxy, nursery, clock, hold
):
    """Stream ``held``'s backend is paused before its response head (or its first token) came,
    because the client stopped reading while another stream filled its connection; the head
    (first-token) timeout passes three times; once the client reads again it gets both answers
    whole, and the server was never failed."""
    backend = Backend(hold=hold)
    port = await serve_raw(nursery, backend.handle)
    proxy = await start_proxy(config=one_strict_server(port))
    logs = record_logs(proxy)
    core = proxy.server.core
    with trio.fail_after(100):
        client = await H2Client.connect(proxy.port)
        async with client.stream:
            # Flow control is not what stops the proxy: every window wide open.
            client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
            client.conn.increment_flow_control_window(2**31 - 1 - 65535)
            held = await client.send(b"/held")
            await backend.held_request.wait()
            if hold == "first_token":
                await client.wait(lambda: client.streams[held].headers is not None)
            down = core.clients[min(core.clients)]
            exchange = core.exchanges[min(core.exchanges)]
            paused = stalled_event(proxy, lambda: exchange in down.output.stalled)
            # From here on the client reads nothing, until the end of the hold.
            flood = await client.send(b"/flood")
            await paused.wait()
            backend.enough.set()
            backend.release.set()  # into the kernel's buffers: the proxy does not read it
            await trio.sleep(HOLD)
            await client.wait(lambda: client.streams[held].done and client.streams[flood].done)
    assert backend.flooded > CONNECTION_BUFFER
    answer: H2Stream = client.streams[held]
    assert (answer.status, answer.ended, answer.reset) == (200, True, None)
    assert answer.body == ANSWER
    flooded = client.streams[flood]
    assert (flooded.status, flooded.ended, flooded.reset) == (200, True, None)
    assert len(flooded.body) == backend.flooded
    await assert_never_failed(proxy, port, logs, 2, nursery)
