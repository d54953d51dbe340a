"""End to end: HTTP/2 abuse on real sockets is answered with GOAWAY(ENHANCE_YOUR_CALM), its
backend requests are cancelled, and other clients are not disturbed (core/http2/h2guard.py)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import h2.errors
import trio
from peers import open_h2

from muxproxy.config import Limits

if TYPE_CHECKING:
    from conftest import StartBackend, StartProxy

CHAT = "/v1/chat/completions"
JSON = ("content-type", "application/json")
BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
).encode()
CALM = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM


async def test_rapid_reset_closes_the_connection_and_every_backend_request(
    start_backend: StartBackend, start_proxy: StartProxy
) -> None:
    fake, port = await start_backend(delay=0.02)
    proxy = await start_proxy([port], limits=Limits(h2_reset_budget=3))
    with trio.fail_after(10):
        async with open_h2(proxy.port) as peer:
            for _ in range(4):
                sid = await peer.request("POST", CHAT, [JSON, ("x-fake-tokens", "500")], BODY)
                # Reset once the backend is generating, so it has something to cancel.
                await peer.wait_until(lambda: bool(peer.streams[sid].frames))  # noqa: B023
                await peer.reset(sid)
            await peer.wait_until(lambda: peer.closed)
            assert peer.terminated is not None and peer.terminated.error_code == CALM
        await fake.wait_disconnect(4)
    assert fake.streams_completed == 0


async def test_ping_flood_gets_goaway_while_another_clients_stream_completes(
    start_backend: StartBackend, start_proxy: StartProxy
) -> None:
    fake, port = await start_backend(delay=0.01)
    proxy = await start_proxy([port], limits=Limits(h2_control_frame_budget=50))
    with trio.fail_after(10):
        async with open_h2(proxy.port) as good, open_h2(proxy.port) as flooder:
            sid = await good.request("POST", CHAT, [JSON, ("x-fake-tokens", "20")], BODY)
            for i in range(200):
                flooder.conn.ping(i.to_bytes(8, "big"))
            await flooder.flush()
            await flooder.wait_until(lambda: flooder.closed)
            assert flooder.terminated is not None and flooder.terminated.error_code == CALM
            state = await good.wait_done(sid)
    assert state.ended and state.reset is None and state.status == 200
    assert fake.streams_completed == 1
