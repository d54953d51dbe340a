"""Listeners and the proxy's top-level task: accept, TLS with ALPN, run the driver.

Obeys RFC 9113 §3.2 (h2 over TLS is chosen by ALPN "h2", RFC 7301) and leaves the plain
listener's h1/h2c choice to the core, which sees the connection preface. Every accepted socket
gets TCP_NODELAY before its first byte is read.

``limits.max_client_connections`` bounds the connections served at once, over all listeners:
at the bound the accept loops stop calling ``accept`` until a connection ends. The kernel's
backlog holds the next ones, which costs us no memory, and a client waits instead of getting a
refusal it would retry at once (before its first bytes we could not even tell h1 from h2 to
answer it properly).
"""

from __future__ import annotations

import os
import socket
import ssl
import time

import trio

from ..config import Config, Listener
from ..config.runtime import RuntimeState
from ..core.events import ConfigChanged, ConnectionAccepted, RuntimeChanged
from ..core.proxy import ProxyCore
from .driver import Driver, set_nodelay
from .listeners import open_listeners
from .logs import LogSink, configure_error_log
from .reactor import tune


def server_ssl_context(listener: Listener) -> ssl.SSLContext:
    """The TLS context of ``listener``. Raises ``OSError`` naming both files when the pair
    cannot be loaded (the configuration loaders check it first; this is the file changing
    in between), rather than OpenSSL's ``[SSL] PEM lib`` that names neither."""
    assert listener.tls_cert is not None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(listener.tls_cert, listener.tls_key, password=_no_password)
    except (OSError, ValueError) as exc:
        raise OSError(
            f"cannot load the TLS certificate {listener.tls_cert!r} and key"
            f" {listener.tls_key!r} of {listener.address}: {exc}"
        ) from exc
    # RFC 9113 §3.2: "h2" over TLS; http/1.1 for everyone else.
    context.set_alpn_protocols(["h2", "http/1.1"])
    # RFC 9113 §9.2: TLS 1.2 or later for HTTP/2.
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _no_password() -> str:
    # Never OpenSSL's interactive prompt for an encrypted key: a server must not wait on a
    # terminal (the configuration loaders refuse encrypted keys).
    raise ValueError("the private key is encrypted; muxproxy needs it unencrypted")


ACCEPT_BATCH = 256
"""Connections an accept loop takes per wake-up, at most, before letting other tasks run."""


class ProxyServer:
    """The proxy on its listeners. ``core`` is the live ``ProxyCore`` (for ``statistics()``)."""

    def __init__(
        self, config: Config, *, reuse_port: bool = False, raise_errors: bool | None = None
    ) -> None:
        """``raise_errors``: an internal error escapes and stops the server instead of ending
        the one connection it concerns (None: ``MUXPROXY_RAISE_ERRORS``, see ``ProxyCore``)."""
        self.config = config
        self.reuse_port = reuse_port
        """Listen with ``SO_REUSEPORT``: a worker sharing its ports (:mod:`muxproxy.workers`)."""
        self.core = ProxyCore(config, raise_errors=raise_errors)
        self.driver: Driver | None = None
        self.addresses: list[tuple[str, int]] = []
        self.connection_slots = trio.Semaphore(config.limits.max_client_connections)
        """One token per client connection being served (``limits.max_client_connections``)."""
        self.logs = LogSink(config.log)
        """The access and error logs (``[log]``); raises ``OSError`` for an access file that
        cannot be opened."""

    async def run(
        self, *, task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        configure_error_log(self.config.log.level)
        try:
            await self._run(task_status)
        finally:
            self.logs.close()

    async def _run(self, task_status: trio.TaskStatus[list[tuple[str, int]]]) -> None:
        async with trio.open_nursery() as nursery:
            driver = self.driver = Driver(self.core, nursery)
            driver.sink = self.logs
            driver.start()
            # The core's first event: it arms what runs by itself (health checks).
            driver.feed(
                ConfigChanged(now=trio.current_time(), config=self.config, wall=time.time())
            )
            for listener in self.config.listeners:
                tcp_listeners = await open_listeners(
                    listener.host, listener.port, reuse_port=self.reuse_port
                )
                context = server_ssl_context(listener) if listener.tls else None
                for tcp in tcp_listeners:
                    host, port = tcp.socket.getsockname()[:2]
                    self.addresses.append((host, port))
                    nursery.start_soon(self._accept_loop, tcp, listener, context)
            task_status.started(list(self.addresses))

    def apply_runtime(self, state: RuntimeState) -> None:
        """Use the operator's runtime server state ``state`` (whole, not a delta) from the
        next request on (``RuntimeChanged``); streams in flight are not moved. Before
        ``run`` the core takes it at once and keeps it for the configuration to come."""
        if self.driver is None:
            # Nothing runs yet (maybe no Trio either): the core keeps it; its Log is dropped.
            self.core.handle(RuntimeChanged(now=self.core.now, state=state))
        else:
            self.driver.feed(RuntimeChanged(now=trio.current_time(), state=state))

    async def _accept_loop(
        self,
        tcp: trio.SocketListener,
        listener: Listener,
        context: ssl.SSLContext | None,
    ) -> None:
        """Accept every connection that is waiting, up to ``ACCEPT_BATCH`` per wake-up.

        Like nginx's ``multi_accept``: under load this task runs once per round of the
        reactor, and one ``accept`` per round let new clients wait for seconds while the
        streams already open were served.
        """
        slots = self.connection_slots
        sock = tcp.socket
        raw = socket.socket(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno()))
        raw.setblocking(False)
        async with tcp:
            with raw:
                batch = 0
                while True:
                    try:
                        slots.acquire_nowait()
                    except trio.WouldBlock:
                        await slots.acquire()
                    try:
                        client, _ = raw.accept()
                    except BlockingIOError:
                        slots.release()
                        batch = 0
                        await trio.lowlevel.wait_readable(raw)
                        continue
                    except OSError:
                        # EMFILE and friends: back off a little instead of spinning.
                        slots.release()
                        await trio.sleep(0.1)
                        continue
                    except BaseException:
                        slots.release()
                        raise
                    self._serve_accepted(client, listener, context)
                    batch += 1
                    if batch >= ACCEPT_BATCH:
                        batch = 0
                        await trio.lowlevel.checkpoint()

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
            ConnectionAccepted(
                now=trio.current_time(),
                conn=ident,
                listener=listener.address,
                peer=(peer[0], peer[1]),
                tls=tls,
                alpn=alpn,
                wall=time.time(),
            )
        )


async def serve(
    config: Config,
    *,
    reuse_port: bool = False,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the proxy for ``config`` until cancelled; ``started`` gets the bound addresses.

    ``reuse_port`` listens with ``SO_REUSEPORT``, so other processes can share the ports.
    """
    await ProxyServer(config, reuse_port=reuse_port).run(task_status=task_status)
