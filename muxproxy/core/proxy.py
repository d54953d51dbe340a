"""ProxyCore: the one entry point of the sans-IO proxy, ``handle(event) -> list[Command]``.

It routes each event to the connection it concerns (a ``Downstream`` for client connections,
an ``UpstreamConn`` for backend ones) or to the exchange a timer belongs to, and collects the
commands they emit. It never awaits, never reads a clock (``event.now`` is the time), and
touches no socket: any driver task may call it, one call at a time, without a lock.

Fault isolation: a peer's bad bytes become a response, a reset or a GOAWAY inside the adapter
that owns the connection; nothing a peer sends should raise. An exception that does escape the
handling of one event is a bug in muxproxy: it ends the connection the event concerns (a timer's
``Wakeup`` counts for the connection of the exchange, pool entry or probe that owns it), logged
with its traceback and counted, and every other connection goes on (``faults.py``). With
``raise_errors`` (the test suite, the fuzzers: ``MUXPROXY_RAISE_ERRORS=1``) it is re-raised
instead, so bugs fail loudly. An event that concerns no connection (``ConfigChanged``) always
re-raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, assert_never

from mypy_extensions import mypyc_attr

from muxproxy.config import Config, Upstream
from muxproxy.config.runtime import RuntimeState
from muxproxy.core.client.downstream import Downstream
from muxproxy.core.commands import Command, Log, ResumeFetchCancel
from muxproxy.core.effects import READ_SIZE, Effects
from muxproxy.core.events import (
    BudgetAnswered,
    ConfigChanged,
    ConnectionAccepted,
    ConnectionClosed,
    ConnectionOpened,
    DataReceived,
    DataSent,
    Event,
    ExtensionAnswered,
    InputEnded,
    OpenFailed,
    ResumeFetched,
    ResumeProbed,
    RuntimeChanged,
    SessionsLearned,
    ShutdownRequested,
    Wakeup,
)
from muxproxy.core.exchange import fleetadmit, placement
from muxproxy.core.exchange.admit import Admission, next_to_admit
from muxproxy.core.exchange.exchange import Exchange
from muxproxy.core.exchange.replay import ReplayExchange, wants_resume
from muxproxy.core.exchange.sessionshare import SessionSharing
from muxproxy.core.faultplan import FaultPlan, FaultPoint
from muxproxy.core.faults import Fault, Isolation
from muxproxy.core.flow import BufferLimits
from muxproxy.core.http.forwarded import is_trusted
from muxproxy.core.messages import RequestHead
from muxproxy.core.observe.access import RequestIds
from muxproxy.core.observe.defencelog import KINDS as DEFENCE_KINDS
from muxproxy.core.observe.defencelog import DefenceLog
from muxproxy.core.observe.measure import Measurements
from muxproxy.core.ports import BackendConnection, ClientSide
from muxproxy.core.raising import raise_errors_from_environment
from muxproxy.core.shutdown import Shutdown, refuse_client, stop_client
from muxproxy.core.statistics import ProxyStatistics, take_statistics
from muxproxy.core.streams.resume import ResumeStore
from muxproxy.core.timers import (
    BackendTimer,
    ClientTimer,
    CoreTimer,
    ExchangeTimer,
    ProbeTimer,
    ResumeTimer,
)
from muxproxy.core.tunnel.tunnel import Tunnel
from muxproxy.core.tunnel.websocket import WebSocketExchange, wants_tunnel
from muxproxy.core.upstream.h2pool import H2Stream
from muxproxy.core.upstream.kvfeeds import KvFeeds
from muxproxy.core.upstream.loadpoll import LoadPoll
from muxproxy.core.upstream.modelpoll import ModelPoll
from muxproxy.core.upstream.pool import Pool, UpstreamConn
from muxproxy.core.upstream.probes import Probe
from muxproxy.routing.aliases import Aliases
from muxproxy.routing.router import GroupRouter

COUNTERS = ("internal_errors", *DEFENCE_KINDS)
"""The names in ``ProxyCore.counters``, each counted from 0 since the core started:

