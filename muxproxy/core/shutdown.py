"""Graceful stop: ``ShutdownRequested(now, deadline)`` until nothing is left, or the deadline.

What it obeys:

- RFC 9113 §6.8 (HTTP/2 clients): two GOAWAYs. The first, GOAWAY(NO_ERROR) with
  last-stream-id 2^31-1, tells the client to open no more streams, and a PING follows it;
  streams keep being taken until the PING's ACK (the streams the client sent before it saw
  the GOAWAY are on the wire before that ACK) or ``GOAWAY_ACK_WAIT`` seconds (the ``goaway``
  timer of that connection), whichever comes first. Then the final GOAWAY(NO_ERROR) names the
  highest stream taken; later ones get RST_STREAM(REFUSED_STREAM), which tells the client
  they were not processed and may be retried elsewhere (§8.7). A connection closes once its
  last stream ended after the final GOAWAY (at once when it carries none).
- RFC 9112 §9.6 (HTTP/1.1 clients): the response whose head has not gone out yet carries
  ``Connection: close``, and the connection closes when its exchange ends (no next request
  is read; a pipelined one is the client's to retry, §9.3.2). An idle kept-alive connection
  closes at once, without lingering (``CloseConnection.linger``: a client that holds it open
  would hold the stop): its client sent nothing, so it retries on a new connection as after
  any keep-alive close (§9.3.1). A connection whose request has begun arriving (part of a head)
  is served like a running one, with ``Connection: close``: its client sent it already, and
  a request that is not idempotent could not be retried (§9.3.1), which would cut it.
- A *fresh* connection, accepted an instant before the stop with not a byte read yet, is not
  idle: its client connected to send a request, which is most likely on the wire already
  (§9.3.1's retry after a keep-alive close does not apply to a connection that never carried
  one). It gets ``FIRST_REQUEST_WAIT`` seconds (its ``header`` timer) for that request, which
  is then served like the one above, or it closes. Its first bytes decide its protocol as
  ever; an HTTP/2 preface gets the two GOAWAYs below. Without this, a rolling restart of
  workers closed about one new connection in 300-600 whose request was already sent.
- A connection accepted while stopping (one that raced the end of accepting) is closed at
  once, over HTTP/2 (ALPN) after a GOAWAY(NO_ERROR) with last-stream-id 0.
- Backends: idle pooled connections (HTTP/1.1 kept alive, HTTP/2 with no stream) close at
  once; a busy one closes when its last exchange ends instead of going back to the pool
  (``Pool.release``, ``H2Pool.ready``). An HTTP/2 backend connection that carries streams
  still takes streams for requests the stop still serves (those between an HTTP/2 client's
  two GOAWAYs, retries of running exchanges): a fresh connection for them would cost a
  handshake and drain all the same. Health checks stop.
- Tunnels (WebSocket over HTTP/1.1 or RFC 8441, ``tunnel.py``) run on until the deadline.
- At the deadline (the ``shutdown`` timer; a later ``ShutdownRequested`` with an earlier
  deadline moves it, one at or before ``now`` cuts at once, a later one is ignored) whatever
  still runs is cut visibly: RST_STREAM(CANCEL) on each HTTP/2 stream (RFC 9113 §7: the
  stream is no longer wanted and nothing failed; INTERNAL_ERROR is the sign of a backend that
  broke mid-stream) and then the final GOAWAY and the close; an HTTP/1.1 connection is closed
  without its final chunk (RFC 9112 §8). Aborting the exchanges closes their backend
  connections or resets their backend streams (CANCEL), so the GPUs stop; every backend
  connection left is closed.

``ProxyCore.drained`` is true once stopping and no client connection, backend connection or
tunnel is left; the driver waits for it. Logged: ``shutdown_started`` (deadline, streams,
connections), then either ``drained`` (everything ended by itself) or ``shutdown_cut`` (the
deadline cut ``streams``). Checks happen per event while stopping, and where an exchange
ends; nothing is added to the path of a chunk.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import h2.errors

from muxproxy.core.client.downstream import ClientInput, Downstream
from muxproxy.core.commands import Log
from muxproxy.core.faults import Fault, Isolation
from muxproxy.core.http2.h2 import H2State
from muxproxy.core.tables import CoreTables
from muxproxy.core.timers import ClientTimer, CoreTimer

GOAWAY_ACK_WAIT = 1.0
"""Seconds a graceful stop waits for the ACK of the PING sent with the first GOAWAY before the
final GOAWAY goes out anyway (RFC 9113 §6.8 asks for at least one round trip; a client that
has not answered a PING in a second is not racing us with streams it wants served)."""

FIRST_REQUEST_WAIT = 1.0
"""Seconds a fresh connection (accepted, nothing read yet) is given, once the stop began, for
the first bytes of the request its client connected to send: a round trip and more, while a
client that connects and stays silent holds the stop for no longer than this."""

SHUTDOWN_TIMER = (CoreTimer.SHUTDOWN, 0)

CANCEL = h2.errors.ErrorCodes.CANCEL


class Stage(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"
    """Stopping: running streams finish until the deadline."""
    CUT = "cut"
    """The deadline cut what was left; the last connections are closing."""
    DRAINED = "drained"
    """Nothing left."""


class Shutdown:
    """The stop of one ``ProxyCore`` (see the module docstring)."""

    def __init__(self, core: CoreTables, isolation: Isolation) -> None:
        self.core = core
        self.fx = core.fx
        self.isolation = isolation
        self.stage = Stage.RUNNING
        self.deadline: float | None = None
        self.started = 0.0

    def request(self, deadline: float) -> None:
        """``ShutdownRequested``: begin the stop, or bring its deadline forward."""
        core = self.core
        if self.stage is Stage.RUNNING:
            self.stage = Stage.DRAINING
            self.deadline = deadline
            self.started = core.fx.now
            core.fx.shutting_down = True
            fields = {
                "deadline": deadline,
                "streams": len(core.exchanges),
                "connections": len(core.clients),
            }
            core.fx.emit(Log(event="shutdown_started", fields=fields))
            for probe in core.probes.values():
                probe.retire()
            core.probes.clear()
            for client in list(core.clients.values()):
                self._each(client, stop_client)
            core.pool.shutdown()
        elif (
            self.stage is Stage.DRAINING and self.deadline is not None and deadline < self.deadline
        ):
            self.deadline = deadline
        else:
            return  # a later deadline never extends the first; after the cut, nothing to move
        if deadline <= core.fx.now:
            self.cut()
        else:
            core.fx.set_timer(SHUTDOWN_TIMER, deadline)

    def cut(self) -> None:
        """The deadline: cut every stream and close every connection that is left."""
        if self.stage is not Stage.DRAINING:
            return
        core = self.core
        self.stage = Stage.CUT
        core.fx.cancel_timer(SHUTDOWN_TIMER)
        streams = len(core.exchanges)
        connections = len(core.clients) + len(core.upstreams)
        for client in list(core.clients.values()):
            self._each(client, cut_client)
        for upstream in list(core.upstreams.values()):
            upstream.close()
        core.fx.emit(
            Log(event="shutdown_cut", fields={"streams": streams, "connections": connections})
        )

    def goaway_due(self, client: Downstream) -> None:
        """The ``goaway`` timer: no ACK for the PING of the first GOAWAY in time; the final
        GOAWAY goes out anyway."""
        if not client.move(ClientInput.GOAWAY_TIMER):
            return  # closing: the driver flushes and reports the close
        h2c = client.h2
        if h2c is not None and h2c.state is H2State.GOING_AWAY:
            h2c.drain()
            client.flush()
            if not client.exchanges:
                client.close()

    def settle(self) -> None:
        """After each event while stopping: note when nothing is left."""
        stage = self.stage
        if stage is Stage.DRAINED or stage is Stage.RUNNING or not self.core.drained:
            return
        self.stage = Stage.DRAINED
        core = self.core
        core.fx.cancel_timer(SHUTDOWN_TIMER)
        if stage is Stage.DRAINING:
            fields = {"seconds": round(core.fx.now - self.started, 6)}
            core.fx.emit(Log(event="drained", fields=fields))

    def _each(self, client: Downstream, call: Callable[[Downstream], None]) -> None:
        """``call(client)``, a fault in it isolating that one connection."""
        core = self.core
        if core.clients.get(client.conn) is not client:
            return  # closed or isolated meanwhile
        try:
            call(client)
        except Exception as exc:
            if core.raise_errors:
                raise
            self.isolation.contain(Fault(conn=client.conn, event="ShutdownRequested", error=exc))


def stop_client(client: Downstream) -> None:
    """Graceful stop of one client connection (the module docstring has the rules)."""
    if not client.move(ClientInput.STOP):
        return  # closing already
    client.going_away = True
    h2c = client.h2
    if h2c is not None:
        if h2c.state is H2State.OPEN:
            h2c.announce_shutdown()
            client.flush()
            fx = client.fx
            fx.set_timer((ClientTimer.GOAWAY, client.conn), fx.now + GOAWAY_ACK_WAIT)
        elif h2c.closed and not client.exchanges:
            client.close()
    elif not client.exchanges and (client.h1 is None or client.h1.idle):
        if client.fresh:
            fx = client.fx
            fx.set_timer((ClientTimer.HEADER, client.conn), fx.now + FIRST_REQUEST_WAIT)
        else:
            client.close(linger=False)  # nothing unanswered: no RST to guard against


def refuse_client(client: Downstream) -> None:
    """A connection accepted while stopping: closed at once; over HTTP/2 (ALPN) after a
    GOAWAY(NO_ERROR) that names no stream (RFC 9113 §6.8)."""
    client.move(ClientInput.REFUSE)
    client.going_away = True
    if client.h2 is not None:
        client.h2.drain(0)
    client.close()


def cut_client(client: Downstream) -> None:
    """The deadline for one client connection: RST_STREAM(CANCEL) on each HTTP/2 stream and
    the final GOAWAY, or an HTTP/1.1 close without the final chunk; the close aborts the
    exchanges, which closes or cancels their backends."""
    if not client.move(ClientInput.CUT):
        return  # closing already
    h2c = client.h2
    if h2c is not None:
        for stream in list(client.exchanges):
            h2c.abort(stream, CANCEL)
        h2c.drain()
    client.close()  # flushes first
