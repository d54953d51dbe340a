"""The configuration records the core reads: frozen attrs classes, no validation.

Every record is frozen: a new configuration is a new object (``ConfigChanged``), never a
mutation under a running exchange. Durations are seconds (float), sizes bytes (int). The
records carry no validators: code may build them directly (tests do, with port 0 and tiny
timeouts); validation is the job of :mod:`muxproxy.config.loading`."""

from __future__ import annotations

import enum
import ipaddress

import attrs

from muxproxy.config.discovery import Discover
from muxproxy.config.extensions import ExtensionConfig
from muxproxy.config.fleet import FleetSettings, ResolverSettings
from muxproxy.config.kvevents import KvEvents
from muxproxy.config.logsettings import LogSettings
from muxproxy.config.queue import AdmissionQueue
from muxproxy.config.routes import (
    RESUME_CREDENTIALS,
    RESUME_WINDOW,
    Api,
    ModelAlias,
    ModelTarget,
    Resume,
    Route,
    RouteTable,
)
from muxproxy.config.telemetry import TelemetrySettings

__all__ = [
    "RESUME_CREDENTIALS",
    "RESUME_WINDOW",
    "Api",
    "ModelAlias",
    "ModelTarget",
    "Resume",
    "Route",
]


class _HostPort:
    """``host`` and ``port`` of a record's ``address`` (``"host:port"``, ``"[::1]:port"``),
    as validated by the loader (:func:`muxproxy.config.checker.address_problem`)."""

    __slots__ = ()
    address: str

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


@attrs.frozen(kw_only=True)
class Timeouts:
    connect: float = 5.0
    """Seconds to establish an upstream TCP (and TLS) connection."""
    response_head: float = 60.0
    """Seconds from the request being sent upstream (its body complete) to the response head
    arriving. Time in which the proxy does not read the backend, because the client is behind,
    is not counted: the timeout counts afresh once it reads again, and such a wait never
    counts against the server's health."""
    read: float = 300.0
    """Longest idle gap between two upstream body chunks (not counting time in which the proxy
    does not read the backend, as for ``response_head``)."""
    send: float = 60.0
    """Longest time a connection may have unsent output without any of it being written."""
    client_header: float = 30.0
    """Seconds a client has to send a complete request head (from the connection's start, or
    from the first byte of a later head); also the longest gap in a request body."""
    client_body: float = 60.0
    """Seconds a client has to send a whole request body, from its request head (time in
    which the proxy does not take the body, because the backend is behind, not counted).
    Past it: 408 (RFC 9110 §15.5.9; on HTTP/1.1 the connection closes). The gap bound
    (``client_header``) alone never cuts a body trickled one byte at a time just under it,
    which holds a backend slot as long as it lasts; Apache bounds the whole body too
    (``mod_reqtimeout``), nginx only its gaps. LLM request bodies are prompts, a few MiB at
    most, that any real client sends in well under a second: 60 s (nginx's
    ``client_body_timeout`` default) leaves room for a slow link; raise it for large
    uploads."""
    keepalive_idle: float = 75.0
    """Seconds an idle client connection is kept open between requests."""
    tunnel_idle: float = 3600.0
    """Seconds a WebSocket tunnel may carry no byte either way before both sides are closed."""
    shutdown_grace: float = 30.0
    """Seconds a graceful stop (SIGTERM, SIGINT, SIGQUIT) lets running streams finish, once
    new connections and requests are refused; what still runs then is cut. A token stream
    of a reasoning model runs for minutes: raise it where deploys must cut none."""


