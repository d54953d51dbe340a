"""The backend stream that continues an answer, as its exchange and the pool see it.

An exchange whose backend failed mid-answer (``continuation.py``) keeps streaming: its
``upstream`` becomes a ``ContinuedStream``, which asks the pool for a stream to the next
server, sends it the continuation request, checks its head, and hands the exchange the new
stream's events spliced into the old one. The exchange stays in STREAMING and never sees the
second head: to it the same backend stream goes on. A head that is not a 2xx
``text/event-stream``, or a failure, is the exchange's ``upstream_failed`` (which may
continue again, within ``next_upstream.tries``, or end the stream visibly truncated).
"""

from __future__ import annotations

from muxproxy.core.exchange.exchangeports import ContinuedOwner
from muxproxy.core.http.headers import is_event_stream
from muxproxy.core.messages import Headers, ResponseHead
from muxproxy.core.ports import Backends, UpstreamStream, UpstreamUser
from muxproxy.core.streams.continuation import Splicing


class ContinuedStream:
    """``UpstreamStream`` to the exchange, ``UpstreamUser`` to the pool."""

    def __init__(
        self,
        exchange: ContinuedOwner,
        pool: Backends,
        splicer: Splicing,
        request: tuple[bytes, Headers, bytes],
    ) -> None:
        self.owner: ContinuedOwner | None = exchange
        self.exchange: UpstreamUser | None = exchange
        """``UpstreamStream.exchange``: who this stream talks to."""
        self.pool = pool
        self.splicer = splicer
        self.target, self.fields, self.body = request
        self.backend: UpstreamStream | None = None
        self.http_version = b"1.1"
        self.answering = False
        """The continuation's head was a 2xx event stream: its events go on."""
        self._paused = False

    # -- UpstreamStream: what the exchange does with it ------------------------------------

    @property
    def pending(self) -> int:
        return self.backend.pending if self.backend is not None else 0

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def written(self) -> bool:
        return True

    def send_head(self, stream: int, method: bytes, target: bytes, headers: Headers) -> None:
        raise AssertionError("a continued stream sends its own request")

    def send_body(self, data: bytes) -> None:
        raise AssertionError("a continued stream sends its own request")

    def send_end(self, trailers: Headers) -> None:
        raise AssertionError("a continued stream sends its own request")

    def pause(self) -> None:
        self._paused = True
        if self.backend is not None:
            self.backend.pause()

    def resume(self) -> None:
        self._paused = False
        if self.backend is not None:
            self.backend.resume()

    def close(self) -> None:
        self.owner = None
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.exchange = None
            backend.close()
        else:
            self.pool.forget(self)

    def release(self) -> None:
        self.owner = None
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.exchange = None
            backend.release()

    # -- UpstreamUser: what the continuing backend stream does -----------------------------

    def upstream_ready(self, upstream: UpstreamStream) -> None:
        owner = self.owner
        if owner is None:
            upstream.exchange = None
            upstream.close()
            return
        self.backend = upstream
        upstream.exchange = self
        self.http_version = upstream.http_version
        upstream.send_head(owner.stream, b"POST", self.target, self.fields)
        upstream.send_body(self.body)
        upstream.send_end([])
        if self._paused:
            upstream.pause()

    def upstream_drained(self) -> None:
        pass

    def response_head(self, head: ResponseHead) -> None:
        owner = self.owner
        if owner is None:
            return
        if 200 <= head.status < 300 and is_event_stream(head.headers):
            self.answering = True
            if owner.failover is not None:
                owner.failover.succeeded()
            return
        owner.upstream_failed(f"the continuation was answered {head.status}")

    def response_body(self, data: bytes) -> None:
        owner = self.owner
        if owner is None or not self.answering:
            return
        spliced = self.splicer.feed(data)
        if spliced:
            owner.response_body(spliced)

    def response_end(self, trailers: Headers) -> None:
        owner = self.owner
        if owner is None:
            return
        if not self.answering:
            owner.upstream_failed("the continuation ended without an answer")
            return
        rest = self.splicer.flush()
        if rest:
            owner.response_body(rest)
        if self.owner is owner:
            owner.response_end(trailers)

    def upstream_failed(self, reason: str, *, timeout: bool = False, stale: bool = False) -> None:
        owner = self.owner
        if owner is not None:
            owner.upstream_failed(f"continuation: {reason}", timeout=timeout)
