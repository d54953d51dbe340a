"""Fault isolation: a bug met while handling one connection ends that connection, not the worker.

``ProxyCore.handle`` runs every event inside one ``try``; an exception that escapes (a bug in
muxproxy, since a peer's bad bytes become a response, RST or GOAWAY in the adapters) is handed
here with the connection the event concerns. Rules:

- The failed connection's state may be half-updated, so it is never called into again: its
  ``Downstream`` or backend connection, its exchanges, their timers, tunnels and pool entries
  are dropped from the core's tables wholesale, and stale references to them are made inert
  (``ClientState.CLOSED``, ``Phase.DONE``, ``TunnelState.CLOSED``).
- Commands the failed call queued for other connections are kept; those for the failed one
  are dropped and replaced by its close. What went out before stays out, so the peer sees
  the truncation: an HTTP/2 client gets GOAWAY(INTERNAL_ERROR) (RFC 9113 §5.4.1, built with
  hyperframe, not with the connection's possibly broken h2 state) and the close, which ends
  every stream; an HTTP/1.1 client sees the close without the final chunk (RFC 9112 §8).
- Exchanges of a failed backend connection fail as upstream failures through their own,
  healthy client side: retried or 502 before the response head, truncated after it.
- Each fault is logged (``Log internal_error``: connection id, event, traceback) and counted
  (``counters["internal_errors"]``). Work done for a neighbour during the cleanup (a client
  whose exchange fails, a shared HTTP/2 backend whose stream is reset) is contained the same
  way: if it raises, that neighbour is isolated next. An exception from the bookkeeping itself
  is a bug in this module and propagates.
- With ``raise_errors`` (tests, fuzzing) nothing is contained: the exception leaves ``handle``.
"""

from __future__ import annotations

import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
import h2.errors
import hyperframe.frame

from muxproxy.core.client.downstream import ClientState, Protocol
from muxproxy.core.commands import (
    CloseConnection,
    Log,
    PauseReading,
    ResumeReading,
    SendData,
    ShutdownWrite,
)
from muxproxy.core.exchange.continuing import ContinuedStream
from muxproxy.core.exchange.exchange import Exchange
from muxproxy.core.faultplan import FaultPoint
from muxproxy.core.ports import Phase
from muxproxy.core.tables import CoreTables
from muxproxy.core.timers import BackendTimer, ClientTimer, ExchangeTimer, ProbeTimer
from muxproxy.core.tunnel.tunnel import RawBackend, StreamBackend, Tunnel
from muxproxy.core.tunnel.tunnel_states import TunnelState
from muxproxy.core.tunnel.websocket import WebSocketExchange
from muxproxy.core.upstream.h2pool import H2State, H2Stream, H2Upstream, StreamState
from muxproxy.core.upstream.pool import UpstreamConn, UpstreamState
from muxproxy.core.upstream.probes import Probe, ProbeState

# Commands addressed to a connection that a failed call may have queued for it.
_CONN_COMMANDS = (SendData, PauseReading, ResumeReading, ShutdownWrite, CloseConnection)

UPSTREAM_REASON = "internal error on the backend connection"


@attrs.frozen(kw_only=True)
class Fault:
    """One exception to contain: the connection it ends (or the probe, which has none)."""

    conn: int | None
    probe: Probe | None = None
    event: str
    error: BaseException


