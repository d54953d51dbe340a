"""Ports: what each part of the core sees of the parts it talks to, as ``typing.Protocol``.

The parts of the core never hold each other's concrete classes; each holds the ``Effects`` of
its core (``effects.py``: clock, limits, commands, timers) and the narrow interfaces below.
Only ``proxy.py`` builds the concrete parts and wires them; the owner's helpers ``faults.py``
and ``shutdown.py`` act on every part at once and so know them too (``tables.py``), as does
``websocket.py``, which turns a backend stream of either kind into a tunnel's backend. So the import
graph of ``muxproxy/core`` has no cycle, and a part can be driven in a test by anything that
has the shape its port names.

- ``ClientSide``: a client connection as its owner hands it to an exchange (``Downstream``
  implements it), built from what each user needs of it: ``RequestSource`` (a request body's
  or a tunnel's flow), ``ResponseSink`` (the response bytes), ``Answerer`` (``heads.py``),
  ``ClientPeer``, ``ExchangeClient`` (an exchange's response, or a resumable stream's reader),
  ``TunnelClient``, and ``Http1Upgrade`` (the HTTP/1.1 side alone);
- ``ClientStream``: an exchange as its client connection sees it (``Exchange``);
- ``UpstreamStream``: one request/response on a backend, whatever its protocol, as an exchange
  or a probe sees it (``pool.UpstreamConn``: a whole HTTP/1.1 connection; ``h2pool.H2Stream``:
  one stream of a shared HTTP/2 connection);
- ``UpstreamUser``: whoever a backend stream talks to (an exchange, a health probe);
- ``BackendConnection``: a backend connection as the core hands it driver events;
- ``Backends``: the pool, as those who need a backend stream see it;
- ``ServerHost``, ``ClientHost``, ``ProbeHost``: what a failover, a client connection and a
  probe need of their owner (``ProxyCore``), besides the effects (an exchange's own host,
  and what the exchange's helpers see of it, are ``exchangeports.py``'s).

Also here: the phases of an exchange, which both sides read.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Protocol

from muxproxy.config import Api, Route, Upstream
from muxproxy.core.commands import Origin
from muxproxy.core.http.bodyclock import SlowBody
from muxproxy.core.http.errors import ErrorShape
from muxproxy.core.messages import AnswerRewrite, Fields, Headers, RequestHead, ResponseHead

if TYPE_CHECKING:
    from muxproxy.core.observe.defencelog import DefenceLog
    from muxproxy.core.observe.measure import Measurements
    from muxproxy.routing.router import GroupRouter


class Phase(enum.Enum):
    """Where an exchange is, on its response side (its table: ``exchange_states.py``)."""

    # Members are singletons, equal only to themselves: hashed by identity, a table lookup
    # runs no Python code (``Enum.__hash__`` hashes the name in Python).
    __hash__ = object.__hash__

    BUFFERING = "buffering"
    """Holding the start of the request body to find a session key in it."""
    RESERVING = "reserving"
    """Waiting for the fleet store's answer to its budget reservation (``fleetadmit.py``;
    request body bytes are held, bounded, as while CONNECTING)."""
    QUEUED = "queued"
    """Routed, waiting in the group's admission queue for a server with room (request body
    bytes are held, bounded, as while CONNECTING)."""
    AWAITING_HOOK = "awaiting_hook"
    """Waiting for an extension's async request-head hook (``hooked.py``; request body bytes
    are held, bounded, as while CONNECTING)."""
    CONNECTING = "connecting"
    """Waiting for a backend connection; request body bytes are held (bounded)."""
    WAITING_HEAD = "waiting_head"
    """The request head went to the backend; waiting for its response head."""
    HOLDING = "holding"
    """An SSE response head is held until the first event (``retry_until_first_event``)."""
    STREAMING = "streaming"
    """The response head went to the client; body chunks are relayed as they come."""
    DONE = "done"


class RequestPhase(enum.Enum):
    """Where an exchange is, on its request side."""

    BODY = "body"
    COMPLETE = "complete"


# -- between a client connection and its exchanges ----------------------------------------


class ClientStream(Protocol):
    """An exchange as its client connection sees it."""

    stream: int
    phase: Phase
    route: Route | None
    status: int
    bytes_out: int
    request_id: bytes

    @property
    def request(self) -> RequestPhase: ...
    @property
    def request_size(self) -> int:
        """Request body bytes taken so far (``limits.max_request_body``)."""

    def start(self) -> None: ...
    def watch_request_body(self) -> None: ...
    def request_body(self, data: bytes, flow_len: int) -> None: ...
    def request_end(self, trailers: Headers) -> None: ...
    def client_aborted(self, reason: str) -> None: ...
    def client_drained(self) -> None:
        """The client connection's output went below ``low_water``: resume if this stream's
        own flow allows (``Exchange.client_drained``)."""

    def client_stalled(self) -> bool:
        """The client connection is above ``connection_buffer``: stop the backend of this
        stream; True if it was running (then the connection holds this stream until it
        drains, ``ClientSide.hold``)."""


class RequestSource(Protocol):
    """A client connection as the source of a request body or a tunnel's upstream bytes: what
    flow control (``flow.py``) stops, resumes and gives credit back to (``upload.py``,
    ``tunnel.py``)."""

    def acknowledge(self, stream: int, nbytes: int) -> None:
        """HTTP/2: the request body bytes of ``stream`` moved on: open the client's window."""

    def pause_source(self) -> None:
        """Stop reading the client (HTTP/1.1; an HTTP/2 client is held by its window)."""

    def resume_source(self) -> None: ...