@attrs.frozen(kw_only=True)
class Limits:
    stream_buffer: int = 256 * 1024
    """Bytes one stream may hold in the proxy (accepted from its source, not yet sent on)."""
    max_concurrent_streams: int = 100
    """SETTINGS_MAX_CONCURRENT_STREAMS advertised to HTTP/2 clients."""
    max_request_head: int = 64 * 1024
    """Largest request head (HTTP/1.1 request line + fields; HTTP/2: advertised as
    SETTINGS_MAX_HEADER_LIST_SIZE). Past it: 431 on HTTP/1.1 (RFC 6585 §5). LLM API requests
    carry a few hundred bytes of fields; 64 KiB leaves room for large cookies and tokens."""
    max_header_fields: int = 128
    """Most fields in one request head (after HTTP/2 cookie crumbs, before joining). Past it:
    431 (RFC 6585 §5). Each field costs a tuple and a lookup per hop; a head of thousands of
    one-byte fields fits in ``max_request_head`` and costs far more than its bytes."""
    max_request_body: int = 64 * 1024 * 1024
    """Most request-body bytes relayed for one request. A Content-Length above it is a 413
    before anything is forwarded; a body without one that grows past it ends in 413 (when no
    response began) or a reset / close. 64 MiB holds a long-context prompt with images; it is
    not a memory bound (``stream_buffer`` is), it bounds what one request can make a GPU read."""
    max_client_connections: int = 10_000
    """Client connections served at once per proxy process. Past it the listeners stop
    accepting until one closes: new connections wait in the kernel's accept backlog, costing
    the proxy nothing (no answer could be sent anyway before knowing h1 from h2). 10,000
    streams x ~15-30 KiB is a few hundred MB; raise with the file-descriptor limit."""
    h2_connection_window: int = 16 * 1024 * 1024
    """The connection-level receive window opened to each HTTP/2 client (RFC 9113 §6.9.2),
    65,535 to 2**31-1. It must exceed one stream's window so that a stalled stream cannot
    starve the others; what a client can make us hold is still bounded by the stream windows
    (``stream_buffer``), so this bounds only the sum a client may have in flight."""
    connection_buffer: int = 1024 * 1024
    """Bytes of output one client connection may have handed to the socket and not yet seen
    written. Past it every backend feeding the connection is paused; they resume once it is
    at or below half (and each stream at or below its low water). See ``core/client/output.py``."""
    h2_reset_budget: int = 100
    """HTTP/2 streams a client may reset before their response is complete, beyond those paid
    back by completed responses (one each), before GOAWAY(ENHANCE_YOUR_CALM): rapid reset,
    CVE-2023-44487. See ``muxproxy.core.http2.h2guard``."""
    h2_control_frame_budget: int = 1000
    """HTTP/2 SETTINGS / PING / PRIORITY / WINDOW_UPDATE / empty DATA frames a client may send
    beyond those paid back by responses, before GOAWAY(ENHANCE_YOUR_CALM)."""
    resume_memory: int = 512 * 1024 * 1024
    """Bytes the resumable streams of one process may keep in all (routes with ``resume``).
    Past it the streams nobody reads are let go, oldest first (their backends ended), so a
    flood of clients that never come back cannot exhaust memory; streams being read are
    never cut for it. See ``muxproxy.core.streams.resume``."""
    max_route_body: int = 64 * 1024
    """Request-body bytes held, at most, to read the ``model`` a request is routed by (routes
    with ``models``, ``[models]`` aliases); a body that names none within them is routed by
    path. Held bytes count against ``stream_buffer`` too: the smaller bound wins."""