class Isolation:
    """Contains faults for one ``ProxyCore`` (see the module docstring)."""

    def __init__(self, core: CoreTables) -> None:
        self.core = core
        self._queue: deque[Fault] = deque()
        self._faulty: set[int] = set()
        """Connections isolated, or queued for it, during the current ``contain``."""

    def contain(self, fault: Fault) -> None:
        """Isolate ``fault``'s connection, then any neighbour the cleanup found broken."""
        self._queue.append(fault)
        if fault.conn is not None:
            self._faulty.add(fault.conn)
        try:
            while self._queue:
                self._isolate(self._queue.popleft())
        finally:
            self._queue.clear()
            self._faulty.clear()

    def guard(self, conn: int, event: str, call: Callable[..., None], *args: Any) -> None:
        """Run ``call`` on behalf of connection ``conn``; a fault isolates that connection."""
        if conn in self._faulty:
            return  # broken already: never called into again
        try:
            planted = self.core.planted
            if planted is not None:
                planted.reach(FaultPoint.NEIGHBOUR, conn)
            call(*args)
        except Exception as exc:
            if self.core.raise_errors:
                raise
            self._faulty.add(conn)
            self._queue.append(Fault(conn=conn, event=event, error=exc))

    # -- one fault -------------------------------------------------------------------------

    def _isolate(self, fault: Fault) -> None:
        core = self.core
        core.counters["internal_errors"] += 1
        fields: dict[str, Any] = {
            "conn": fault.conn,
            "event": fault.event,
            "error": repr(fault.error),
            "traceback": "".join(traceback.format_exception(fault.error)),
        }
        conn = fault.conn
        if conn is not None:
            self._drop_commands(conn)
        if conn is None:
            assert fault.probe is not None
            fields["probe"] = fault.probe.ident
            self._reset_probe(fault.probe)
        elif conn > 0:
            self._isolate_client(conn, fields)
        else:
            self._isolate_backend(conn, fields)
        core.fx.emit(Log(event="internal_error", fields=fields))

    def _drop_commands(self, conn: int) -> None:
        out = self.core.fx.out
        out[:] = [c for c in out if not (isinstance(c, _CONN_COMMANDS) and c.conn == conn)]

    # -- a client connection ---------------------------------------------------------------

    def _isolate_client(self, conn: int, fields: dict[str, Any]) -> None:
        core = self.core
        downstream = core.clients.pop(conn, None)
        doomed = [ex for ex in core.exchanges.values() if ex.client.conn == conn]
        goaway = b""
        if downstream is not None:
            fields["client"] = downstream.peer_ip
            doomed += [
                ex
                for ex in downstream.exchanges.values()
                if isinstance(ex, Exchange) and ex not in doomed
            ]
            h2s = downstream.h2
            if downstream.protocol is Protocol.HTTP2 and h2s is not None:
                last = h2s.conn.highest_inbound_stream_id
                if h2s.last_stream is not None:
                    last = min(last, h2s.last_stream)
                frame = hyperframe.frame.GoAwayFrame(
                    0, last_stream_id=last, error_code=h2.errors.ErrorCodes.INTERNAL_ERROR
                )
                goaway = frame.serialize()
            downstream.state = ClientState.CLOSED
            downstream.exchanges.clear()
            downstream.output.stalled.clear()
        fields["streams"] = sorted(ex.stream for ex in doomed)
        tunnels = {id(t): t for t in core.tunnels.values() if t.client.conn == conn}
        for ex in doomed:
            if isinstance(ex, WebSocketExchange) and ex.tunnel is not None:
                tunnels[id(ex.tunnel)] = ex.tunnel
        for tunnel in tunnels.values():
            self._drop_tunnel(tunnel, close_backend=True)
        for ex in doomed:
            self._drop_exchange(ex)
        self._detach_backends(doomed)
        for timer in list(core.fx.timers):
            if timer[1] == conn and isinstance(timer[0], ClientTimer):
                core.fx.cancel_timer(timer)
        if goaway:
            core.fx.emit(SendData(conn=conn, data=goaway))
        core.fx.close(conn)

    def _drop_exchange(self, ex: Exchange) -> None:
        """Forget ``ex`` without calling into it: its client is gone."""
        core = self.core
        core.exchanges.pop(ex.ident, None)
        for kind in ExchangeTimer:
            core.fx.cancel_timer((kind, ex.ident))
        if ex.failover is not None:
            ex.failover.leave()
        if ex.admission is not None:
            ex.admission.settle(False, None)  # its budget's slot and tokens go back
        ex.let_go()
        ex.phase = Phase.DONE
        ex.outcome = "internal error"
        core.pool.forget(ex)

    def _detach_backends(self, doomed: list[Exchange]) -> None:
        """Cancel the backend side of ``doomed`` exchanges: close their HTTP/1.1 connections,
        reset their streams on shared HTTP/2 connections (RFC 9113 §8.7: CANCEL)."""
        core = self.core
        users = {id(ex) for ex in doomed}
        for ex in doomed:
            stream = ex.upstream
            ex.upstream = None
            if stream is not None and stream.exchange is ex:
                stream.exchange = None
                if isinstance(stream, UpstreamConn):
                    self.guard(stream.conn, "detach", stream.close)
                elif isinstance(stream, H2Stream):
                    self.guard(stream.upstream.conn, "detach", stream.close)
                elif isinstance(stream, ContinuedStream):
                    stream.close()  # closes the continuation's own backend stream too
        for backend in list(core.upstreams.values()):
            if isinstance(backend, UpstreamConn):
                if backend.exchange is not None and id(backend.exchange) in users:
                    backend.exchange = None
                    self.guard(backend.conn, "detach", backend.close)
            elif isinstance(backend, H2Upstream):
                for h2stream in list(backend.streams.values()):
                    if h2stream.exchange is not None and id(h2stream.exchange) in users:
                        h2stream.exchange = None
                        self.guard(backend.conn, "detach", h2stream.close)

    def _drop_tunnel(self, tunnel: Tunnel, *, close_backend: bool) -> None:
        core = self.core
        tunnel.state = TunnelState.CLOSED
        for conn in [c for c, t in core.tunnels.items() if t is tunnel]:
            del core.tunnels[conn]
        core.fx.cancel_timer(tunnel.timer)
        if not close_backend:
            return
        backend = tunnel.backend
        if isinstance(backend, RawBackend):
            core.fx.close(backend.conn)
        elif isinstance(backend, StreamBackend):
            # RFC 9113 §8.7: the stream on the shared backend connection is cancelled.
            stream = backend.stream
            stream.exchange = None
            self.guard(stream.upstream.conn, "detach", stream.close)

    # -- a backend connection --------------------------------------------------------------

    def _isolate_backend(self, conn: int, fields: dict[str, Any]) -> None:
        core = self.core
        backend = core.upstreams.get(conn)
        users: list[object] = []
        if isinstance(backend, UpstreamConn):
            fields["upstream"] = str(backend.origin)
            backend.state = UpstreamState.CLOSED
            users += [backend.exchange, core.pool.waiting.pop(conn, None)]
            backend.exchange = None
            core.pool.discard(backend)
        elif isinstance(backend, H2Upstream):
            fields["upstream"] = str(backend)
            backend.state = H2State.CLOSED
            for h2stream in backend.streams.values():
                users.append(h2stream.exchange)
                h2stream.exchange = None
                h2stream.state = StreamState.DONE
            backend.streams.clear()
            core.pool.h2.discard(backend, UPSTREAM_REASON)
        tunnel = core.tunnels.get(conn)
        if tunnel is not None:
            fields["upstream"] = "tunnel"
            users.append(tunnel.exchange)
        for user in users:
            # Tunnels over this connection (raw, or streams of it): their backend side is gone.
            if isinstance(user, WebSocketExchange) and user.tunnel is not None:
                self._drop_tunnel(user.tunnel, close_backend=False)
        core.upstreams.pop(conn, None)
        core.fx.cancel_timer((BackendTimer.POOL, conn))
        core.fx.close(conn)
        for user in users:
            if isinstance(user, Exchange):
                self._fail_exchange(user, backend)
            elif isinstance(user, Probe):
                user.upstream = None
                user.upstream_failed(UPSTREAM_REASON)

    def _fail_exchange(self, ex: Exchange, backend: object) -> None:
        """An upstream failure for ``ex`` (retry or 502 before the head, truncation after),
        through its client side, which is healthy as far as we know."""
        stream = ex.upstream
        if stream is backend or getattr(stream, "upstream", None) is backend:
            ex.upstream = None
        if isinstance(ex, WebSocketExchange):
            ex.tunnel = None
        self.guard(ex.client.conn, "upstream_failed", ex.upstream_failed, UPSTREAM_REASON)

    # -- a probe without a connection ------------------------------------------------------

    def _reset_probe(self, probe: Probe) -> None:
        core = self.core
        core.fx.cancel_timer((ProbeTimer.PROBE_TIMEOUT, probe.ident))
        core.pool.forget(probe)
        probe.upstream = None
        probe.state = ProbeState.IDLE
        if core.probes.get(probe.ident) is probe:
            probe.schedule(probe.check.interval)