class ResponseSink(Protocol):
    """A client connection as the sink of a stream's response bytes: what they are written to
    and what holds a backend stopped while the connection is behind."""

    @property
    def congested(self) -> bool:
        """Output above half of ``connection_buffer`` while some backend is held: no held
        backend resumes yet."""

    def buffered(self, stream: int) -> int:
        """Bytes of ``stream``'s response held here and not yet written to the socket."""

    def send_body(self, stream: int, data: bytes) -> None: ...
    def send_end(self, stream: int, trailers: Headers) -> None: ...
    def abort(self, stream: int) -> None:
        """End ``stream``'s response visibly unfinished (RST_STREAM; an HTTP/1.1 close)."""

    def hold(self, stream: ClientStream) -> None:
        """``stream``'s backend is stopped because this connection is behind; call its
        ``client_drained`` once the output drains."""

    def release(self, stream: ClientStream) -> None: ...
    def holds(self, stream: ClientStream) -> bool: ...


class ClientPeer(Protocol):
    """Who a client connection's peer is, as the fields sent to a backend name it
    (``heads.backend_fields``)."""

    peer_ip: str
    scheme: bytes
    trusted: bool
    """The peer is a proxy the listener trusts (``forwarded.py``)."""


class Answerer(Protocol):
    """A client connection as whoever answers a request sees it (``heads.py``): the response
    head, or the proxy's own short answer."""

    def send_head(self, head: ResponseHead, *, end_stream: bool = False) -> None: ...
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
    ) -> int: ...


class ExchangeClient(ResponseSink, Answerer, ClientPeer, Protocol):
    """A client connection as an exchange's response sees it: what its answer is written to.
    Also who a resumable stream's owner writes to once its first client is gone
    (``readers.py``), so nothing of the request side is here: the request is whole by then,
    and its body's source is the ``RequestSource`` the exchange was made with (``upload.py``)."""

    conn: int

    @property
    def is_h2(self) -> bool: ...

    def refuse_slow_body(
        self, stream: int, slow: SlowBody, *, api: Api | None, request_id: bytes
    ) -> int | None:
        """The request body of ``stream`` is too ``slow`` (``bodyclock.py``): answer 408
        (returns its body bytes) or reset the stream (HTTP/2, None): ``refusals.slow_body``."""

    def exchange_finished(self, stream: ClientStream) -> None:
        """``stream`` is over: the connection takes the next request, goes idle or closes,
        after the current event."""


class RequestClient(ExchangeClient, RequestSource, Protocol):
    """A client connection as a new exchange sees it: the sink of its response and the source
    of its request body."""


class TunnelClient(ResponseSink, RequestSource, Protocol):
    """A client connection as a byte tunnel's client side (``tunnel.py``): on HTTP/2 the
    tunnel's stream; an HTTP/1.1 connection's raw bytes go through its ``Http1Upgrade``."""

    conn: int
    scheme: bytes

    def request_close(self) -> None:
        """Close the connection once its output is written, after the current event."""

    def keep_receiving(self, stream: int) -> None:
        """HTTP/2: the request side of ``stream`` still reaches its exchange after the
        response ends."""


class Http1Upgrade(Protocol):
    """An HTTP/1.1 client connection switching protocols (RFC 9110 §7.8): only that side has
    one (``ClientSide.http1_upgrade``); HTTP/2 has no Upgrade (RFC 9113 §8.6)."""

    def switch_protocols(self, headers: Headers) -> bytes:
        """Send the 101 with ``headers`` (RFC 9110 §15.2.2) and hand back the bytes the client
        sent after its request, which belong to the new protocol."""

    def send_raw(self, data: bytes) -> None:
        """Bytes for the socket as they are, through the connection's own accounting (pending
        bytes, send timeout), once h11 has switched protocols and has no say any more."""


