"""The driver's side of the engines' KV-cache events: subscriptions started and stopped as
the core names them, their messages and failures fed to the core, and ``/tokenize`` posts
answered with the engine's body or why there is none."""

from __future__ import annotations

import json
import socket
from functools import partial
from typing import TypeVar

import attrs
import pytest
import trio

from muxproxy.core.commands import KvEndpoint, KvFollow, KvTokenize, Origin
from muxproxy.core.events import Event, KvEventsReceived, KvSubscription, KvTokensAnswered
from muxproxy.testing.fakellm import serve_fakellm
from muxproxy.testing.fakellm.kvevents import KvFakeLLM, token_ids
from muxproxy.trio.backendtls import BackendTLS
from muxproxy.trio.kvfollow import KvFollower, PostError, post
from muxproxy.trio.zmtp import ZmtpPublisher


def closed_tcp_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


E = TypeVar("E", bound=Event)


@attrs.define
class Recording:
    """A driver that records what it is fed."""

    nursery: trio.Nursery
    backend_tls: BackendTLS = attrs.Factory(BackendTLS)
    fed: list[Event] = attrs.Factory(list)
    _changed: trio.Event = attrs.Factory(trio.Event)

    def feed(self, event: Event) -> None:
        self.fed.append(event)
        self._changed.set()
        self._changed = trio.Event()

    async def until(self, kind: type[E], count: int = 1) -> list[E]:
        while len(found := [e for e in self.fed if isinstance(e, kind)]) < count:
            await self._changed.wait()
        return found


async def test_posts_get_the_engines_answer_or_a_reason() -> None:
    fake = KvFakeLLM(kv_blocks=64)
    tls = BackendTLS()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_fakellm, fake)
            origin = Origin(host="127.0.0.1", port=port)
            chat = json.dumps({"model": "m", "prompt": "hello world"}).encode()
            answer = json.loads(await post(origin, b"/tokenize", chat, tls))
            assert answer["tokens"] == token_ids("hello world")
            with pytest.raises(PostError, match="status 400"):
                await post(origin, b"/tokenize", b"{}", tls)
            with pytest.raises(PostError, match="larger than 10 bytes"):
                await post(origin, b"/tokenize", chat, tls, limit=10)
            nursery.cancel_scope.cancel()
    with pytest.raises(OSError):
        await post(Origin(host="127.0.0.1", port=closed_tcp_port()), b"/tokenize", chat, tls)


async def test_followed_endpoints_feed_the_core_and_one_left_out_stops() -> None:
    publisher = ZmtpPublisher()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                partial(trio.serve_tcp, publisher.serve, 0, host="127.0.0.1")
            )
            port = listeners[0].socket.getsockname()[1]
            driver = Recording(nursery)
            follower = KvFollower(driver)
            live = KvEndpoint(group="g", address="a:1", host="127.0.0.1", port=port, topic=b"kv")
            dead = attrs.evolve(live, address="b:1", port=closed_tcp_port())
            follower.follow(KvFollow(endpoints=(live, dead)))
            subscriptions = await driver.until(KvSubscription, 2)
            assert {(e.address, bool(e.error)) for e in subscriptions} == {
                ("a:1", False),
                ("b:1", True),
            }
            await publisher.subscribed.wait()
            publisher.publish([b"kv", bytes(8), b"\x90"])
            (received,) = await driver.until(KvEventsReceived)
            assert received == KvEventsReceived(
                now=received.now, group="g", address="a:1", parts=(b"kv", bytes(8), b"\x90")
            )
            follower.follow(KvFollow(endpoints=()))
            assert follower.followed == {}
            nursery.cancel_scope.cancel()


async def test_a_tokenize_command_is_always_answered() -> None:
    fake = KvFakeLLM(kv_blocks=64)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_fakellm, fake)
            driver = Recording(nursery)
            follower = KvFollower(driver)
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            for at, target in enumerate((port, closed_tcp_port())):
                origin = Origin(host="127.0.0.1", port=target)
                follower.tokenize(
                    KvTokenize(group="g", origin=origin, key=b"k%d" % at, body=body.encode())
                )
            answers = await driver.until(KvTokensAnswered, 2)
            by_key = {e.key: e for e in answers}
            assert by_key[b"k0"].body is not None and by_key[b"k0"].error == ""
            assert by_key[b"k1"].body is None and by_key[b"k1"].error.startswith("OSError")
            nursery.cancel_scope.cancel()