@attrs.frozen(kw_only=True)
class Server(_HostPort):
    address: str
    """``host:port`` of the backend."""
    weight: int = 1
    """Share of new (unkeyed and keyed) requests; 0 drains: pinned sessions stay, no new ones."""
    max_fails: int = 1
    """Failures within ``fail_timeout`` that take the server out (0: never)."""
    fail_timeout: float = 10.0
    """The window for counting failures, and how long a failed server stays out."""
    backup: bool = False
    """Used only when every primary server of the group is unusable."""
    protocol: str = "h1"
    """``"h1"`` (HTTP/1.1, a keep-alive pool) or ``"h2"`` (h2c with prior knowledge, or TLS
    with ALPN h2 when ``tls``: streams of every client multiplexed onto shared connections)."""
    max_connections: int = 4
    """h2 only: connections opened to this server at most; past them requests wait (bounded)."""
    tls: bool = False
    """Speak TLS to the backend (ALPN offers "h2" or "http/1.1" to match ``protocol``)."""
    tls_ca: str | None = None
    """CA bundle that verifies the backend's certificate; None: the system's trust store."""
    tls_server_name: str | None = None
    """Name checked against the certificate and sent as SNI; None: the host of ``address``."""
    max_streams: int | None = None
    """Admission control: streams this server runs at once at most; a request that finds
    every candidate full waits in the group's ``queue``. None: no limit."""
    max_waiting: int | None = None
    """Admission control, with ``load_report``: the server counts as full while the engine
    reports this many requests waiting in its own queue (or more). None: no limit."""
    kv_events: str | None = None
    """Where this server's engine publishes its KV-cache events, ``"tcp://host:port"``, when
    not at the group's ``kv_events.port`` on the server's own host."""


class Balance(enum.Enum):
    ROUND_ROBIN = "round_robin"
    """Smooth weighted round-robin (nginx's algorithm)."""
    LEAST_STREAMS = "least_streams"
    """Fewest active streams relative to weight."""
    LEAST_LOAD = "least_load"
    """Power of two choices by outstanding work relative to weight: the tokens each server's
    streams are still expected to generate, plus the queue its engine reports
    (``routing/load.py``)."""


class AffinityMode(enum.Enum):
    NONE = "none"
    PREFIX = "prefix"
    """Requests whose prompts share their leading part go to the same server (its KV cache
    holds the prefix), by consistent hashing with bounded loads (``routing/load.py``)."""


PROMPT_SOURCES = ("auto", "messages", "prompt")


@attrs.frozen(kw_only=True)
class PrefixAffinity:
    """``affinity = "prefix"``: what the prefix key is made of, and how loaded a server may be."""

    source: str = "auto"
    """``"messages"``: the system (and developer) messages and the first user message of a
    chat request; ``"prompt"``: a completion request's ``prompt``; ``"auto"``: whichever the
    request has."""
    length: int = 1024
    """Bytes of each part of that text (UTF-8) the key covers: the system part's first
    ``length`` bytes and the first user turn's first ``length`` bytes, so a system prompt
    longer than this does not key all its users together; a conversation keeps its key on
    every later turn."""
    load_factor: float = 1.25
    """The bound of consistent hashing with bounded loads: a server takes a new key only
    while its streams are under ``load_factor`` x the (weighted) mean; at least 1. A server
    with a free slot keeps its keys whatever the bound says."""
    balance_gap: int | None = None
    """A second bound: a server takes a new key only while its streams, the new one
    counted, stay within ``balance_gap`` of the least loaded server's (per unit of weight);
    otherwise the key goes to the next server in its order within both bounds. Near the
    fleet's capacity this keeps a hot prompt's server from queueing requests in the engine
    while another has free slots. A server with a free slot keeps its keys whatever the gap.
    Unset: a quarter of the smallest server's slots, rounded up (its ``max_streams``, else
    the batch its engine showed when it last queued), or 4 while no slots are known."""


@attrs.frozen(kw_only=True)
class LoadReporting:
    """``load_report``: poll each server's Prometheus endpoint for the engine's own load."""

    path: str = "/metrics"
    """The path of each server's Prometheus exposition, asked with ``GET``."""
    interval: float = 1.0
    """Seconds between polls; a report older than 3 intervals is ignored."""
    timeout: float | None = None
    """Seconds a poll may take; None: 80 % of ``interval``."""
    kv_cache_limit: float = 0.95
    """A server whose reported KV-cache usage (0..1) is above this gets no new sessions
    (existing ones stay), unless every server is above it."""

    @property
    def poll_timeout(self) -> float:
        return self.timeout if self.timeout is not None else 0.8 * self.interval


