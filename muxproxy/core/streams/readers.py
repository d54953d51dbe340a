"""Who a resumable stream's owner writes to, once its first client is gone.

The exchange that owns a resumable stream's backend (``exchange.py``) writes the response to
its ``ExchangeClient`` as any exchange does. When its client goes away that side is swapped, so
the owner's code stays the one path it always is:

- ``Nobody``: the stream lingers; every byte is dropped here (the events are kept by
  ``resume.py``), and nothing holds the backend back.
- ``ResumedClient``: a client came back (``replay.py``); the owner's writes go to that
  client's connection under that client's stream, and that connection's flow control holds
  the owner's backend exactly as its first client's did (``hold`` and ``release`` name the
  replay, whose ``client_drained`` hands the drain on to the owner).

A response head or an error answer can no longer be sent (the head went out before): those
calls are bugs, and raise. Nothing of the request side is here: the owner's request is whole
before its stream may linger, and its body's source stays the connection it came from
(``ports.ExchangeClient``).
"""

from __future__ import annotations

from muxproxy.config import Api
from muxproxy.core.http.bodyclock import SlowBody
from muxproxy.core.http.errors import ErrorShape
from muxproxy.core.messages import AnswerRewrite, Fields, Headers, ResponseHead
from muxproxy.core.ports import ClientStream
from muxproxy.core.streams.resume import Reader


class _AfterHead:
    """What no side can do once the response head went out."""

    def send_head(self, head: ResponseHead, *, end_stream: bool = False) -> None:
        raise AssertionError("a resumed stream's head went out before")

    def send_error(
        self,
        stream: int,
        status: int,
        text: str,
        *,
        api: ErrorShape | None = None,
        head_only: bool = False,
        request_id: bytes | None = None,
        extra: Fields = (),
        rewrite: AnswerRewrite | None = None,
    ) -> int:
        raise AssertionError("a resumed stream's head went out before")

    def refuse_slow_body(
        self, stream: int, slow: SlowBody, *, api: Api | None, request_id: bytes
    ) -> int | None:
        return None  # the request body is complete before a stream may linger


class Nobody(_AfterHead):
    """No client reads the stream: bytes are dropped, the backend runs."""

    peer_ip = ""
    scheme = b""
    trusted = False
    is_h2 = False
    congested = False

    def __init__(self, conn: int) -> None:
        self.conn = conn
        """The connection of the client that left (timers and faults name the owner by it)."""

    def buffered(self, stream: int) -> int:
        return 0

    def send_body(self, stream: int, data: bytes) -> None:
        pass

    def send_end(self, stream: int, trailers: Headers) -> None:
        pass

    def abort(self, stream: int) -> None:
        pass

    def hold(self, stream: ClientStream) -> None:
        pass

    def release(self, stream: ClientStream) -> None:
        pass

    def holds(self, stream: ClientStream) -> bool:
        return False

    def exchange_finished(self, stream: ClientStream) -> None:
        pass


class ResumedClient(_AfterHead):
    """The connection of the client that resumed, as the owner sees it."""

    def __init__(self, replay: Reader) -> None:
        self.replay = replay
        self.client = client = replay.client
        self.conn = client.conn
        self.peer_ip = client.peer_ip
        self.scheme = client.scheme
        self.trusted = client.trusted

    @property
    def is_h2(self) -> bool:
        return self.client.is_h2

    @property
    def congested(self) -> bool:
        return self.client.congested

    def buffered(self, stream: int) -> int:
        return self.client.buffered(self.replay.stream)

    def send_body(self, stream: int, data: bytes) -> None:
        self.replay.bytes_out += len(data)
        self.client.send_body(self.replay.stream, data)

    def send_end(self, stream: int, trailers: Headers) -> None:
        self.client.send_end(self.replay.stream, trailers)

    def abort(self, stream: int) -> None:
        self.client.abort(self.replay.stream)

    def hold(self, stream: ClientStream) -> None:
        self.client.hold(self.replay)

    def release(self, stream: ClientStream) -> None:
        self.client.release(self.replay)

    def holds(self, stream: ClientStream) -> bool:
        return self.client.holds(self.replay)

    def exchange_finished(self, stream: ClientStream) -> None:
        """The owner's backend stream is over (it sent the end or the abort through us)."""
        self.replay.owner_finished()