- ``internal_errors``: connections ended by a bug in muxproxy (``faults.py``), core or driver;
- one per defence (``defencelog.KINDS``): GOAWAY(ENHANCE_YOUR_CALM) to an abusive HTTP/2
  client, refused request-smuggling shapes, request head and request body timeouts, HTTP/2
  streams whose window stayed closed, HTTP/1.1 backend connections closed for bytes after a
  response.
"""


ADMIT_LOOKAHEAD = 32
"""Waiting requests looked at, in fair order, for one that belongs on a server with room."""


# The compiled build (``muxproxy/compiled.py``) keeps this class open to Python subclasses: an
# embedding (and the driver's tests) may script a core by overriding ``handle``.
@mypyc_attr(allow_interpreted_subclasses=True)
class ProxyCore:
    def __init__(
        self, config: Config, *, read_size: int = READ_SIZE, raise_errors: bool | None = None
    ) -> None:
        """``raise_errors``: let an internal error escape ``handle`` instead of ending the one
        connection it concerns; None reads ``MUXPROXY_RAISE_ERRORS`` (once, here)."""
        self.fx = Effects(config, read_size=read_size)
        """The clock, limits, commands and timers every part shares (``effects.py``)."""
        self.read_size = self.fx.read_size
        """Bytes the driver reads from a socket at once (plain: read before every read)."""
        if raise_errors is None:
            raise_errors = raise_errors_from_environment()
        self.raise_errors = raise_errors
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        """Plain counters, name -> int (``COUNTERS``), for an embedder to export as metrics."""
        self.measurements = Measurements(self)
        """Counters and histograms (``measure.py``), exported by ``snapshot()``."""
        self.request_ids = RequestIds()
        """X-Request-ID values (``access.py``); its random prefix is read here, once."""
        self.resumes = ResumeStore(self.fx)
        """Resumable SSE streams (``resume.py``): their kept events, by token."""
        self.defences = DefenceLog(self)
        """Counts and rate-limited log lines of what the defences do (``defencelog.py``)."""
        self._waking: int | Probe | None = None
        """Whose timer the current ``Wakeup`` is: a connection id, or a probe."""
        self.clients: dict[int, Downstream] = {}
        self.upstreams: dict[int, BackendConnection] = {}
        self.exchanges: dict[int, Exchange] = {}
        self.tunnels: dict[int, Tunnel] = {}
        """Connections whose bytes belong to a tunnel, not to HTTP: an HTTP/1.1 client after
        its 101, and every tunnel's backend connection (which leaves ``upstreams``)."""
        self.pool = Pool(self.fx, self.upstreams, self.new_upstream_id, self.defences)
        self._routers: dict[str, GroupRouter] = {}
        self.sessions = SessionSharing(self.fx, self.router, lambda: self._routers.values())
        """The memory of sessions shared with other workers and replicas (off by default)."""
        self.runtime = RuntimeState.empty()
        """The operator's server overrides (``RuntimeChanged``), applied to every router,
        also to those of a later configuration."""
        self.aliases = Aliases()
        """The model aliases' runtime weights and choices (``routing/aliases.py``)."""
        self._next_upstream = 0
        self._next_exchange = 0
        self.probes: dict[int, Probe] = {}
        """Health checks and load polls (``LoadPoll`` is a kind of ``Probe``)."""
        self._next_probe = 0
        self._admitting: set[GroupRouter] = set()
        """Routers whose queue is to be served once the current input is handled."""
        self.planted: FaultPlan | None = None
        """Faults a test planted (``faultplan.py``); None, and so consulted at no cost, but
        in tests."""
        self.kv = KvFeeds(self.fx, self.router)
        """The engines' KV-cache events and tokens (``kvfeeds.py``)."""
        self.isolation = Isolation(self)
        self.stop = Shutdown(self, self.isolation)
        self._dispatch: dict[type[Event], Callable[[Any], None]] = {
            DataReceived: self._data_received,
            DataSent: self._data_sent,
            ConnectionAccepted: self._accepted,
            ConnectionOpened: self._opened,
            OpenFailed: self._open_failed,
            ConnectionClosed: self._closed,
            InputEnded: self._input_ended,
            Wakeup: self._wakeup,
            ConfigChanged: self._config_changed,
            ShutdownRequested: self._shutdown,
            RuntimeChanged: self._runtime_changed,
            ResumeFetched: self._resume_fetched,
            ResumeProbed: self._resume_probed,
            BudgetAnswered: self._budget_answered,
            ExtensionAnswered: self._extension_answered,
            SessionsLearned: self.sessions.learn,
            **self.kv.handlers(),
        }

    # -- what the driver and embedders read ----------------------------------------------

    @property
    def config(self) -> Config:
        return self.fx.config

    @property
    def now(self) -> float:
        """The time of the last event (the driver's clock)."""
        return self.fx.now

    @property
    def limits(self) -> BufferLimits:
        return self.fx.limits

    @property
    def shutting_down(self) -> bool:
        """A graceful stop began (``shutdown.py``): no new requests are taken."""
        return self.fx.shutting_down

    def handle(self, event: Event) -> list[Command]:
        """Process one event; return the commands to carry out, in order."""
        fx = self.fx
        fx.now = event.now
        planted = self.planted
        try:
            if planted is not None:
                planted.reach(FaultPoint.BEFORE, event)
            self._dispatch[type(event)](event)
            if planted is not None:
                planted.reach(FaultPoint.AFTER, event)
        except Exception as exc:
            if self.raise_errors:
                fx.deferred.clear()
                raise
            fault = self._fault(event, exc)
            if fault is None:
                fx.deferred.clear()
                raise
            self.isolation.contain(fault)
        if fx.deferred:
            self._apply_deferred()
        if fx.shutting_down:
            self.stop.settle()
        out = fx.out
        fx.out = []
        return out

    def _apply_deferred(self) -> None:
        """What the parts asked for while the event was handled (``Effects.defer``: the
        ends of exchanges, closes), in order, and what that asks for in turn."""
        deferred = self.fx.deferred
        while deferred:
            conn, work = deferred.popleft()
            try:
                if self.planted is not None:
                    self.planted.reach(FaultPoint.DEFERRED, conn)
                work()
            except Exception as exc:
                if self.raise_errors:
                    deferred.clear()
                    raise
                self.isolation.contain(Fault(conn=conn, event="deferred", error=exc))

    def _fault(self, event: Event, exc: Exception) -> Fault | None:
        """The connection (or probe) that ``exc``, raised while handling ``event``, ends."""
        name = type(event).__name__
        if type(event) is Wakeup:
            owner = self._waking
            if isinstance(owner, Probe):
                upstream = owner.upstream
                conn = None
                if isinstance(upstream, UpstreamConn):
                    conn = upstream.conn
                elif isinstance(upstream, H2Stream):
                    conn = upstream.upstream.conn
                if conn is None:
                    return Fault(conn=None, probe=owner, event=name, error=exc)
                return Fault(conn=conn, event=name, error=exc)
            return None if owner is None else Fault(conn=owner, event=name, error=exc)
        if type(event) is ResumeProbed:
            stream = self.resumes.by_ident.get(event.stream)
            holder = stream.owner if stream is not None else None
            if isinstance(holder, Exchange):
                return Fault(conn=holder.client.conn, event=name, error=exc)
        if isinstance(event, ResumeFetched | BudgetAnswered | ExtensionAnswered):
            request = event.ask.request if isinstance(event, BudgetAnswered) else event.request
            exchange = self.exchanges.get(request)
            if exchange is not None:
                return Fault(conn=exchange.client.conn, event=name, error=exc)
        conn = getattr(event, "conn", None)
        return None if conn is None else Fault(conn=conn, event=name, error=exc)

    # -- the ports of the parts (ports.py: ExchangeHost, ClientHost, ProbeHost) -------------

    def new_upstream_id(self) -> int:
        self._next_upstream -= 1
        return self._next_upstream

    def new_exchange(self, client: ClientSide, head: RequestHead) -> Exchange:
        self._next_exchange += 1
        ident = self._next_exchange
        exchange: Exchange
        if wants_tunnel(head):
            # CONNECT and WebSocket handshakes become tunnels (tunnel.py) after their 101 / 200.
            exchange = WebSocketExchange(self.fx, self, client, head, ident, tunnels=self.tunnels)
        elif wants_resume(head.headers):
            exchange = ReplayExchange(self.fx, self, client, head, ident)
        else:
            exchange = Exchange(self.fx, self, client, head, ident)
        self.exchanges[ident] = exchange
        return exchange

    def exchange_finished(self, exchange: object) -> None:
        assert isinstance(exchange, Exchange)
        self.exchanges.pop(exchange.ident, None)
        if exchange.hooks is not None:
            exchange.hooks.finish(exchange)

    def client_closed(self, conn: int) -> None:
        self.clients.pop(conn, None)

    def stop_client(self, client: object) -> None:
        assert isinstance(client, Downstream)
        stop_client(client)

    def room_freed(self, router: GroupRouter) -> None:
        """``ExchangeHost.room_freed``: serve ``router``'s queue after the current input."""
        if router.queue and router not in self._admitting:
            self._admitting.add(router)
            self.fx.defer(0, lambda: self._admit_waiting(router))

    def _admit_waiting(self, router: GroupRouter) -> None:
        """Admit waiting exchanges while a server has room for them: of the next
        ``ADMIT_LOOKAHEAD`` in fair order, the first whose home server has room, else the
        fairest that may go anywhere (``admit.next_to_admit``); a fault in one ends its
        connection alone."""
        self._admitting.discard(router)
        queue, now = router.queue, self.fx.now
        while queue and (rooms := router.rooms(now)):
            exchange = next_to_admit(queue, rooms, now, _admission_of, ADMIT_LOOKAHEAD)
            if exchange is None:
                break  # only requests that wait for their full home alone: none may go now
            if not isinstance(exchange, Exchange):
                continue
            try:
                if exchange.admitted():
                    break  # no room for it after all: it waits again
            except Exception as exc:
                if self.raise_errors:
                    raise
                self.isolation.contain(
                    Fault(conn=exchange.client.conn, event="admitted", error=exc)
                )

    def _wake_queues(self) -> None:
        """Limits, weights or servers changed: who waits may go."""
        for router in self._routers.values():
            self.room_freed(router)

    def router(self, group: Upstream) -> GroupRouter:
        """The routing state of ``group``; kept while the group's servers stay the same.

        ``ConfigChanged`` carries each group's router over to its new configuration
        (``GroupRouter.reconfigure``). Only a group of the current configuration is
        installed: one of an older configuration (an exchange or probe that began before a
        reload) gets a router of its own, so it cannot replace the current state.
        """
        router = self._routers.get(group.name)
        if router is not None and (router.group is group or router.group == group):
            return router
        router = GroupRouter(group, self.runtime)
        if self.config.upstreams.get(group.name) == group:
            self._routers[group.name] = router
            self.sessions.attach(router)
        return router

    # -- event handlers --------------------------------------------------------------------

    def _data_received(self, event: DataReceived) -> None:
        conn = event.conn
        tunnel = self.tunnels.get(conn)
        if tunnel is not None:
            tunnel.on_data(conn, event.data)
            return
        if conn < 0:
            upstream = self.upstreams.get(conn)
            if upstream is not None:
                upstream.on_data(event.data)
        else:
            client = self.clients.get(conn)
            if client is not None:
                client.on_data(event.data)

    def _data_sent(self, event: DataSent) -> None:
        conn = event.conn
        if conn < 0:
            upstream = self.upstreams.get(conn)
            if upstream is not None:
                upstream.on_sent(event.nbytes)
            elif (tunnel := self.tunnels.get(conn)) is not None:
                tunnel.backend_sent(event.nbytes)
        else:
            client = self.clients.get(conn)
            if client is not None:
                client.on_sent(event.nbytes)

    def _accepted(self, event: ConnectionAccepted) -> None:
        if event.wall is not None:
            self.fx.date.set_wall(event.now, event.wall)
        ip = event.peer[0] if event.peer else "unknown"
        trusted = is_trusted(ip, event.trusted_proxies)
        client = Downstream(
            self.fx, self, event.conn, peer_ip=ip, tls=event.tls, alpn=event.alpn, trusted=trusted
        )
        self.clients[event.conn] = client
        if self.fx.shutting_down:
            refuse_client(client)

    def _opened(self, event: ConnectionOpened) -> None:
        upstream = self.upstreams.get(event.conn)
        if upstream is not None:
            upstream.on_opened()

    def _open_failed(self, event: OpenFailed) -> None:
        upstream = self.upstreams.get(event.conn)
        if upstream is not None:
            upstream.on_open_failed(event.reason)

    def _closed(self, event: ConnectionClosed) -> None:
        conn = event.conn
        if conn < 0:
            upstream = self.upstreams.get(conn)
            if upstream is not None:
                upstream.on_closed(event.error)
            elif (tunnel := self.tunnels.pop(conn, None)) is not None:
                tunnel.backend_closed(event.error)
        else:
            client = self.clients.get(conn)
            if client is not None:
                client.on_closed(event.error)

    def _input_ended(self, event: InputEnded) -> None:
        conn = event.conn
        tunnel = self.tunnels.get(conn)
        if tunnel is not None:
            # RFC 9293 §3.6: one direction ended; the tunnel relays it and the other goes on.
            tunnel.input_ended(conn)
            return
        # Not a tunnel: the peer's EOF ends the connection as it always has (its exchanges
        # end as for a close). The driver's ``ConnectionClosed`` that follows finds it
        # forgotten already.
        self.fx.close(conn)
        self._closed(ConnectionClosed(now=event.now, conn=conn))

    def _wakeup(self, event: Wakeup) -> None:
        timer = self.fx.fired(event.timer)
        if timer is None:
            return  # cancelled after the driver had already queued it
        self._waking = None
        kind, ident = timer
        match kind:
            case ExchangeTimer():
                exchange = self.exchanges.get(ident)
                if exchange is not None:
                    self._wake(exchange.client.conn, timer)
                    exchange.timer_fired(kind)
            case ClientTimer.GOAWAY:
                client = self.clients.get(ident)
                if client is not None:
                    self._wake(ident, timer)
                    self.stop.goaway_due(client)
            case ClientTimer():
                client = self.clients.get(ident)
                if client is not None:
                    self._wake(ident, timer)
                    client.timer_fired(kind)
            case BackendTimer():
                self._wake(ident, timer)
                self.pool.idle_timeout(ident)
            case ProbeTimer():
                probe = self.probes.get(ident)
                if probe is not None:
                    self._wake(probe, timer)
                    probe.timer_fired(kind)
            case CoreTimer.SESSIONS:
                self.sessions.due()
            case CoreTimer():
                self.stop.cut()
            case ResumeTimer():
                self.resumes.expired(ident)
            case _:
                assert_never(kind)

    def _wake(self, owner: int | Probe, timer: object) -> None:
        """``owner``'s timer fired: a fault from here on ends ``owner`` (``_fault``)."""
        self._waking = owner
        if self.planted is not None:
            self.planted.reach(FaultPoint.TIMER, timer)

    def _resume_fetched(self, event: ResumeFetched) -> None:
        """A batch of a resume answered from the shared store (``replay.py``)."""
        exchange = self.exchanges.get(event.request)
        if isinstance(exchange, ReplayExchange):
            exchange.fetched(event)
        elif event.state == "live":
            self.fx.emit(ResumeFetchCancel(request=event.request))  # its client is gone

    def _extension_answered(self, event: ExtensionAnswered) -> None:
        exchange = self.exchanges.get(event.request)
        hooks = exchange.hooks if exchange is not None else None
        if exchange is not None and hooks is not None and hooks.answered(exchange, event):
            placement.begin(exchange)

    def _budget_answered(self, event: BudgetAnswered) -> None:
        exchange = self.exchanges.get(event.ask.request)
        if exchange is not None:
            exchange.budget_answered(event)
        else:
            fleetadmit.give_back(self.fx, event)  # it ended meanwhile

    def _resume_probed(self, event: ResumeProbed) -> None:
        self.resumes.probed(event.stream, event.reading)

    def _config_changed(self, event: ConfigChanged) -> None:
        """A new configuration; also the driver's first event, which starts health checks."""
        fx = self.fx
        fx.apply(event.config)
        self.read_size = fx.read_size
        if event.wall is not None:
            fx.date.set_wall(event.now, event.wall)
        for probe in self.probes.values():
            probe.retire()
        self.probes.clear()
        routers: dict[str, GroupRouter] = {}
        for name, group in self.config.upstreams.items():
            router = self._routers.get(name)
            if router is not None:
                router = routers[name] = router.reconfigure(group, event.now)
                router.apply_runtime(self.runtime)
        self._routers = routers
        if not fx.shutting_down:  # a stopping proxy checks no health (shutdown.py)
            self._start_probes()
        self.kv.configured()
        self._wake_queues()
        fx.emit(Log(event="config_changed", fields={}))

    def _start_probes(self) -> None:
        for group in self.config.upstreams.values():
            kinds: list[type[Probe]] = []
            if group.health_check is not None:
                kinds.append(Probe)
            if group.load_report is not None:
                kinds.append(LoadPoll)
            if group.learn_models:
                kinds.append(ModelPoll)
            for kind in kinds:
                for index in range(len(group.servers)):
                    self._next_probe += 1
                    ident = self._next_probe
                    probe = self.probes[ident] = kind(self.fx, self, group, index, ident)
                    probe.schedule(0.0)

    def _runtime_changed(self, event: RuntimeChanged) -> None:
        """New runtime server state: the next decision of every group uses it; streams in
        flight stay where they are (``routing/router.py``)."""
        self.runtime = self.aliases.runtime = event.state
        for router in self._routers.values():
            router.apply_runtime(event.state)
        self._wake_queues()
        self.fx.emit(Log(event="runtime_changed", fields={"overrides": len(event.state.servers)}))

    def _shutdown(self, event: ShutdownRequested) -> None:
        """Graceful stop until ``event.deadline`` (``shutdown.py``); an earlier deadline in a
        later request moves it, one at or before ``now`` cuts at once."""
        self.stop.request(event.deadline)
        # Nobody can come back to a lingering stream of a process that stops.
        self.resumes.abandon_all("stopping: a lingering stream cannot be resumed here")

    @property
    def drained(self) -> bool:
        """Stopping, and no client connection, backend connection or tunnel is left: the
        driver may exit."""
        return (
            self.fx.shutting_down and not self.clients and not self.upstreams and not self.tunnels
        )

    # -- introspection ---------------------------------------------------------------------

    def status(self, now: float | None = None) -> dict[str, Any]:
        """The groups' servers as routing sees them now (weights, state, health, streams,
        work, load reports), their queues, models and refusals, and connection counts: the
        ``/status`` document (``docs/operations.md``). ``now``: the driver's clock (default:
        the last event's ``now``). Reads only."""
        at = self.now if now is None else now
        groups = {
            name: self.router(group).status(at) for name, group in self.config.upstreams.items()
        }
        measurements = self.measurements
        for name, group in self.config.upstreams.items():
            groups[name]["models"] = self.fx.models.status(group, at)
            if group.admits:
                stats = measurements.group(name)
                refused = {r: n for (g, r), n in measurements.refusals.items() if g == name}
                groups[name]["refused"] = refused
                groups[name]["reservations"] = stats.reservations
        return {
            "groups": groups,
            "clients": len(self.clients),
            "upstream_connections": len(self.upstreams),
            "streams": len(self.exchanges),
            "sessions": self.sessions.status(),
            "models": self.aliases.status(self.config.models),
        }

    def statistics(self) -> ProxyStatistics:
        """A snapshot of connections and of every stream's buffered bytes."""
        return take_statistics(self.clients, self.upstreams, self.exchanges.values(), self.pool)


def _admission_of(item: object) -> Admission | None:
    return item.admission if isinstance(item, Exchange) else None