@attrs.frozen(kw_only=True)
class RateLimit:
    """``rate_limit``: per-tenant budgets (token buckets refilled over a minute)."""

    tokens_per_minute: int | None = None
    """Completion tokens per tenant per minute: a request reserves its ``max_tokens`` (or
    ``default_max_tokens``) and is settled to what it really used."""
    requests_per_minute: int | None = None
    """Requests per tenant per minute, whatever their size."""
    max_concurrent: int | None = None
    """Requests of one tenant in flight at once (from admission to the response's end)."""


SOURCE_KINDS = ("cookie", "header", "query", "body")
"""The kinds of :class:`SessionSource`, in the order the configuration lists them."""


@attrs.frozen(kw_only=True)
class SessionSource:
    """Where a session key may come from: ``kind`` is one of :data:`SOURCE_KINDS`."""

    kind: str
    """``cookie``, ``header``, ``query`` or ``body``."""
    name: str
    """Cookie name, header name (lower case), query argument, or dotted JSON path
    (``metadata.session_id``: object keys, each an identifier)."""


@attrs.frozen(kw_only=True)
class StickyCookie:
    """A cookie naming the chosen server by an opaque id, like nginx's ``sticky cookie``."""

    name: str = "muxproxy_server"
    """The cookie's name (a token, RFC 6265 §4.1.1)."""
    expires: float | None = None
    """Max-Age in seconds; None makes a session cookie."""
    domain: str | None = None
    """The cookie's Domain attribute (RFC 6265 §5.2.3); None: the host the client asked."""
    path: str = "/"
    """The cookie's Path attribute (RFC 6265 §5.2.4)."""
    http_only: bool = True
    """Set HttpOnly, so that page scripts cannot read the cookie (RFC 6265 §5.2.6)."""
    secure: bool = False
    """Set Secure, so that the cookie is sent over HTTPS only (RFC 6265 §5.2.5)."""
    same_site: str | None = "Lax"
    """SameSite: ``"Strict"``, ``"Lax"`` or ``"None"`` (which needs ``secure = true``)."""
    secret: str = ""
    """Mixed into the server ids so they cannot be computed from addresses."""


@attrs.frozen(kw_only=True)
class Sticky:
    sources: tuple[SessionSource, ...] = ()
    """Where a request's session key comes from: ``"kind:name"`` strings, ``cookie:NAME``,
    ``header:NAME``, ``query:NAME`` or ``body:dotted.path`` (a JSON body field, e.g.
    ``body:metadata.session_id``), tried in order; the first that has a key wins. Requests
    with one key go to one server (weighted rendezvous hashing, ``routing/balancer.py``)."""
    body_limit: int = 64 * 1024
    """Most request-body bytes held to find a JSON body key; past it, no key."""
    cookie: StickyCookie | None = None
    """Pin clients by a cookie the proxy sets (``sticky.cookie``); None: no cookie."""
    session_idle: float = 600.0
    """Seconds a session key is remembered on the server it was last sent to: within them
    its next request goes there again (while that server takes existing sessions), even if
    a weight change moved the key's hash elsewhere (``routing/affinity.py``)."""


CONDITIONS = frozenset({"error", "timeout", "http_429", "http_502", "http_503", "http_504"})


@attrs.frozen(kw_only=True)
class NextUpstream:
    """When a request is retried on the next candidate (before any response byte went out)."""

    on: frozenset[str] = frozenset({"error", "timeout"})
    """What counts as a failure worth a retry: ``"error"`` (connect or I/O error),
    ``"timeout"`` (a connect, response-head or first-token deadline passed), ``"http_429"``,
    ``"http_502"``, ``"http_503"``, ``"http_504"`` (that response status). ``[]``: never."""
    tries: int = 3
    """Attempts in all, the first one included."""
    tries_timeout: float = 10.0
    """No new attempt starts this long after the first one started."""
    replay_buffer: int = 1024 * 1024
    """Most request-body bytes kept for a replay; a longer body is not retried."""


