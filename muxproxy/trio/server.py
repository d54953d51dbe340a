"""The proxy's top level: listeners, TLS with ALPN, the driver, a graceful stop and a reload.

Obeys RFC 9113 §3.2 (h2 over TLS is chosen by ALPN "h2", RFC 7301; each listener's context
is ``servertls.py``'s) and leaves the plain listener's h1/h2c choice to the core, which sees the
connection preface. Every accepted socket gets TCP_NODELAY before its first byte is read.

``limits.max_client_connections`` bounds the connections served at once, over all listeners:
at the bound the accept loops stop calling ``accept`` until a connection ends. The kernel's
backlog holds the next ones, which costs us no memory, and a client waits instead of getting a
refusal it would retry at once (before its first bytes we could not even tell h1 from h2 to
answer it properly).

Theory of operation of the lifecycle (:class:`Phase`; nginx's semantics, which operators of
LLM fleets expect):

* ``SERVING``: every configured listener accepts. :meth:`ProxyServer.reload` swaps the
  configuration: new listeners are bound first, all or none (a port in use leaves everything
  as it was), then removed ones stop and close (the connections they accepted run on), and the
  core gets ``ConfigChanged`` (new requests see the new groups and routes).
* ``DRAINING``: after the first :meth:`ProxyServer.request_shutdown`. The accept loops stop at
  once and the sockets this process bound are closed, so new connections are refused by the
  kernel; sockets it adopted (``listen_sockets``, handed over by a supervisor that gives the
  same socket to the next process) are only no longer accepted on. The core gets
  ``ShutdownRequested(deadline=now + timeouts.shutdown_grace)``: it takes no new request and
  lets the running streams finish; the driver reports after each batch of commands, so a
  ``drained`` core is seen without polling.
* ``CUTTING``: the deadline passed, or a second ``request_shutdown``: the core gets
  ``ShutdownRequested(deadline=now)`` and cuts what is left.
* Either way, once drained (or ``FLUSH_TIME`` after the cut), the last client sockets get
  ``FLUSH_TIME`` to flush and close (lingering, see ``reactor.py``); then every task of the
  server is cancelled and :meth:`ProxyServer.run` returns: ``STOPPED``. Timers and health
  probes never keep it alive.
"""

from __future__ import annotations

import enum
import socket
import ssl
import time
from collections.abc import Callable, Mapping, Sequence

import attrs
import trio

from muxproxy.config import Config, Listener
from muxproxy.config.runtime import RuntimeState
from muxproxy.core import events
from muxproxy.core.commands import SessionsRemembered
from muxproxy.core.proxy import ProxyCore
from muxproxy.fleet.discovery import Target, with_discovered
from muxproxy.trio.discovery import Discovery
from muxproxy.trio.driver import Driver
from muxproxy.trio.listeners import (
    Address,
    ConnectionSlots,
    Listening,
    ListenSockets,
    adopt,
    bind_listeners,
    listener_keys,
    open_listeners,
)
from muxproxy.trio.logs import LogSink, configure_error_log
from muxproxy.trio.reactor import tune
from muxproxy.trio.servertls import server_ssl_context
from muxproxy.trio.sockets import set_nodelay

ACCEPT_BATCH = 256
"""Connections an accept loop takes per wake-up, at most, before letting other tasks run."""
FLUSH_TIME = 2.0
"""Seconds, after the core is drained (or cut), for the last client sockets to flush their
output and close (the reactor's linger is as long): bounded, so a client that never reads
cannot hold the stop."""


class Phase(enum.Enum):
    NEW = "new"
    """``run`` has not bound the listeners yet."""
    SERVING = "serving"
    DRAINING = "draining"
    """Stopping: no new connection or request; the running streams finish."""
    CUTTING = "cutting"
    """Stopping: what still runs is being cut (deadline passed, or asked twice)."""
    STOPPED = "stopped"


@attrs.frozen(kw_only=True)
class StopSummary:
    """How a stop went (``ProxyServer.stop_summary`` once ``run`` returned)."""

    in_flight: int
    """Streams running when the stop began."""
    cut: int
    """Streams still running when they were cut (at the deadline or on the second request)."""
    seconds: float
    """From the first ``request_shutdown`` to the end of ``run``."""
    forced: bool
    """A second ``request_shutdown`` cut the streams before the deadline."""


