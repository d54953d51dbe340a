"""The HTTP/2 streams of one client connection whose response waits for the client's window.

Obeys RFC 9113 §6.9 (flow control) and §7 (error codes): a closed window is legal, but a
stream whose window stays closed for ``timeouts.send`` (the zero-window reader) can never have
its queued bytes written, so it is given up like a connection that takes no bytes:
RST_STREAM(CANCEL), since the client broke no rule (not FLOW_CONTROL_ERROR) and we did not
fail (not INTERNAL_ERROR); the stream is no longer wanted. The other streams go on.

While a stream waits for its window its backend is stopped (``Exchange.client_stalled``: h1
PauseReading, an HTTP/2 backend stream's window withheld), from the first chunk that did not
fit: a reader that opens no window must cost nothing while it waits (no backend reads, no
chunks queued up to ``limits.stream_buffer``), as HAProxy, whose buffer per stream is one
read, stops reading at once. The stream's data that came before waits in its queue. The
backend is read again once a WINDOW_UPDATE (or SETTINGS) sent all of the queue, and not
before: a window that opens by less only lets out part of what waits (``reopened``).

One ``window`` timer per connection, lazy: armed when a stream starts to wait while none
does, moved only when it fires, so a chunk queued behind a closed window costs a dict store.
A window that moves (a WINDOW_UPDATE or SETTINGS released queued data) starts the stream's
wait again; bytes that wait only for the socket (the window is open, the connection is
``congested``) are the connection's send timer's to judge, not this one's.
"""

from __future__ import annotations

import h2.errors

from muxproxy.core.client.refusals import Refusing
from muxproxy.core.effects import Effects
from muxproxy.core.ports import ClientStream
from muxproxy.core.timers import ClientTimer


class WindowWaits:
    """Since when each waiting stream's window has not moved, and the timer that bounds it."""

    def __init__(self, fx: Effects, conn: int, stopped: set[int]) -> None:
        """``stopped``: the connection output's ``Output.windowed``, shared."""
        self.fx = fx
        self.timer = (ClientTimer.WINDOW, conn)
        self.since: dict[int, float] = {}
        self.stopped = stopped
        """Waiting streams whose backend we stopped for it (a subset of ``since``'s keys)."""

    def wait(self, stream: int, exchange: ClientStream | None) -> bool:
        """``stream``'s response was queued behind a closed window: stop its backend. True
        when it was running (the connection then holds the exchange, ``ResponseSink.hold``)."""
        fx = self.fx
        if not self.since:
            fx.set_timer(self.timer, fx.now + fx.config.timeouts.send)
        self.since[stream] = fx.now
        if exchange is not None and exchange.client_stalled():
            self.stopped.add(stream)
            return True
        return False

    def reopened(self, stream: int, *, blocked: bool) -> bool:
        """``stream``'s window moved and let queued data out: whether its backend may be read
        again as far as the window goes. One stopped for the window waits until nothing of
        the stream waits for window any more (``blocked`` False); the caller resumes it
        (``Exchange.client_drained``)."""
        if stream not in self.stopped:
            return True
        if blocked:
            return False
        self.stopped.discard(stream)
        return True

    def moved(self, stream: int) -> None:
        """``stream``'s window moved: its wait starts again."""
        if stream in self.since:
            self.since[stream] = self.fx.now

    def expire(self, client: Refusing) -> None:
        """The timer fired: cut each stream of ``client`` whose window stayed closed for
        ``timeouts.send``, forget those sent, ended or reset meanwhile, and arm the timer for
        the next one due."""
        h2s = client.h2
        assert h2s is not None
        now = self.fx.now
        limit = self.fx.config.timeouts.send
        since = self.since
        due: float | None = None
        for stream, start in list(since.items()):
            if not h2s.queued(stream):
                del since[stream]
                self.stopped.discard(stream)
                continue
            if not h2s.window_closed(stream):
                start = since[stream] = now
            elif now >= start + limit:
                del since[stream]
                self.stopped.discard(stream)
                _cut(client, stream)
                continue
            at = start + limit
            due = at if due is None or at < due else due
        if due is not None:
            self.fx.set_timer(self.timer, due)
        client.flush()


def _cut(client: Refusing, stream: int) -> None:
    """RST_STREAM(CANCEL) and the backend request aborted; the other streams go on."""
    h2s = client.h2
    assert h2s is not None
    client.host.defences.record(
        "stream_send_timeout", client.peer_ip, conn=client.conn, stream=stream
    )
    h2s.abort(stream, h2.errors.ErrorCodes.CANCEL)
    exchange = client.exchanges.get(stream)
    if exchange is not None:
        exchange.client_aborted("the client opened no window within the send timeout")