@attrs.frozen(kw_only=True)
class HealthCheck:
    path: str = "/health"
    """The path each server is asked with ``GET``, over the server's own protocol and pool."""
    interval: float = 5.0
    """Seconds between two checks of one server."""
    timeout: float = 2.0
    """Seconds a check may take; less than ``interval``."""
    passes: int = 2
    """Consecutive successes that bring a down server up."""
    fails: int = 2
    """Consecutive failures that take an up server down."""
    expect_status: int = 200
    """The status a healthy server answers; any other, or no answer, is a failure."""


@attrs.frozen(kw_only=True)
class GroupTimeouts:
    """Per-group deadlines; None falls back to the global ``[timeouts]``."""

    connect: float | None = None
    """Seconds to connect to a server of this group (``timeouts.connect``)."""
    response_head: float | None = None
    """Seconds from the request sent to the response head (``timeouts.response_head``)."""
    first_token: float | None = None
    """Seconds from the request to the first response body byte (the first SSE event): a
    server that takes longer has timed out (tried again on the next server under
    ``next_upstream``'s ``"timeout"``, else 504). Not set: no such deadline."""
    idle: float | None = None
    """Longest gap between two body chunks (``timeouts.read``)."""


@attrs.frozen(kw_only=True)
class HeaderRule:
    """A request header set for the backend, like nginx's ``proxy_set_header``.

    ``value`` is a template: literal text with ``$session_key``, ``$remote_addr``,
    ``$arg_NAME`` (query argument), ``$cookie_NAME`` and ``$http_NAME`` (request header, with
    ``_`` for ``-``). A variable name is the longest run of ``[A-Za-z0-9_]`` after ``$``; the
    loader admits no other ``$``. A value that expands to nothing removes the header.
    """

    name: str
    """The header name, lower case (the loader lower-cases it)."""
    value: str