class ClientSide(RequestClient, TunnelClient, Protocol):
    """A client connection as its owner hands it to the exchanges it carries (``ClientHost``):
    all of the narrower views above; each user keeps only the one it needs."""

    def http1_upgrade(self) -> Http1Upgrade | None:
        """The connection's ``Http1Upgrade`` on HTTP/1.1; None on HTTP/2."""


# -- between an exchange (or probe) and its backend ---------------------------------------


class UpstreamUser(Protocol):
    """What a backend connection talks to: an exchange, or a health probe."""

    def upstream_ready(self, upstream: UpstreamStream) -> None: ...
    def upstream_drained(self) -> None: ...
    def response_head(self, head: ResponseHead) -> None: ...
    def response_body(self, data: bytes) -> None: ...
    def response_end(self, trailers: Headers) -> None: ...
    def upstream_failed(self, reason: str, *, timeout: bool = False, stale: bool = False) -> None:
        """The backend stream failed. ``stale``: on a reused keep-alive connection, before any
        response byte arrived (RFC 9112 §9.3.1: the backend may have closed it while we picked
        it), or an HTTP/2 stream above a GOAWAY's last_stream_id (RFC 9113 §8.7: never
        processed), so a retry on a fresh connection to the same server is safe to consider."""


class UpstreamStream(Protocol):
    """One request/response on a backend, whatever the protocol: what an exchange talks to.

    ``UpstreamConn`` (HTTP/1.1, the whole connection) and ``h2pool.H2Stream`` (one stream of a
    shared HTTP/2 connection) implement it.
    """

    exchange: UpstreamUser | None
    http_version: bytes

    @property
    def pending(self) -> int:
        """Request bytes taken from the exchange and not yet written to the backend."""

    @property
    def paused(self) -> bool: ...

    @property
    def written(self) -> bool:
        """Some byte of the request may have reached the backend (False: it can be sent again
        elsewhere, whatever its method)."""

    def send_head(self, stream: int, method: bytes, target: bytes, headers: Headers) -> None: ...
    def send_body(self, data: bytes) -> None: ...
    def send_end(self, trailers: Headers) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def close(self) -> None:
        """Abandon the request (h1: close the connection; h2: RST_STREAM(CANCEL))."""

    def release(self) -> None:
        """The exchange completed cleanly: the connection may carry another request."""


class BackendConnection(Protocol):
    """A backend connection as ``ProxyCore`` dispatches driver events to it."""

    conn: int

    def on_opened(self) -> None: ...
    def on_open_failed(self, reason: str) -> None: ...
    def on_data(self, data: bytes) -> None: ...
    def on_sent(self, nbytes: int) -> None: ...
    def on_closed(self, error: str | None) -> None: ...
    def on_timer(self) -> None: ...
    def close(self) -> None: ...


class Backends(Protocol):
    """The pool of backend connections, as its users see it."""

    def acquire(
        self, origin: Origin, group: Upstream, user: UpstreamUser, *, fresh: bool = False
    ) -> None:
        """Call ``user.upstream_ready`` with a stream to ``origin`` (now or later), or
        ``user.upstream_failed``. ``fresh``: a new connection, never a pooled one."""

    def forget(self, user: UpstreamUser) -> None:
        """``user`` waits no more for the stream it asked for."""


# -- what the parts need of their owner ---------------------------------------------------


class ServerHost(Protocol):
    """What the servers of an exchange's group need of the core that runs it (``failover.py``)."""

    @property
    def pool(self) -> Backends: ...
    @property
    def measurements(self) -> Measurements: ...
    def router(self, group: Upstream) -> GroupRouter: ...
    def room_freed(self, router: GroupRouter) -> None:
        """A stream left one of ``router``'s servers: admit who waits there, after the
        current input."""


class ClientHost(Protocol):
    """What a client connection needs of the core that runs it."""

    @property
    def defences(self) -> DefenceLog: ...
    def new_exchange(self, client: ClientSide, head: RequestHead) -> ClientStream: ...
    def client_closed(self, conn: int) -> None: ...
    def stop_client(self, client: object) -> None:
        """A connection that chose its protocol after a graceful stop began: stop it too."""


class ProbeHost(Protocol):
    """What a health probe needs of the core that runs it."""

    @property
    def pool(self) -> Backends: ...
    def router(self, group: Upstream) -> GroupRouter: ...
    def room_freed(self, router: GroupRouter) -> None:
        """A server's health or load changed: admit who waits, after the current input."""
