"""Events the driver feeds into the core.

Every event carries ``now``, a monotonic time in seconds chosen by the driver, so the core never
reads a clock and every test of it is deterministic. Connection ids are plain ints: ids of
client connections are chosen by the driver (positive), ids of upstream connections by the core
(negative), so the two never collide without any coordination.
"""

from __future__ import annotations

import ipaddress

import attrs

from muxproxy.config import Config
from muxproxy.config.runtime import RuntimeState
from muxproxy.core.timers import TimerId as TimerId
from muxproxy.fleet.budgets import Ask, Verdict
from muxproxy.fleet.sessions import SessionEntry

ConnId = int


@attrs.frozen(kw_only=True, slots=True)
class Event:
    now: float


@attrs.frozen(kw_only=True, slots=True)
class ConnectionAccepted(Event):
    """A client connected to ``listener``; for TLS the handshake is done and ``alpn`` chosen."""

    conn: ConnId
    listener: str
    peer: tuple[str, int] | None
    tls: bool = False
    alpn: str | None = None
    trusted_proxies: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    """The listener's ``trusted_proxies``: a peer in one of them is a proxy whose forwarded
    fields are believed (``forwarded.py``)."""
    wall: float | None = None
    """The wall-clock time (POSIX seconds, ``time.time()``) at ``now``: the core's only way to
    the calendar, for ``Date`` fields (``dates.py``). None: the driver gives no clock."""


@attrs.frozen(kw_only=True, slots=True)
class ConnectionOpened(Event):
    """An ``OpenConnection`` succeeded."""

    conn: ConnId


@attrs.frozen(kw_only=True, slots=True)
class OpenFailed(Event):
    """An ``OpenConnection`` failed (refused, unreachable, TLS error)."""

    conn: ConnId
    reason: str


@attrs.frozen(kw_only=True, slots=True)
class DataReceived(Event):
    conn: ConnId
    data: bytes


@attrs.frozen(kw_only=True, slots=True)
class DataSent(Event):
    """The writer handed ``nbytes`` of this connection's pending output to the kernel."""

    conn: ConnId
    nbytes: int


@attrs.frozen(kw_only=True, slots=True)
class InputEnded(Event):
    """The peer ended its sending side (TCP FIN, a TLS close_notify): nothing more will be
    read from ``conn``, which stays open for writing.

    Driver contract: after a clean EOF on a read, the driver feeds this once and reads that
    connection no more; it keeps writing what the core sends, and still closes it only on
    ``CloseConnection`` or a failure (``ConnectionClosed`` follows as always). The core answers
    a connection that is not a tunnel with ``CloseConnection`` and treats it as closed at once,
    as before; a tunnel relays the end to its other side (``ShutdownWrite``, or END_STREAM on
    an HTTP/2 stream) and goes on relaying the other direction (RFC 9293 §3.6: a half-closed
    TCP connection still carries data the other way). A driver that never feeds this event
    reports an EOF as ``ConnectionClosed(error=None)``, which the core handles too.
    """

    conn: ConnId


@attrs.frozen(kw_only=True, slots=True)
class ConnectionClosed(Event):
    """The peer closed (``error`` is None) or the connection broke (``error`` says how).

    Sent exactly once per connection, also after the core's own ``CloseConnection``.
    """

    conn: ConnId
    error: str | None = None


@attrs.frozen(kw_only=True, slots=True)
class Wakeup(Event):
    """A timer set by ``SetTimer`` is due."""

    timer: TimerId


@attrs.frozen(kw_only=True, slots=True)
class ConfigChanged(Event):
    """The configuration is now ``config`` (validated). Also the driver's first event: it
    starts what the core runs by itself (health checks)."""

    config: Config
    wall: float | None = None
    """The wall-clock time at ``now``, as on ``ConnectionAccepted``."""


@attrs.frozen(kw_only=True, slots=True)
class ShutdownRequested(Event):
    """Stop taking new requests; let open streams finish until ``deadline``."""

    deadline: float


@attrs.frozen(kw_only=True, slots=True)
class RuntimeChanged(Event):
    """The operator's runtime server state (weights, drain, down) is now ``state``, whole.

    It replaces the previous state (it is not a delta) and stays across ``ConfigChanged``:
    the core re-applies it to each new configuration, ignoring servers no longer there.
    It applies to routing decisions from the next request on; no stream in flight is moved
    or cut (``routing/router.py``).
    """

    state: RuntimeState


@attrs.frozen(kw_only=True, slots=True)
class SessionsLearned(Event):
    """Sessions remembered by another worker or replica (``SessionsRemembered`` there): each
    routing memory takes the entries newer than what it holds for their keys and not older
    than ``sticky.session_idle`` (``Affinity.learn``). The times are this core's clock."""

    entries: tuple[SessionEntry, ...]


@attrs.frozen(kw_only=True, slots=True)
class ResumedHead:
    """A shared stream's response head, as the store keeps it (``ResumeMeta``)."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    version: str


FETCH_STATES = (
    "live", "ended", "broken", "lost", "unknown", "evicted", "invalid", "unavailable", "corrupt"
)  # fmt: skip
"""``ResumeFetched.state``: ``live`` (more follows), ``ended`` or ``broken`` (the stream's
end, after these events), ``lost`` (its owner died: these events are all there is), or why
the resume cannot be served (``resume.Lookup``): ``unavailable`` is a store that cannot be
reached, ``corrupt`` a record that failed its checks (``storedrecords.py``)."""


@attrs.frozen(kw_only=True, slots=True)
class ResumeFetched(Event):
    """A batch of a ``ResumeFetch``: its head (the first batch only), events, and state.
    A state other than ``live`` is the fetch's last batch."""

    request: int
    head: ResumedHead | None = None
    events: tuple[bytes, ...] = ()
    state: str = "live"


@attrs.frozen(kw_only=True, slots=True)
class ResumeProbed(Event):
    """The answer to ``ResumeProbe``: whether another process reads the stream now."""

    stream: int
    reading: bool


@attrs.frozen(kw_only=True, slots=True)
class BudgetAnswered(Event):
    """The answer to ``BudgetReserve``: the store's verdict, or why there is none."""

    store: str
    ask: Ask
    verdict: Verdict | None
    """None: the store failed (down, too slow, a bad reply): ``error`` says how."""
    error: str = ""
    replicas: int = 1
    """The replicas the driver last saw in the store (at least 1): ``on_store_error =
    "local"`` enforces ``1 / replicas`` of each budget."""


@attrs.frozen(kw_only=True, slots=True)
class ExtensionAnswered(Event):
    """The answer to ``ExtensionCall``: the hook's decision, or why there is none."""

    request: int
    position: int
    decision: object
    """What the hook returned (a ``Decision`` or None; anything else is its error)."""
    error: str = ""
    """Not empty: the hook raised or timed out (``decision`` is then None)."""


@attrs.frozen(kw_only=True, slots=True)
class KvSubscription(Event):
    """The subscription to a server's KV-cache events (``KvFollow``) is up, or failed:
    ``error`` says why (empty: it is up)."""

    group: str
    address: str
    error: str = ""


@attrs.frozen(kw_only=True, slots=True)
class KvEventsReceived(Event):
    """One ZeroMQ message from a server's KV-cache event publisher, its frames as sent."""

    group: str
    address: str
    parts: tuple[bytes, ...]


@attrs.frozen(kw_only=True, slots=True)
class KvTokensAnswered(Event):
    """The answer to ``KvTokenize``: the engine's answer body, or why there is none."""

    group: str
    key: bytes
    body: bytes | None
    """The 200 answer's body (None: it failed, ``error`` says how)."""
    error: str = ""