@attrs.frozen(kw_only=True)
class Upstream:
    name: str
    servers: tuple[Server, ...] = ()
    """The group's backends: ``"host:port"`` strings, or tables with ``address`` and the
    server's own settings (``upstreams.NAME.servers[]``). Exactly one of this and
    ``discover``."""
    discover: Discover | None = None
    """Servers found in DNS instead (``docs/fleet.md``): A/AAAA (``dns``) or SRV (``srv``)
    records, looked up again every ``interval``; the same keys as a server's beside them."""
    slow_start: float = 0.0
    """Seconds over which a server that joins the group (found by ``discover``, or added by
    a reload) ramps from a weight near 0 to its own, as NGINX Plus's ``slow_start``: a
    number or ``"30s"``, ``"500ms"``, ``"2m"``. 0: at once."""
    pool_max_idle: int = 32
    """Idle keep-alive connections kept per backend."""
    pool_idle_timeout: float = 60.0
    """Seconds an idle pooled connection is kept before it is closed."""
    balance: Balance = Balance.ROUND_ROBIN
    """How a request without a session key (or a new key) picks its server."""
    sticky: Sticky = Sticky()
    """Session stickiness: where a request's session key comes from, the sticky cookie."""
    next_upstream: NextUpstream = NextUpstream()
    """Failover: when a request is retried on the next server, before any response byte."""
    health_check: HealthCheck | None = None
    """Active health checks; None: servers are taken out by failures alone (``max_fails``)."""
    set_headers: tuple[HeaderRule, ...] = ()
    """Request headers set for the backends, like nginx's ``proxy_set_header``: a table of
    header names to value templates. A template is literal text with ``$session_key``,
    ``$remote_addr``, ``$arg_NAME`` (a query argument), ``$cookie_NAME`` and ``$http_NAME``
    (a request header, ``_`` for ``-``); a value that expands to nothing removes the
    header. Framing and hop-by-hop headers (``Connection``, ``Content-Length``,
    ``Transfer-Encoding``...) cannot be set."""
    timeouts: GroupTimeouts = GroupTimeouts()
    """This group's deadlines, over the global ``[timeouts]``."""
    default_max_tokens: int = 256
    """The tokens a request is expected to generate when its body names no ``max_tokens`` or
    ``max_completion_tokens`` (``least_load``, ``rate_limit``)."""
    affinity: AffinityMode = AffinityMode.NONE
    """Placement of requests without a session key beyond ``balance``."""
    prefix: PrefixAffinity = PrefixAffinity()
    """What ``affinity = "prefix"`` keys on, and how loaded a server may get."""
    load_report: LoadReporting | None = None
    """Poll each server's Prometheus endpoint for the engine's own load and LoRA adapters
    (vLLM, SGLang); None: the proxy's own count only. With ``affinity = "prefix"`` on by
    default (``path = "/metrics"``, every second): a key stays on its engine while the
    engine reports room; ``load_report = false`` turns it off."""
    kv_events: KvEvents | None = None
    """Follow each engine's KV-cache events and place a prompt on the engine holding the
    most of it, within the prefix affinity's bounds (``docs/balancing.md``); None: the
    prefix key alone."""
    queue: AdmissionQueue = AdmissionQueue()  # noqa: RUF009  (frozen: one default is safe)
    """Where requests wait while every candidate is full (``max_streams``, ``max_waiting``)."""
    tenant: SessionSource | None = None
    """Whose request it is, for the queue's fairness and ``rate_limit`` (the value is hashed,
    never logged); None: one tenant."""
    priority: SessionSource | None = None
    """The request's priority class: an integer 0..9, lower served first (as vLLM's
    ``priority``); missing or not an integer: 0. Strict between classes, fair inside one."""
    rate_limit: RateLimit | None = None
    """Per-tenant budgets of tokens and requests a minute; None: no budget."""
    models: tuple[str, ...] = ()
    """The models the group serves, by their exact names, for the proxy's own ``GET
    /v1/models`` (``docs/models.md``)."""
    learn_models: bool = False
    """Learn the models instead from each server's own ``GET /v1/models`` (vLLM, SGLang)."""
    models_refresh: float = 60.0
    """Seconds between two reads of each server's ``/v1/models`` (``learn_models``)."""

    reads_body: bool = attrs.field(init=False, repr=False, eq=False)
    """Whether routing or admission reads the request's JSON body (derived, kept: every
    request asks)."""
    admission: bool = attrs.field(init=False, repr=False, eq=False)
    """Whether any server has a limit that can make a request wait (derived)."""
    admits: bool = attrs.field(init=False, repr=False, eq=False)
    """Whether a request goes through admission (``core/exchange/admit.py``): its body is read,
    servers have limits, or tenants have budgets (derived)."""

    def __attrs_post_init__(self) -> None:
        reads_body = (
            self.balance is Balance.LEAST_LOAD
            or self.affinity is AffinityMode.PREFIX
            or (self.rate_limit is not None and self.rate_limit.tokens_per_minute is not None)
            or (self.tenant is not None and self.tenant.kind == "body")
            or (self.priority is not None and self.priority.kind == "body")
            or self.load_report is not None  # the body's model: LoRA (``routing/lora.py``)
        )
        found = self.discover
        admission = any(
            s.max_streams is not None or s.max_waiting is not None for s in self.servers
        ) or (found is not None and (found.max_streams or found.max_waiting) is not None)
        object.__setattr__(self, "reads_body", reads_body)
        object.__setattr__(self, "admission", admission)
        object.__setattr__(self, "admits", reads_body or admission or self.rate_limit is not None)

    def server_at(self, host: str, port: int) -> Server | None:
        """The server of this group at ``host:port``, if any."""
        for server in self.servers:
            if server.port == port and server.host == host:
                return server
        return None