class ProxyServer:
    """The proxy on its listeners. ``core`` is the live ``ProxyCore`` (for ``statistics()``).

    ``listen_sockets`` maps a listener's configured address to already-listening sockets to
    adopt instead of binding (a supervisor hands them over); they are never closed here.
    """

    def __init__(
        self,
        config: Config,
        *,
        reuse_port: bool = False,
        raise_errors: bool | None = None,
        listen_sockets: ListenSockets | None = None,
        store_sessions: bool = True,
        discover: bool = True,
    ) -> None:
        """``raise_errors``: an internal error escapes and stops the server instead of ending
        the one connection it concerns (None: ``MUXPROXY_RAISE_ERRORS``, see ``ProxyCore``).
        ``store_sessions``: with ``[fleet] store``, share the memory of sessions through it
        (False: a worker, whose supervisor does, ``fleetsessions.py``). ``discover``: look up
        the groups with ``discover`` here (False: a worker, whose supervisor looks them up and
        hands the sets over, :meth:`apply_discovered`)."""
        self.config = config
        """The configuration running: the file's, with the discovered sets as the servers
        of the groups with ``discover``."""
        self.discovered: dict[str, tuple[Target, ...]] = {}
        """Each discovering group's last good set (``fleet/discovery.py``)."""
        self.discovery = Discovery(lambda: self.config, self._discovered) if discover else None
        self.reuse_port = reuse_port
        """Listen with ``SO_REUSEPORT``: a worker sharing its ports (``process/workers.py``)."""
        self.core = ProxyCore(config, raise_errors=raise_errors)
        self.driver: Driver | None = None
        self.phase = Phase.NEW
        self.generation = 1
        """1 at start, +1 per applied reload."""
        self.addresses: list[Address] = []
        """The bound (host, port) of every listening socket, in the configuration's order."""
        self.connection_slots = ConnectionSlots(config.limits.max_client_connections)
        """One slot per client connection being served (``limits.max_client_connections``)."""
        self.logs = LogSink(config.log, telemetry=config.telemetry)
        """The access and error logs (``[log]``); raises ``OSError`` for an access file that
        cannot be opened."""
        self.stop_summary: StopSummary | None = None
        self.store_sessions = store_sessions
        self.on_sessions: Callable[[SessionsRemembered], None] | None = None
        """Where the core's batches of remembered sessions go (``Driver.on_sessions``): a
        worker's control channel. Set before ``run``."""
        self._listen_sockets = listen_sockets or {}
        self._listening: list[Listening] = []
        self._nursery: trio.Nursery | None = None
        self._stop_requests = 0
        self._stop_begun = trio.Event()
        self._drained = trio.Event()
        self._stop_began = 0.0
        self._deadline = float("inf")
        self._grace_scope: trio.CancelScope | None = None
        self._in_flight_at_stop = 0
        self._in_flight = 0
        """Streams running at the last batch before the deadline (what a cut at it ends)."""
        self._cut: int | None = None
        self._forced = False
        self._core_configured = False
        """The core had its first ``ConfigChanged``: a new set is fed to it from then on."""

    # -- the public lifecycle ------------------------------------------------------------------

    async def run(
        self, *, task_status: trio.TaskStatus[list[Address]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until stopped: returns once a stop (:meth:`request_shutdown`) is complete.

        ``started`` gets the bound addresses. Raises ``OSError`` when a listener cannot be
        bound or its TLS pair loaded (nothing is left listening). Cancelling it stops at
        once, cutting every connection.
        """
        if self.phase is not Phase.NEW:
            raise RuntimeError("ProxyServer.run can be called once")
        configure_error_log(self.config.log.level)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                driver = self.driver = Driver(self.core, nursery)
                driver.sink = self.logs
                driver.on_sessions = self.on_sessions
                driver.start()
                if self.config.fleet is not None and self.store_sessions:
                    from muxproxy.trio.fleetsessions import attach_store

                    attach_store(self, nursery)
                if self.discovery is not None:
                    # Bounded by the resolver's timeout: the first requests find servers.
                    await self.discovery.first_round()
                    nursery.start_soon(self.discovery.run)
                # The core's first event: it arms what runs by itself (health checks).
                now = trio.current_time()
                driver.feed(events.ConfigChanged(now=now, config=self.config, wall=time.time()))
                self._core_configured = True
                self._listening = await self._open(self.config.listeners)
                for listening in self._listening:
                    nursery.start_soon(self._serve_listening, listening)
                self.addresses = self._bound_addresses()
                self.phase = Phase.SERVING
                task_status.started(list(self.addresses))
                if self._stop_requests:  # asked before the listeners were bound
                    requests, self._stop_requests = self._stop_requests, 0
                    for _ in range(requests):
                        self.request_shutdown()
                await self._stop_begun.wait()
                await self._drain()
                nursery.cancel_scope.cancel()
        finally:
            for listening in self._listening:
                self._stop_listening(listening, close=listening.owned)
            self.logs.close()
            self.phase = Phase.STOPPED

    def request_shutdown(self) -> None:
        """Stop: the first call gracefully within ``timeouts.shutdown_grace``, a later one
        cuts every stream now. ``run`` returns once the stop is complete. Never raises."""
        now = trio.current_time()
        match self.phase:
            case Phase.NEW:
                self._stop_requests += 1
            case Phase.SERVING:
                self.phase = Phase.DRAINING
                for listening in self._listening:
                    self._stop_listening(listening, close=listening.owned)
                self._stop_began = now
                self._deadline = now + self.config.timeouts.shutdown_grace
                self._in_flight_at_stop = self._in_flight = len(self.core.exchanges)
                driver = self.driver
                assert driver is not None
                # Before the event: feeding it may drain the core at once (nothing running).
                driver.on_settled = self._settled
                driver.feed(events.ShutdownRequested(now=now, deadline=self._deadline))
                self._stop_begun.set()
            case Phase.DRAINING:
                self._cut_now(now, forced=True)
            case Phase.CUTTING | Phase.STOPPED:
                pass

    def reload(
        self, config: Config, listen_sockets: ListenSockets | None = None
    ) -> list[tuple[Listener, Address]]:
        """Apply ``config`` (already validated); returns the listeners newly listened on.

        New listeners are bound (or adopted from ``listen_sockets``) first, all or none:
        raises ``OSError`` naming the listener, changing nothing, if one cannot be bound, a
        TLS pair cannot be loaded or the access log file cannot be opened. Then the TLS
        contexts of kept listeners are replaced (a renewed certificate at the same path is
        read again) for new connections, removed listeners stop and close (their
        connections run on), the core gets
        ``ConfigChanged`` and ``generation`` grows by one. Raises ``RuntimeError`` when the
        server is not serving (not started, or stopping).
        """
        if self.phase is not Phase.SERVING:
            raise RuntimeError(f"cannot reload: the server is {self.phase.value}")
        # The file has no servers for the groups it discovers: the last good sets stay.
        config = with_discovered(config, self.discovered)
        nursery, driver = self._nursery, self.driver
        assert nursery is not None and driver is not None
        current = dict(zip(listener_keys(self._listening), self._listening, strict=True))
        wanted = dict(zip(listener_keys(config.listeners), config.listeners, strict=True))
        contexts: dict[tuple[str, int], ssl.SSLContext | None] = {}
        added: dict[tuple[str, int], Listening] = {}
        try:
            for key, listener in wanted.items():
                if key in current:
                    contexts[key] = server_ssl_context(listener) if listener.tls else None
                else:
                    added[key] = self._open_now(listener, listen_sockets or {})
            # A new access log file (or the same path again, after log rotation).
            self.logs.reconfigure(config.log)
            self.logs.export_to(config.telemetry)
        except BaseException:
            for listening in added.values():
                self._stop_listening(listening, close=listening.owned)
            raise
        # Nothing can fail from here on.
        listenings: list[Listening] = []
        for key, listener in wanted.items():
            if key in added:
                listening = added[key]
                nursery.start_soon(self._serve_listening, listening)
            else:
                listening = current[key]
                listening.listener = listener
                listening.context = contexts[key]
            listenings.append(listening)
        for key, listening in current.items():
            if key not in wanted:
                # Closed even when adopted: nothing may queue connections nobody accepts.
                self._stop_listening(listening, close=True)
        self._listening = listenings
        self.addresses = self._bound_addresses()
        self.config = config
        self.connection_slots.resize(config.limits.max_client_connections)
        configure_error_log(config.log.level)
        driver.feed(events.ConfigChanged(now=trio.current_time(), config=config, wall=time.time()))
        self.generation += 1
        if self.discovery is not None:
            self.discovery.wake()  # a group's discover table may have changed
        return [
            (listening.listener, address)
            for listening in added.values()
            for address in listening.addresses()
        ]

    def apply_discovered(self, sets: Mapping[str, Sequence[Target]]) -> None:
        """Make ``sets`` (group -> its last good set) the servers of the discovering groups
        from the next request on (``ConfigChanged``: kept servers keep their state, new ones
        ramp in, vanished ones drain). Before ``run`` it only changes ``config``."""
        self.discovered.update((name, tuple(targets)) for name, targets in sets.items())
        config = with_discovered(self.config, self.discovered)
        if config is self.config:
            return
        self.config = config
        if self.driver is not None and self._core_configured:
            now = trio.current_time()
            self.driver.feed(events.ConfigChanged(now=now, config=config, wall=time.time()))

    async def _discovered(self, sets: Mapping[str, Sequence[Target]]) -> None:
        self.apply_discovered(sets)

    def apply_runtime(self, state: RuntimeState) -> None:
        """Use the operator's runtime server state ``state`` (whole, not a delta) from the
        next request on (``RuntimeChanged``); streams in flight are not moved. Before
        ``run`` the core takes it at once and keeps it for the configuration to come."""
        if self.driver is None:
            # Nothing runs yet (maybe no Trio either): the core keeps it; its Log is dropped.
            self.core.handle(events.RuntimeChanged(now=self.core.now, state=state))
        else:
            self.driver.feed(events.RuntimeChanged(now=trio.current_time(), state=state))

    def streams_in_flight(self) -> int:
        """Streams (exchanges) running now."""
        return len(self.core.exchanges)

    def reopen_access_log(self) -> None:
        """Open the access log file again at its path (after log rotation renamed it), as a
        reload does. Raises ``OSError`` and keeps writing to the old file if it cannot."""
        self.logs.reconfigure(self.logs.settings)

    # -- stopping ------------------------------------------------------------------------------

    async def _drain(self) -> None:
        with trio.move_on_at(self._deadline) as grace:
            self._grace_scope = grace
            await self._drained.wait()
        self._grace_scope = None
        if not self._drained.is_set() and self.phase is Phase.DRAINING:
            self._cut_now(trio.current_time(), forced=False)
        # The core closed every connection (or was told to cut them): what is left is the
        # kernel taking the last bytes, and lingering client sockets.
        with trio.move_on_after(FLUSH_TIME):
            await self._drained.wait()
            await self.connection_slots.wait_idle()
        # Not forced: what ran at the last batch before the deadline (0 when the core drained
        # before it; the core's own timer may have cut the rest before ``_cut_now``).
        cut = self._cut if self._cut is not None else self._in_flight
        self.stop_summary = StopSummary(
            in_flight=self._in_flight_at_stop,
            cut=cut,
            seconds=trio.current_time() - self._stop_began,
            forced=self._forced,
        )

    def _cut_now(self, now: float, *, forced: bool) -> None:
        self.phase = Phase.CUTTING
        self._forced = forced
        if forced:
            self._cut = len(self.core.exchanges)
        if self._grace_scope is not None:
            self._grace_scope.deadline = now
        driver = self.driver
        assert driver is not None
        driver.feed(events.ShutdownRequested(now=now, deadline=now))

    def _settled(self, now: float) -> None:
        """After each batch of commands while stopping (``Driver.on_settled``)."""
        core = self.core
        if now < self._deadline:
            self._in_flight = len(core.exchanges)
        if core.drained:
            self._drained.set()
            assert self.driver is not None
            self.driver.on_settled = None

    # -- listening -----------------------------------------------------------------------------

    async def _open(self, listeners: Sequence[Listener]) -> list[Listening]:
        """Bind or adopt every listener, or raise ``OSError`` leaving none bound."""
        opened: list[Listening] = []
        try:
            for listener in listeners:
                adopted = self._listen_sockets.get(listener.address)
                context = server_ssl_context(listener) if listener.tls else None
                if adopted:
                    opened.append(adopt(listener, context, adopted))
                    continue
                sockets = await open_listeners(
                    listener.host, listener.port, reuse_port=self.reuse_port
                )
                opened.append(
                    Listening(listener=listener, context=context, sockets=sockets, owned=True)
                )
        except BaseException:
            for listening in opened:
                self._stop_listening(listening, close=listening.owned)
            raise
        return opened

    def _open_now(self, listener: Listener, listen_sockets: ListenSockets) -> Listening:
        context = server_ssl_context(listener) if listener.tls else None
        adopted = listen_sockets.get(listener.address)
        if adopted:
            return adopt(listener, context, adopted)
        try:
            sockets = bind_listeners(listener.host, listener.port, reuse_port=self.reuse_port)
        except OSError as exc:
            error = OSError(f"cannot listen on {listener.address}: {exc.strerror or exc}")
            error.errno = exc.errno
            raise error from exc
        return Listening(listener=listener, context=context, sockets=sockets, owned=True)

    def _stop_listening(self, listening: Listening, *, close: bool) -> None:
        """Accept no more on ``listening``; ``close``: close its sockets too (the kernel
        refuses new connections from this instant)."""
        if listening.stopped:
            return
        listening.stopped = True
        listening.scope.cancel()
        if close:
            for sock in listening.sockets:
                trio.lowlevel.notify_closing(sock)
                sock.close()

    def _bound_addresses(self) -> list[Address]:
        return [address for listening in self._listening for address in listening.addresses()]

    async def _serve_listening(self, listening: Listening) -> None:
        with listening.scope:
            async with trio.open_nursery() as nursery:
                for sock in listening.sockets:
                    nursery.start_soon(self._accept_loop, sock, listening)

    async def _accept_loop(self, sock: socket.socket, listening: Listening) -> None:
        """Accept every connection that is waiting, up to ``ACCEPT_BATCH`` per wake-up.

        Like nginx's ``multi_accept``: under load this task runs once per round of the
        reactor, and one ``accept`` per round let new clients wait for seconds while the
        streams already open were served. ``listening.stopped`` is checked after every wait:
        a stop (which cancels this task) may come while it is already scheduled to run, and
        then must not take a connection a supervisor meant for another process.
        """
        slots = self.connection_slots
        batch = 0
        while True:
            try:
                slots.acquire_nowait()
            except trio.WouldBlock:
                await slots.acquire()
                if listening.stopped:
                    slots.release()
                    return
            try:
                client, _ = sock.accept()
            except BlockingIOError:
                slots.release()
                batch = 0
                try:
                    await trio.lowlevel.wait_readable(sock)
                except trio.ClosedResourceError:
                    return
                if listening.stopped:
                    return
                continue
            except OSError:
                slots.release()
                if listening.stopped:
                    return
                # EMFILE and friends: back off a little instead of spinning.
                await trio.sleep(0.1)
                continue
            except BaseException:
                slots.release()
                raise
            self._serve_accepted(client, listening.listener, listening.context)
            batch += 1
            if batch >= ACCEPT_BATCH:
                batch = 0
                await trio.lowlevel.checkpoint()
                if listening.stopped:
                    return

    def _serve_accepted(
        self, client: socket.socket, listener: Listener, context: ssl.SSLContext | None
    ) -> None:
        driver = self.driver
        assert driver is not None
        if context is not None or driver.reactor is None:
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(client))
            driver.nursery.start_soon(self._serve_client, stream, listener, context)
            return
        # Plain TCP: the reactor serves it; no task of its own.
        try:
            tune(client)
            peer = client.getpeername()
        except OSError:
            client.close()
            self.connection_slots.release()
            return
        ident = driver.new_client_id()
        driver.add_socket(ident, client, on_closed=self.connection_slots.release, linger=True)
        self._accepted(ident, listener, peer)

    async def _serve_client(
        self,
        stream: trio.SocketStream,
        listener: Listener,
        context: ssl.SSLContext | None,
    ) -> None:
        try:
            await self._serve_client_in_slot(stream, listener, context)
        finally:
            self.connection_slots.release()

    async def _serve_client_in_slot(
        self,
        stream: trio.SocketStream,
        listener: Listener,
        context: ssl.SSLContext | None,
    ) -> None:
        driver = self.driver
        assert driver is not None
        set_nodelay(stream)
        try:
            peer = stream.socket.getpeername()
        except OSError:
            await stream.aclose()
            return
        alpn: str | None = None
        client: trio.abc.Stream = stream
        if context is not None:
            tls = trio.SSLStream(stream, context, server_side=True)
            with trio.move_on_after(self.config.timeouts.client_header) as scope:
                try:
                    await tls.do_handshake()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    await stream.aclose()
                    return
            if scope.cancelled_caught:
                await stream.aclose()
                return
            alpn = tls.selected_alpn_protocol()
            client = tls
        ident = driver.new_client_id()
        conn = driver.register(ident, client)
        self._accepted(ident, listener, peer, tls=context is not None, alpn=alpn)
        await driver.run_connection(conn)

    def _accepted(
        self,
        ident: int,
        listener: Listener,
        peer: tuple[str, int],
        *,
        tls: bool = False,
        alpn: str | None = None,
    ) -> None:
        """Tell the core about client connection ``ident`` (registered with the driver)."""
        assert self.driver is not None
        self.driver.feed(
            events.ConnectionAccepted(
                now=trio.current_time(),
                conn=ident,
                listener=listener.address,
                peer=(peer[0], peer[1]),
                tls=tls,
                alpn=alpn,
                trusted_proxies=listener.trusted_proxies,
                wall=time.time(),
            )
        )


async def serve(
    config: Config,
    *,
    reuse_port: bool = False,
    task_status: trio.TaskStatus[list[Address]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the proxy for ``config`` until cancelled; ``started`` gets the bound addresses.

    ``reuse_port`` listens with ``SO_REUSEPORT``, so other processes can share the ports.
    """
    await ProxyServer(config, reuse_port=reuse_port).run(task_status=task_status)
