"""The driver's side of the engines' KV-cache events: a subscription task per endpoint the
core names (``KvFollow``), and the ``POST /tokenize`` requests it asks for (``KvTokenize``).

What it obeys: the core decides (``core/upstream/kvfeeds.py``); this module only connects,
reads, posts and feeds the answers back (``KvSubscription``, ``KvEventsReceived``,
``KvTokensAnswered``), never on a request's path. Each ``KvFollow`` names every endpoint
to follow: a subscription not named any more is cancelled, a new one started
(``trio/kvevents.py``: reconnecting with a backoff, each failure logged once). A tokenize
request is one HTTP/1.1 POST on a connection of its own (TLS as the server's requests,
verified; HTTP/1.1 whatever the server's ``protocol``, as vLLM serves it), at most
:data:`TOKENIZE_TIMEOUT` seconds and :data:`MAX_ANSWER` bytes; its failure is answered as
an error, which degrades the placement of that conversation's next turn to the prefix key.
How many are in flight is the core's bound (``routing/kvplace.MAX_PENDING``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
import h11
import trio

from muxproxy.core.commands import Command, KvEndpoint, KvFollow, KvTokenize, Origin
from muxproxy.core.events import Event, KvEventsReceived, KvSubscription, KvTokensAnswered
from muxproxy.trio.backendtls import BackendTLS, BackendTLSError
from muxproxy.trio.kvevents import follow

__all__ = [
    "MAX_ANSWER",
    "TOKENIZE_TIMEOUT",
    "Driver",
    "KvFollower",
    "PostError",
    "executors",
    "post",
]

TOKENIZE_TIMEOUT = 5.0
"""Seconds a tokenize request may take: far above a tokenizer's milliseconds, and short
enough that a hung engine does not hold the group's requests in flight long."""
MAX_ANSWER = 16 * 1024 * 1024
"""Bytes of a tokenize answer read at most: a million tokens as JSON (``kvtokens``'s own
bound) fits."""


class Driver(Protocol):
    """The driver, as far as this module needs it (``trio/driver.py``)."""

    nursery: trio.Nursery
    backend_tls: BackendTLS

    def feed(self, event: Event) -> None: ...


class PostError(Exception):
    """A POST answered with another status than 200, too much, or not HTTP/1.1."""


async def post(
    origin: Origin, target: bytes, body: bytes, tls: BackendTLS, limit: int = MAX_ANSWER
) -> bytes:
    """The body of the 200 answer to ``POST target`` with the JSON ``body``; raises
    :class:`PostError`, ``OSError``, :class:`BackendTLSError` or ``trio.BrokenResourceError``."""
    tcp = await trio.open_tcp_stream(origin.host, origin.port)
    stream: trio.abc.Stream = tcp
    try:
        if origin.tls:
            stream = await tls.handshake(tcp, attrs.evolve(origin, alpn="http/1.1"))
        conn = h11.Connection(h11.CLIENT)
        headers = [
            (b"host", str(origin).encode()),
            (b"user-agent", b"muxproxy-tokenize"),
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),
        ]
        out = conn.send(h11.Request(method=b"POST", target=target, headers=headers)) or b""
        out += conn.send(h11.Data(data=body)) or b""
        out += conn.send(h11.EndOfMessage()) or b""
        await stream.send_all(out)
        status = 0
        answer = bytearray()
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise PostError(f"not an HTTP/1.1 answer: {exc}") from None
            if event is h11.NEED_DATA:
                conn.receive_data(bytes(await stream.receive_some(65536)))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                answer += event.data
                if len(answer) > limit:
                    raise PostError(f"an answer larger than {limit} bytes")
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
    finally:
        await trio.aclose_forcefully(stream)
    if status != 200:
        raise PostError(f"status {status}" if status else "the connection closed")
    return bytes(answer)


@attrs.define
class _CoreFeed:
    """One endpoint's subscription, as ``kvevents.follow`` drives it, fed to the core."""

    driver: Driver
    endpoint: KvEndpoint

    @property
    def topic(self) -> bytes:
        return self.endpoint.topic

    def up(self, now: float) -> None:
        where = self.endpoint
        self.driver.feed(KvSubscription(now=now, group=where.group, address=where.address))

    def message(self, parts: list[bytes], now: float) -> str | None:
        where = self.endpoint
        event = KvEventsReceived(
            now=now, group=where.group, address=where.address, parts=tuple(parts)
        )
        self.driver.feed(event)
        return None  # the core logs what the message revealed

    def down(self) -> None:
        pass  # ``failed`` says why, unless the subscription was cancelled (not followed)

    def failed(self, reason: str) -> None:
        where = self.endpoint
        now = trio.current_time()
        self.driver.feed(
            KvSubscription(now=now, group=where.group, address=where.address, error=reason)
        )


class KvFollower:
    """The subscription tasks and tokenize requests of one driver (see the module header)."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.followed: dict[KvEndpoint, trio.CancelScope] = {}

    def follow(self, command: KvFollow) -> None:
        wanted = set(command.endpoints)
        for endpoint in [e for e in self.followed if e not in wanted]:
            self.followed.pop(endpoint).cancel()
        for endpoint in command.endpoints:
            if endpoint not in self.followed:
                scope = self.followed[endpoint] = trio.CancelScope()
                self.driver.nursery.start_soon(self._follow, endpoint, scope)

    async def _follow(self, endpoint: KvEndpoint, scope: trio.CancelScope) -> None:
        name = f"{endpoint.group} {endpoint.address}"
        with scope:
            await follow(name, endpoint.host, endpoint.port, _CoreFeed(self.driver, endpoint))

    def tokenize(self, command: KvTokenize) -> None:
        self.driver.nursery.start_soon(self._tokenize, command)

    async def _tokenize(self, command: KvTokenize) -> None:
        body: bytes | None = None
        error = ""
        try:
            with trio.fail_after(TOKENIZE_TIMEOUT):
                body = await post(
                    command.origin, b"/tokenize", command.body, self.driver.backend_tls
                )
        except trio.TooSlowError:
            error = f"no answer within {TOKENIZE_TIMEOUT:g} s"
        except (OSError, PostError, BackendTLSError, trio.BrokenResourceError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        answer = KvTokensAnswered(
            now=trio.current_time(), group=command.group, key=command.key, body=body, error=error
        )
        self.driver.feed(answer)


def executors(driver: Driver) -> dict[type[Command], Callable[[Any], None]]:
    """The driver's executors of ``KvFollow`` and ``KvTokenize``."""
    follower = KvFollower(driver)
    return {KvFollow: follower.follow, KvTokenize: follower.tokenize}