@attrs.frozen(kw_only=True)
class Listener(_HostPort):
    address: str
    """``host:port`` to accept clients on; port 0 picks a free one."""
    tls_cert: str | None = None
    """TLS certificate chain (PEM); with ``tls_key`` the listener speaks TLS, offering
    HTTP/2 and HTTP/1.1 by ALPN. Without: cleartext HTTP/1.1 and h2c."""
    tls_key: str | None = None
    """The certificate's private key (PEM)."""
    trusted_proxies: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    """The proxies in front (CIDRs, or addresses) whose forwarded fields are believed
    (appended to); from any other peer they are dropped and set from the connection. Empty
    (the default): no peer is trusted. See "Trust and forwarded headers" in operations.md."""

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


ADMIN_TOKEN_ENV = "MUXPROXY_ADMIN_TOKEN"
"""The environment variable of the admin token: it wins over ``[admin] token`` (a secret)."""


@attrs.frozen(kw_only=True)
class AdminSettings(_HostPort):
    """The ``[admin]`` section: the admin API's listener (``muxproxy.trio.admin``)."""

    address: str = "127.0.0.1:9901"
    """``host:port`` of the admin listener; loopback unless a token guards it."""
    token: str | None = None
    """The bearer token every change must carry; None: changes are refused."""
    state_file: str | None = None
    """Where runtime server overrides (weight, drain, down) are kept across restarts."""


@attrs.frozen(kw_only=True)
class Config:
    listeners: tuple[Listener, ...]
    upstreams: dict[str, Upstream]
    routes: tuple[Route, ...]
    timeouts: Timeouts = Timeouts()
    limits: Limits = Limits()
    log: LogSettings = attrs.field(factory=LogSettings)
    admin: AdminSettings | None = None
    """None: no admin listener."""
    resolver: ResolverSettings = attrs.field(factory=ResolverSettings)
    fleet: FleetSettings | None = None
    """None: every replica keeps its own runtime state, sessions and budgets."""
    extensions: tuple[ExtensionConfig, ...] = ()
    """The extension hooks, in the order they run (``docs/extending.md``)."""
    telemetry: TelemetrySettings | None = None  # None: no OpenTelemetry (docs/telemetry.md)
    models: dict[str, ModelAlias] = attrs.field(factory=dict)
    """The ``[models.NAME]`` aliases, by name."""
    by_model: bool = attrs.field(init=False, repr=False, eq=False)
    """Whether a request's model can change where it goes (a route has ``models``, or an
    alias exists): only then is a body read for it (derived, kept: every request asks)."""
    reads_models: bool = attrs.field(init=False, repr=False, eq=False)
    """``by_model``, or telemetry on (its spans name the model): a body may be read for it."""
    route_table: RouteTable = attrs.field(init=False, repr=False, eq=False)
    """``routes`` indexed for ``route_for`` (derived, kept: every request asks)."""

    def __attrs_post_init__(self) -> None:
        by_model = bool(self.models) or any(route.models for route in self.routes)
        object.__setattr__(self, "by_model", by_model)
        object.__setattr__(self, "reads_models", by_model or self.telemetry is not None)
        object.__setattr__(self, "route_table", RouteTable(self.routes))

    def route_for(self, path: bytes, model: str | None = None) -> Route | None:
        """The route with the longest prefix matching ``path`` (``routes.RouteTable.choose``:
        then the routes with ``models`` matching ``model`` before the one without).

        The exchange passes the request target normalised by ``muxproxy.core.http.paths`` (dot-
        segments resolved, encoded unreserved characters decoded), never the raw one: a prefix
        is a boundary only on a path the backend has nothing left to resolve in."""
        return self.route_table.choose(path.decode("latin-1"), model)
