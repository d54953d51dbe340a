"""Just enough ZeroMQ: our SUB against our PUB over real TCP, and refusals of bad peers."""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from functools import partial

import pytest
import trio

from muxproxy.trio.zmtp import (
    MAX_FRAME,
    ZmtpError,
    ZmtpPublisher,
    frame,
    greeting,
    subscribe,
)


async def serve(
    nursery: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[object]]
) -> int:
    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1])


def test_frames_short_and_long() -> None:
    assert frame(b"ab", more=True) == b"\x01\x02ab"
    assert frame(b"x" * 300) == b"\x02" + struct.pack(">Q", 300) + b"x" * 300
    assert frame(b"\x05READY", command=True)[:1] == b"\x04"
    assert len(greeting()) == 64


async def test_subscriber_gets_its_topic_only_in_order() -> None:
    publisher = ZmtpPublisher()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            port = await serve(nursery, publisher.serve)
            subscription = await subscribe("127.0.0.1", port, b"kv-events")
            await publisher.subscribed.wait()
            publisher.publish([b"other", b"x"])
            publisher.publish([b"kv-events", b"\x00" * 8, b"y" * 1000])
            publisher.publish([b"kv-events-dp1", b"1"])  # a prefix match, as ZeroMQ's
            assert await subscription.receive() == [b"kv-events", b"\x00" * 8, b"y" * 1000]
            assert await subscription.receive() == [b"kv-events-dp1", b"1"]
            await subscription.aclose()
            nursery.cancel_scope.cancel()


async def fake_peer(
    script: bytes, stream: trio.SocketStream, *, after_greeting: bool = True
) -> None:
    if after_greeting:
        await stream.send_all(greeting())
    await stream.send_all(script)
    while await stream.receive_some(65536):  # hold the connection until the client leaves
        pass


@pytest.mark.parametrize(
    ("script", "after_greeting", "message"),
    [
        (b"HTTP/1.1 200 OK\r\n" + b"\x00" * 64, False, "not speaking ZMTP"),
        (frame(b"\x05READY\x0bSocket-Type\x00\x00\x00\x03REQ", command=True), True, "REQ"),
        (frame(b"\x05ERROR", command=True), True, "not READY"),
    ],
)
async def test_subscribe_refuses_a_peer_that_is_no_publisher(
    script: bytes, after_greeting: bool, message: str
) -> None:
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            port = await serve(nursery, partial(fake_peer, script, after_greeting=after_greeting))
            with pytest.raises(ZmtpError, match=message):
                await subscribe("127.0.0.1", port, b"kv-events")
            nursery.cancel_scope.cancel()


async def test_a_frame_over_the_limit_ends_the_subscription() -> None:
    ready = frame(b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB", command=True)
    oversized = b"\x02" + struct.pack(">Q", MAX_FRAME + 1)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            port = await serve(nursery, partial(fake_peer, ready + oversized))
            subscription = await subscribe("127.0.0.1", port, b"")
            with pytest.raises(ZmtpError, match="over"):
                await subscription.receive()
            await subscription.aclose()
            nursery.cancel_scope.cancel()
