"""Routing inside the exchange, as conversations: failover and retries, the held SSE head,
sticky sessions, header rules, passive and active health, least streams.

Every request comes from a real h11/h2 client peer and every backend is a real h11 server
peer; each conversation asserts every command the core returns, in order, timers included,
and what the peers decode from them. Time moves only through ``pb.now``. The server an
attempt goes to is matched with ``Opens`` (``to``: the one it must be, ``avoid``: the ones it
must not be); where hashing picks it, the expected server comes from the routing module's own
``rendezvous_order``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import h2.errors
import h2.events
import h11
import pytest
from checks import Check, h1_body, h1_request, h1_response, h2_resets
from playbook import (
    H1BackendPeer,
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    closed,
    data,
    default_config,
    open_failed,
    opened,
    sent,
    wakeup,
)

from muxproxy.config import (
    Balance,
    Config,
    GroupTimeouts,
    HeaderRule,
    HealthCheck,
    NextUpstream,
    Route,
    Server,
    SessionSource,
    Sticky,
    StickyCookie,
    Timeouts,
    Upstream,
)
from muxproxy.config.runtime import RuntimeState
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Command,
    Log,
    OpenConnection,
    SetTimer,
)
from muxproxy.core.events import ConfigChanged, RuntimeChanged
from muxproxy.routing.balancer import rendezvous_order

A, B, C = "127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"
SERVERS = (A, B, C)
RETRY_ALL = frozenset({"error", "timeout", "http_503"})
CHAT = "/v1/chat/completions"


def fleet(
    *servers: str | Server,
    retry_until_first_event: bool = False,
    timeouts: Timeouts | None = None,
    group_timeouts: GroupTimeouts | None = None,
    **group: Any,
) -> Config:
    """One group ``default`` of ``servers`` (default A, B, C) behind the route ``/``.

    ``timeouts`` are the global ones, ``group_timeouts`` the group's; ``group`` holds the
    other ``Upstream`` fields. No idle backend connection is kept unless ``pool_max_idle``
    says so, so that every attempt shows as an ``OpenConnection`` naming its server.
    """
    group.setdefault("pool_max_idle", 0)
    if group_timeouts is not None:
        group["timeouts"] = group_timeouts
    members = tuple(Server(address=s) if isinstance(s, str) else s for s in (servers or SERVERS))
    upstream = Upstream(name="default", servers=members, **group)
    route = Route(prefix="/", upstream="default", retry_until_first_event=retry_until_first_event)
    changes: dict[str, Any] = {"upstreams": {"default": upstream}, "routes": (route,)}
    if timeouts is not None:
        changes["timeouts"] = timeouts
    return default_config(**changes)


class Opens:
    """The next command is an ``OpenConnection``; ``to``: the server it must name; ``avoid``:
    servers it must not name. Keeps the connection (``conn``) and its server (``server``)."""

    def __init__(self, to: str | None = None, avoid: Iterable[str] = ()) -> None:
        self.to = to
        self.avoid = set(avoid)
        self.conn = 0
        self.server = ""

    def take(self, queue: list[Command]) -> None:
        assert queue and isinstance(queue[0], OpenConnection), f"expected an open: {queue}"
        cmd = queue.pop(0)
        self.conn, self.server = cmd.conn, str(cmd.origin)
        assert self.to is None or self.server == self.to, (self.to, cmd)
        assert self.server not in self.avoid, (self.avoid, cmd)

    def __repr__(self) -> str:
        return f"Opens(to={self.to}, avoid={self.avoid})"


def no_server(text: str) -> bytes:
    """The body of a ``no_server`` refusal (502, 503) on ``CHAT``, an OpenAI path: OpenAI's
    error object with the reason as its code (``core/exchange/refusal.py``)."""
    error = {"message": text, "type": "server_error", "param": None, "code": "no_server"}
    return json.dumps({"error": error}).encode()


def body_is(body: bytes, *, end: bool = True) -> Check:
    """A run of response body: exactly ``body``, no second head, and (``end``) its end."""

    def check(events: Sequence[Any]) -> None:
        assert not any(isinstance(e, h11.Response) for e in events), events
        assert h1_body(events) == body, events
        assert isinstance(events[-1], h11.EndOfMessage) is end, events

    return check


class Routing:
    """A Playbook with many clients and backends, and the phrases of a routed exchange.

    Client connection ``n`` carries exchange ``n`` (one request each), so the exchange's
    timers are named by the client connection. Deadlines come from the config."""

    def __init__(self, config: Config) -> None:
        self.pb = Playbook(config)
        self.config = config
        self.backends: dict[int, H1BackendPeer] = {}
        self._next_client = 0
        timeouts, mine = config.timeouts, self.group.timeouts
        self.connect_s = mine.connect or timeouts.connect
        self.head_s = mine.response_head or timeouts.response_head
        self.read_s = mine.idle or timeouts.read
        self.first_token_s = mine.first_token
        self.send_s = timeouts.send
        self.idle_s = timeouts.keepalive_idle
        self.body_gap_s = timeouts.client_header
        sticky = self.group.sticky
        self.body_key = sticky is not None and any(s.kind == "body" for s in sticky.sources)

    @property
    def group(self) -> Upstream:
        return self.config.upstreams["default"]

    @property
    def router(self) -> Any:
        return self.pb.core.router(self.group)

    # -- clients -------------------------------------------------------------------------

    def connect(self) -> tuple[int, H1ClientPeer]:
        self._next_client += 1
        conn = self._next_client
        self.pb.accept(conn)
        return conn, H1ClientPeer()

    def ask(
        self,
        target: str = CHAT,
        headers: list[tuple[str, str]] | None = None,
        body: bytes | None = None,
        *,
        to: str | None = None,
        avoid: Iterable[str] = (),
    ) -> tuple[int, H1ClientPeer, Opens]:
        """A new HTTP/1.1 client sends one whole request; the core opens a connection to a
        server (``to``, not one of ``avoid``)."""
        pb = self.pb
        conn, client = self.connect()
        method = "GET" if body is None else "POST"
        pb >> data(conn, client.request(method, target, headers, body))
        pb << CancelTimer(timer=("header", conn))
        if body is not None and self.body_key:  # held for the key: the body timer first
            pb << SetTimer(timer=("body", conn), at=pb.now + self.body_gap_s)
        opens = self.attempt(conn, to=to, avoid=avoid)
        if body is not None and not self.body_key:
            pb << SetTimer(timer=("body", conn), at=pb.now + self.body_gap_s)
        return conn, client, opens

    def h2_ask(self) -> tuple[int, H2ClientPeer, int, Opens]:
        """A new HTTP/2 client sends its preface and one GET; the core opens a connection."""
        pb = self.pb
        conn, _ = self.connect()
        client = H2ClientPeer()
        sid, request = client.request(path=CHAT.encode())
        pb >> data(conn, client.preface() + request)
        pb << SetTimer(timer=("send", conn), at=pb.now + self.send_s)
        pb << Sends(conn, client)  # the proxy's SETTINGS
        pb << CancelTimer(timer=("header", conn))
        opens = self.attempt(conn)
        pb << Sends(conn, client)  # the SETTINGS ack
        return conn, client, sid, opens

    def attempt(self, ex: int, *, to: str | None = None, avoid: Iterable[str] = ()) -> Opens:
        """Exchange ``ex`` opens a connection for an attempt, under a fresh connect deadline."""
        self.pb << SetTimer(timer=("connect", ex), at=self.pb.now + self.connect_s)
        self.pb << (opens := Opens(to, avoid))
        return opens

    def answered(self, conn: int, client: H1ClientPeer, status: int, body: bytes) -> None:
        """The proxy's own answer ``status`` (no backend), and the client connection closes."""
        pb = self.pb
        pb << SetTimer(timer=("send", conn), at=pb.now + self.send_s)
        pb << Sends(conn, client, h1_response(status, body, end=True))
        pb << CloseConnection(conn=conn)

    # -- backends ------------------------------------------------------------------------

    def accept(self, up: int, ex: int, check: Check | None = None) -> Sends:
        """The backend accepts ``up`` and gets the request of exchange ``ex`` (``check``)."""
        pb = self.pb
        backend = self.backends[up] = H1BackendPeer()
        pb >> opened(up)
        pb << CancelTimer(timer=("connect", ex))
        pb << (request := Sends(up, backend, check or h1_request(b"GET", CHAT.encode())))
        pb << SetTimer(timer=("head", ex), at=pb.now + self.head_s)
        if self.first_token_s is not None:
            pb << SetTimer(timer=("first_token", ex), at=pb.now + self.first_token_s)
        return request

    def reply(
        self,
        up: int,
        conn: int,
        client: H1ClientPeer,
        status: int = 200,
        body: bytes = b"ok",
        *,
        posted: bool = False,
        kept: bool = False,
    ) -> h11.Response:
        """The backend on ``up`` answers exchange ``conn`` whole; the client gets it all and
        the exchange ends (``posted``: its body timer goes; ``kept``: ``up`` is pooled)."""
        pb = self.pb
        pb >> data(up, self.response_bytes(up, status, body))
        pb << CancelTimer(timer=("head", conn))
        pb << SetTimer(timer=("send", conn), at=pb.now + self.send_s)
        pb << (head := Sends(conn, client, h1_response(status)))
        pb << SetTimer(timer=("read", conn), at=pb.now + self.read_s)
        pb << Sends(conn, client, body_is(body))
        if kept:
            pb << SetTimer(timer=("pool", up), at=pb.now + self.group.pool_idle_timeout)
        else:
            pb << CloseConnection(conn=up)
        pb << CancelTimer(timer=("read", conn))
        if posted:
            pb << CancelTimer(timer=("body", conn))
        pb << SetTimer(timer=("idle", conn), at=pb.now + self.idle_s)
        pb.done()
        response = head.events[0]
        assert isinstance(response, h11.Response)
        return response

    def serve(self, ex: int, client: H1ClientPeer, opens: Opens) -> h11.Response:
        """The backend ``opens`` went to accepts, reads and answers 200 ``ok``."""
        self.accept(opens.conn, ex)
        return self.reply(opens.conn, ex, client)

    def response_bytes(self, up: int, status: int = 200, body: bytes = b"ok") -> bytes:
        """A whole response of the backend on ``up`` with a Content-Length."""
        backend = self.backends[up].conn
        hdrs = [("Content-Length", str(len(body)))]
        wire = backend.send(h11.Response(status_code=status, headers=hdrs)) or b""
        wire += (backend.send(h11.Data(data=body)) or b"") if body else b""
        wire += backend.send(h11.EndOfMessage()) or b""
        if backend.our_state is h11.DONE and backend.their_state is h11.DONE:
            backend.start_next_cycle()  # ready for the next request on a kept-alive connection
        return wire

    def sse_head_bytes(self, up: int, backend_id: str) -> bytes:
        headers = [("Content-Type", "text/event-stream"), ("X-Backend-Id", backend_id)]
        return self.backends[up].conn.send(h11.Response(status_code=200, headers=headers)) or b""

    def sse_head(self, up: int, ex: int, backend_id: str) -> None:
        """The backend on ``up`` sends an SSE head that the proxy holds (retry until the
        first event): nothing reaches the client, the read deadline starts."""
        pb = self.pb
        pb >> data(up, self.sse_head_bytes(up, backend_id))
        pb << CancelTimer(timer=("head", ex))
        pb << SetTimer(timer=("read", ex), at=pb.now + self.read_s)
        pb.done()

    def first_event(self, up: int, conn: int, client: H1ClientPeer, event: bytes) -> h11.Response:
        """The first event comes: the held head goes out with it (the first-token deadline,
        if any, ends)."""
        pb = self.pb
        pb >> data(up, self.chunk(up, event))
        pb << SetTimer(timer=("send", conn), at=pb.now + self.send_s)
        pb << (head := Sends(conn, client, h1_response(200)))
        pb << SetTimer(timer=("read", conn), at=pb.now + self.read_s)
        if self.first_token_s is not None:
            pb << CancelTimer(timer=("first_token", conn))
        pb << Sends(conn, client, body_is(event, end=False))
        pb.done()
        response = head.events[0]
        assert isinstance(response, h11.Response)
        return response

    def chunk(self, up: int, data: bytes) -> bytes:
        return self.backends[up].conn.send(h11.Data(data=data)) or b""

    def end(self, up: int) -> bytes:
        return self.backends[up].conn.send(h11.EndOfMessage()) or b""

    def stream_ends(self, up: int, conn: int, client: H1ClientPeer) -> None:
        """The backend ends its stream: the client gets the end, the exchange is over."""
        pb = self.pb
        pb >> data(up, self.end(up))
        pb << Sends(conn, client, lambda events: [type(e) for e in events] == [h11.EndOfMessage])
        pb << CloseConnection(conn=up)
        pb << CancelTimer(timer=("read", conn))
        pb << SetTimer(timer=("idle", conn), at=pb.now + self.idle_s)
        pb.done()

    # -- output --------------------------------------------------------------------------

    def logs(self, event: str) -> list[Log]:
        return [c for c in self.pb.log if isinstance(c, Log) and c.event == event]


def header(msg: Any, name: bytes) -> list[bytes]:
    return [v for n, v in msg.headers if n == name]


def fails_over(rig: Routing, up: int, ex: int, *, avoid: Iterable[str]) -> Opens:
    """Connecting to ``up`` is refused: exchange ``ex`` tries another server."""
    rig.pb >> open_failed(up)
    rig.pb << CancelTimer(timer=("connect", ex))
    return rig.attempt(ex, avoid=avoid)


def gave_up(
    rig: Routing, up: int, conn: int, client: H1ClientPeer, status: int, body: bytes
) -> None:
    """Connecting to ``up`` is refused and no try is left: the client gets ``status``."""
    rig.pb >> open_failed(up)
    rig.pb << CancelTimer(timer=("connect", conn))
    rig.answered(conn, client, status, body)
    rig.pb.done()


# -- 1. failover on connect errors ------------------------------------------------------------


def test_refused_connect_fails_over_to_the_next_server() -> None:
    rig = Routing(fleet())
    conn, client, first = rig.ask()
    second = fails_over(rig, first.conn, conn, avoid={first.server})
    rig.pb.done()  # nothing reached the client yet
    (retry,) = rig.logs("retry")
    assert retry.fields["upstream"] == first.server
    assert retry.fields["condition"] == "error"
    rig.accept(second.conn, conn)
    rig.reply(second.conn, conn, client, body=b"from the second backend")
    (access,) = rig.logs("access")
    assert access.fields["tries"] == 2
    assert access.fields["server"] == second.server


def test_tries_bounds_the_attempts_then_502() -> None:
    rig = Routing(fleet(next_upstream=NextUpstream(tries=2)))
    conn, client, first = rig.ask()
    second = fails_over(rig, first.conn, conn, avoid={first.server})
    gave_up(rig, second.conn, conn, client, 502, no_server("upstream unavailable"))
    assert len(rig.logs("retry")) == 1
    assert rig.logs("access")[0].fields["tries"] == 2


# -- 2. failover on timeouts ----------------------------------------------------------------


@pytest.mark.parametrize("timer", ["connect", "head"])
def test_timeout_fails_over_to_the_next_server(timer: str) -> None:
    rig = Routing(fleet(timeouts=Timeouts(connect=2, response_head=3)))
    pb = rig.pb
    conn, client, first = rig.ask()
    if timer == "head":
        rig.accept(first.conn, conn)
    pb.now = 2 if timer == "connect" else 3
    pb >> wakeup(timer, conn)
    pb << CloseConnection(conn=first.conn)  # the slow attempt is abandoned
    # The next attempt has its own deadline, counted from its own start.
    second = rig.attempt(conn, avoid={first.server})
    pb.done()
    assert rig.logs("retry")[0].fields["condition"] == "timeout"
    rig.accept(second.conn, conn)
    rig.reply(second.conn, conn, client, body=b"second")


@pytest.mark.parametrize("timer", ["connect", "head"])
def test_timeout_not_in_next_upstream_answers_504_at_once(timer: str) -> None:
    config = fleet(
        timeouts=Timeouts(connect=2, response_head=3),
        next_upstream=NextUpstream(on=frozenset({"error"})),
    )
    rig = Routing(config)
    pb = rig.pb
    conn, client, first = rig.ask()
    if timer == "head":
        rig.accept(first.conn, conn)
    pb.now = 2 if timer == "connect" else 3
    pb >> wakeup(timer, conn)
    pb << CloseConnection(conn=first.conn)
    pb << SetTimer(timer=("send", conn), at=pb.now + 60)
    pb << Sends(conn, client, h1_response(504))
    pb << CloseConnection(conn=conn)
    pb.done()  # no second OpenConnection
    assert not rig.logs("retry")


# -- 3. failover on a configured status ------------------------------------------------------


def test_configured_status_is_retried_on_another_server() -> None:
    rig = Routing(fleet(next_upstream=NextUpstream(on=RETRY_ALL)))
    pb = rig.pb
    conn, client, first = rig.ask()
    rig.accept(first.conn, conn)
    pb >> data(first.conn, rig.response_bytes(first.conn, 503, b"overloaded"))
    pb << CancelTimer(timer=("head", conn))
    pb << CloseConnection(conn=first.conn)
    second = rig.attempt(conn, avoid={first.server})
    pb.done()  # the 503 never reached the client
    assert rig.logs("retry")[0].fields["condition"] == "http_503"
    rig.accept(second.conn, conn)
    rig.reply(second.conn, conn, client, body=b"fine")


def test_status_not_configured_is_passed_through() -> None:
    rig = Routing(fleet())  # on = {"error", "timeout"}
    conn, client, first = rig.ask()
    rig.accept(first.conn, conn)
    rig.reply(first.conn, conn, client, 503, b"overloaded")  # no second OpenConnection


def test_stale_messages_of_an_abandoned_attempt_do_not_touch_the_retry() -> None:
    """A 503 head and a broken body arrive in one read: the broken body belongs to the
    abandoned attempt and must not fail (or count against) the server now being tried."""
    rig = Routing(fleet(next_upstream=NextUpstream(on=RETRY_ALL)))
    pb = rig.pb
    conn, client, first = rig.ask()
    rig.accept(first.conn, conn)
    backend = rig.backends[first.conn].conn
    head = backend.send(h11.Response(status_code=503, headers=[("Transfer-Encoding", "chunked")]))
    pb >> data(first.conn, (head or b"") + b"zz-not-a-chunk-size\r\n")
    pb << CancelTimer(timer=("head", conn))
    pb << CloseConnection(conn=first.conn)
    second = rig.attempt(conn, avoid={first.server})  # only the server after the 503
    pb.done()
    assert len(rig.logs("retry")) == 1
    assert not rig.logs("access")  # the exchange is still running on the second server
    rig.accept(second.conn, conn)
    rig.reply(second.conn, conn, client, body=b"fine")


# -- 4. body replay ------------------------------------------------------------------------


def test_request_body_is_replayed_on_the_retry() -> None:
    rig = Routing(fleet())
    pb = rig.pb
    payload = json.dumps({"messages": [{"role": "user", "content": "hi" * 50}]}).encode()
    conn, client, first = rig.ask(body=payload)
    rig.accept(first.conn, conn, h1_request(b"POST", CHAT.encode(), payload))
    pb >> closed(first.conn)  # dies before answering
    pb << CancelTimer(timer=("head", conn))
    second = rig.attempt(conn, avoid={first.server})
    rig.accept(second.conn, conn, h1_request(b"POST", CHAT.encode(), payload))
    rig.reply(second.conn, conn, client, body=b"done", posted=True)


def test_body_larger_than_the_replay_buffer_is_not_retried() -> None:
    rig = Routing(fleet(next_upstream=NextUpstream(replay_buffer=16)))
    pb = rig.pb
    payload = b"x" * 40
    conn, client, first = rig.ask(body=payload)
    # Streamed without a copy.
    rig.accept(first.conn, conn, h1_request(b"POST", CHAT.encode(), payload))
    pb >> closed(first.conn)
    pb << CancelTimer(timer=("head", conn))
    pb << SetTimer(timer=("send", conn), at=60.0)
    pb << Sends(conn, client, h1_response(502, end=True))
    pb << CancelTimer(timer=("body", conn))
    pb << CloseConnection(conn=conn)
    pb.done()  # no second OpenConnection
    assert not rig.logs("retry")
    (skipped,) = rig.logs("retry_skipped")
    assert "replay buffer" in skipped.fields["reason"]


def test_retry_onto_a_kept_alive_connection_replays_the_body() -> None:
    """The next server's idle pooled connection is taken at once (no OpenConnection); the
    body still goes out in full, after the head."""
    rig = Routing(fleet(A, B, pool_max_idle=4))
    pb = rig.pb
    pooled: dict[str, int] = {}
    for expected in (A, B):  # leave one idle kept-alive connection on each server
        ex, client, opens = rig.ask(to=expected)
        rig.accept(opens.conn, ex)
        rig.reply(opens.conn, ex, client, kept=True)
        pooled[expected] = opens.conn
    payload = b'{"prompt": "replay me"}'
    conn, client = rig.connect()
    pb >> data(conn, client.request("POST", CHAT, None, payload))
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("connect", conn), at=5.0)
    pb << CancelTimer(timer=("pool", pooled[A]))  # A's idle connection, nothing opened
    pb << CancelTimer(timer=("connect", conn))
    pb << (head := Sends(pooled[A], rig.backends[pooled[A]]))
    pb << SetTimer(timer=("head", conn), at=60.0)
    pb << SetTimer(timer=("body", conn), at=30.0)
    pb << (body := Sends(pooled[A], rig.backends[pooled[A]]))
    h1_request(b"POST", CHAT.encode(), payload)([*head.events, *body.events])
    # Written, so this POST is no stale-pool retry (test_stale_pool.py): next_upstream's.
    pb >> sent(pooled[A], len(head.data) + len(body.data))
    pb >> closed(pooled[A])  # the keep-alive race: A closed as the request went out
    pb << CancelTimer(timer=("head", conn))
    pb << SetTimer(timer=("connect", conn), at=5.0)
    pb << CancelTimer(timer=("pool", pooled[B]))  # B's idle connection, nothing opened
    pb << CancelTimer(timer=("connect", conn))
    pb << Sends(pooled[B], rig.backends[pooled[B]], h1_request(b"POST", CHAT.encode(), payload))
    pb << SetTimer(timer=("head", conn), at=60.0)
    rig.reply(pooled[B], conn, client, body=b"from B", posted=True, kept=True)


def test_deadlines_of_an_abandoned_attempt_do_not_reach_the_next_one() -> None:
    rig = Routing(fleet(group_timeouts=GroupTimeouts(first_token=5), timeouts=Timeouts(connect=8)))
    pb = rig.pb
    conn, _, first = rig.ask()
    rig.accept(first.conn, conn)  # its first-token deadline: 5
    pb.now = 1.0
    pb >> closed(first.conn)  # fails before answering: retried, the next one connects
    pb << CancelTimer(timer=("head", conn))
    pb << CancelTimer(timer=("first_token", conn))
    rig.attempt(conn, avoid={first.server})
    pb.now = 5.0
    mark = len(pb.log)
    # The first attempt's first-token deadline passes while the second still connects.
    pb >> wakeup("first_token", conn)
    assert pb.log[mark:] == []  # not even a log record
    assert len(rig.logs("retry")) == 1


# -- 5. nothing is retried after the first response byte -------------------------------------


def sse_to_h2(rig: Routing, up: int, conn: int, client: H2ClientPeer, sid: int) -> None:
    """The backend accepts ``up`` and answers with an SSE head that goes out to the h2
    client at once."""
    pb = rig.pb
    rig.accept(up, conn)
    pb >> data(up, rig.sse_head_bytes(up, "gpu0"))
    pb << CancelTimer(timer=("head", conn))
    pb << Sends(
        conn, client, lambda events: [type(e) for e in events] == [h2.events.ResponseReceived]
    )
    pb << SetTimer(timer=("read", conn), at=pb.now + rig.read_s)


def test_backend_death_mid_stream_truncates_and_is_not_retried() -> None:
    rig = Routing(fleet(next_upstream=NextUpstream(on=RETRY_ALL)))
    pb = rig.pb
    conn, client, sid, first = rig.h2_ask()
    sse_to_h2(rig, first.conn, conn, client, sid)
    pb >> data(first.conn, rig.chunk(first.conn, b"data: 1\n\n"))
    pb << Sends(conn, client, lambda events: [type(e) for e in events] == [h2.events.DataReceived])
    pb >> closed(first.conn)
    pb << (reset := Sends(conn, client, h2_resets((sid, h2.errors.ErrorCodes.INTERNAL_ERROR))))
    pb << CancelTimer(timer=("read", conn))
    pb << SetTimer(timer=("idle", conn), at=75.0)
    pb.done()  # no second OpenConnection
    assert not rig.logs("retry")
    assert not any(isinstance(e, h2.events.StreamEnded) for e in reset.events)


# -- 6. tries_timeout -----------------------------------------------------------------------


@pytest.mark.parametrize(("elapsed", "retried"), [(4.0, True), (5.0, False), (7.0, False)])
def test_no_retry_after_tries_timeout(elapsed: float, retried: bool) -> None:
    rig = Routing(fleet(next_upstream=NextUpstream(tries_timeout=5)))
    conn, client, first = rig.ask()
    rig.pb.now = elapsed
    if retried:
        fails_over(rig, first.conn, conn, avoid={first.server})
        rig.pb.done()
        assert rig.logs("retry")
    else:
        gave_up(rig, first.conn, conn, client, 502, no_server("upstream unavailable"))
        assert not rig.logs("retry")


# -- 7. retry_until_first_event ---------------------------------------------------------------


def test_held_sse_head_goes_out_with_the_first_event() -> None:
    rig = Routing(fleet(retry_until_first_event=True))
    pb = rig.pb
    conn, client, up = rig.ask()
    rig.accept(up.conn, conn)
    rig.sse_head(up.conn, conn, "gpu0")  # held: nothing reaches the client
    head = rig.first_event(up.conn, conn, client, b"data: first\n\n")
    assert header(head, b"x-backend-id") == [b"gpu0"]
    pb >> data(up.conn, rig.chunk(up.conn, b"data: second\n\n"))
    pb << Sends(conn, client, lambda events: [type(e) for e in events] == [h11.Data])
    rig.stream_ends(up.conn, conn, client)


def test_backend_dying_before_the_first_event_is_retried_transparently() -> None:
    rig = Routing(fleet(retry_until_first_event=True))
    pb = rig.pb
    conn, client, first = rig.ask()
    rig.accept(first.conn, conn)
    rig.sse_head(first.conn, conn, "gpu0")
    pb >> closed(first.conn)
    pb << CancelTimer(timer=("read", conn))
    second = rig.attempt(conn, avoid={first.server})
    pb.done()  # nothing of the first attempt reached the client
    assert rig.logs("retry")[0].fields["condition"] == "error"
    rig.accept(second.conn, conn)
    rig.sse_head(second.conn, conn, "gpu1")
    head = rig.first_event(second.conn, conn, client, b"data: a\n\n")
    assert header(head, b"x-backend-id") == [b"gpu1"]
    pb >> data(second.conn, rig.chunk(second.conn, b"data: b\n\n"))
    pb << Sends(conn, client, body_is(b"data: b\n\n", end=False))
    rig.stream_ends(second.conn, conn, client)
    assert rig.logs("access")[0].fields["outcome"] == "ok"


def test_non_sse_response_is_not_held() -> None:
    rig = Routing(fleet(retry_until_first_event=True))
    pb = rig.pb
    conn, client, up = rig.ask()
    rig.accept(up.conn, conn)
    head = rig.backends[up.conn].conn.send(
        h11.Response(
            status_code=200,
            headers=[("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")],
        )
    )
    pb >> data(up.conn, head or b"")
    pb << CancelTimer(timer=("head", conn))
    pb << SetTimer(timer=("send", conn), at=60.0)
    pb << Sends(conn, client, lambda events: [type(e) for e in events] == [h11.Response])
    pb << SetTimer(timer=("read", conn), at=300.0)
    pb.done()


def test_held_head_is_bounded_by_the_read_timeout() -> None:
    """A backend that sends an SSE head and then nothing must not hold the client forever:
    the idle (read) deadline applies while the head is held, and its expiry is retried."""
    rig = Routing(fleet(retry_until_first_event=True, timeouts=Timeouts(read=4)))
    pb = rig.pb
    conn, client, first = rig.ask()
    rig.accept(first.conn, conn)
    pb.now = 1.0
    pb >> data(first.conn, rig.sse_head_bytes(first.conn, "gpu0"))
    pb << CancelTimer(timer=("head", conn))
    pb << SetTimer(timer=("read", conn), at=5.0)  # within tries_timeout (10): retryable
    pb.now = 5.0
    pb >> wakeup("read", conn)
    pb << CloseConnection(conn=first.conn)
    second = rig.attempt(conn, avoid={first.server})
    assert rig.logs("retry")[0].fields["condition"] == "timeout"
    rig.accept(second.conn, conn)
    rig.sse_head(second.conn, conn, "gpu1")
    head = rig.first_event(second.conn, conn, client, b"data: a\n\n")
    assert header(head, b"x-backend-id") == [b"gpu1"]


# -- 8. first-token timeout ---------------------------------------------------------------


def test_first_token_timeout_while_held_is_retried() -> None:
    rig = Routing(fleet(retry_until_first_event=True, group_timeouts=GroupTimeouts(first_token=5)))
    pb = rig.pb
    conn, client, first = rig.ask()
    rig.accept(first.conn, conn)  # first token by 5
    pb.now = 1.0
    rig.sse_head(first.conn, conn, "gpu0")
    pb.now = 5.0
    pb >> wakeup("first_token", conn)
    pb << CancelTimer(timer=("read", conn))
    pb << CloseConnection(conn=first.conn)
    second = rig.attempt(conn, avoid={first.server})
    assert rig.logs("retry")[0].fields["condition"] == "timeout"
    rig.accept(second.conn, conn)  # a fresh first-token deadline per attempt: 10
    rig.sse_head(second.conn, conn, "gpu1")
    head = rig.first_event(second.conn, conn, client, b"data: a\n\n")
    assert header(head, b"x-backend-id") == [b"gpu1"]


def test_first_token_timeout_after_the_head_went_out_truncates() -> None:
    config = fleet(
        next_upstream=NextUpstream(on=RETRY_ALL), group_timeouts=GroupTimeouts(first_token=5)
    )
    rig = Routing(config)
    pb = rig.pb
    conn, client, sid, first = rig.h2_ask()
    sse_to_h2(rig, first.conn, conn, client, sid)
    pb.now = 5.0
    pb >> wakeup("first_token", conn)
    pb << CloseConnection(conn=first.conn)
    pb << Sends(conn, client, h2_resets((sid, h2.errors.ErrorCodes.INTERNAL_ERROR)))
    pb << CancelTimer(timer=("read", conn))
    pb << SetTimer(timer=("idle", conn), at=80.0)
    pb.done()  # no second OpenConnection


# -- 9. sticky sessions ----------------------------------------------------------------------

HEADER_KEY = Sticky(sources=(SessionSource(kind="header", name="x-session-id"),))


def owner(rig: Routing, key: bytes) -> str:
    """The server that weighted rendezvous hashing gives ``key`` with every server usable."""
    router = rig.router
    order = rendezvous_order(key, router.ids, router.weights, range(len(rig.group.servers)))
    return rig.group.servers[order[0]].address


def test_header_session_key_maps_to_the_same_server_and_keys_spread() -> None:
    rig = Routing(fleet(sticky=HEADER_KEY))
    chosen: dict[str, set[str]] = {}
    for _round in range(3):
        waiting = []
        for i in range(12):
            key = f"conv-{i}"
            call = rig.ask(headers=[("X-Session-Id", key)], to=owner(rig, key.encode()))
            chosen.setdefault(key, set()).add(call[2].server)
            waiting.append(call)
        for conn, client, opens in waiting:
            rig.serve(conn, client, opens)
    assert all(len(s) == 1 for s in chosen.values())
    assert len(set().union(*chosen.values())) >= 2  # different keys spread over the fleet


COOKIE = Sticky(cookie=StickyCookie(name="mp_srv"))


def sticky_cookie(head: h11.Response) -> bytes | None:
    values = [v for v in header(head, b"set-cookie") if v.startswith(b"mp_srv=")]
    assert len(values) <= 1
    return values[0].split(b";")[0].partition(b"=")[2] if values else None


def cookie_request(
    rig: Routing, value: bytes | None, *, to: str | None = None, avoid: Iterable[str] = ()
) -> tuple[h11.Response, str]:
    """A request with (or without) the cookie, served 200 by where it went."""
    headers = [] if value is None else [("Cookie", f"a=1; mp_srv={value.decode()}")]
    conn, client, opens = rig.ask(headers=headers, to=to, avoid=avoid)
    return rig.serve(conn, client, opens), opens.server


def test_sticky_cookie_pins_the_server_even_while_it_drains() -> None:
    rig = Routing(fleet(sticky=COOKIE))
    head, first = cookie_request(rig, None)
    value = sticky_cookie(head)
    assert value is not None
    (full,) = header(head, b"set-cookie")
    assert b"Path=/" in full and b"HttpOnly" in full
    # Opaque: the id names the server without revealing its address.
    assert b"127.0.0.1" not in value and b"900" not in value
    index = [s.address for s in rig.group.servers].index(first)
    assert value == rig.router.ids[index]
    drain = RuntimeState.empty().changed("default", first, weight=0)
    rig.pb >> RuntimeChanged(now=rig.pb.now, state=drain)  # no new sessions, pins stay
    rig.pb.done()
    for _ in range(4):
        head, _ = cookie_request(rig, value, to=first)
        assert sticky_cookie(head) is None  # already pinned there: no new cookie
    for _ in range(4):
        cookie_request(rig, None, avoid={first})


def test_sticky_cookie_naming_an_unknown_server_falls_back() -> None:
    rig = Routing(fleet(sticky=COOKIE))
    head, served = cookie_request(rig, b"0123456789abcdef")
    index = [s.address for s in rig.group.servers].index(served)
    assert sticky_cookie(head) == rig.router.ids[index]  # re-pinned to where it went
    head, _ = cookie_request(rig, b"not a server id at all")
    assert sticky_cookie(head) is not None


def test_sticky_cookie_naming_a_down_server_falls_back() -> None:
    rig = Routing(fleet(sticky=COOKIE))
    head, pinned = cookie_request(rig, None)
    value = sticky_cookie(head)
    assert value is not None
    # A pinned request finds its server refusing: it fails over, and the server is out.
    conn, client, first = rig.ask(headers=[("Cookie", f"mp_srv={value.decode()}")], to=pinned)
    other = fails_over(rig, first.conn, conn, avoid={pinned})
    head = rig.serve(conn, client, other)
    assert sticky_cookie(head) not in (None, value)  # re-pinned to the server that answered
    # While the pinned server is out, its cookie no longer routes there.
    rig.pb.now = 1.0
    cookie_request(rig, value, avoid={pinned})


# -- 10. JSON body key -----------------------------------------------------------------------

BODY_KEY = Sticky(sources=(SessionSource(kind="body", name="metadata.session_id"),))


def test_json_body_key_holds_the_request_until_the_body_is_complete() -> None:
    rig = Routing(fleet(sticky=BODY_KEY))
    pb = rig.pb
    # A key owned by a server other than the one the balancer would pick first (A).
    key = next(f"s-{i}" for i in range(100) if owner(rig, f"s-{i}".encode()) == C)
    body = json.dumps({"model": "m", "metadata": {"session_id": key}}).encode()
    conn, client = rig.connect()
    head = client.conn.send(
        h11.Request(
            method="POST",
            target=CHAT,
            headers=[("Host", "proxy.example"), ("Content-Length", str(len(body)))],
        )
    )
    pb >> data(conn, head or b"")
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("body", conn), at=30.0)
    pb.done()  # held: the key may be in the body
    pb >> data(conn, client.conn.send(h11.Data(data=body[:10])) or b"")
    pb.done()
    pb >> data(conn, client.conn.send(h11.Data(data=body[10:])) or b"")
    opens = rig.attempt(conn, to=C)  # the body is complete (a Content-Length body's end is no byte)
    # The backend gets the body unchanged.
    rig.accept(opens.conn, conn, h1_request(b"POST", CHAT.encode(), body))
    rig.reply(opens.conn, conn, client, posted=True)
    # The same key in another request goes to the same server; another key elsewhere.
    other = next(f"s-{i}" for i in range(100) if owner(rig, f"s-{i}".encode()) == B)
    for session, expected in ((key, C), (other, B)):
        body = json.dumps({"metadata": {"session_id": session}}).encode()
        rig.ask(body=body, to=expected)
        rig.pb.done()


@pytest.mark.parametrize("replay_buffer", [0, 16])
def test_json_body_key_works_without_a_replay_copy(replay_buffer: int) -> None:
    """The held body is all there when it is routed, even if it is too big to be kept for a
    replay: the key must still be found (``replay_buffer = 0`` turns replays off)."""
    config = fleet(sticky=BODY_KEY, next_upstream=NextUpstream(replay_buffer=replay_buffer))
    rig = Routing(config)
    key = next(f"s-{i}" for i in range(100) if owner(rig, f"s-{i}".encode()) == C)
    body = json.dumps({"metadata": {"session_id": key}, "padding": "x" * 40}).encode()
    assert len(body) > replay_buffer
    conn, _, opens = rig.ask(body=body, to=C)
    rig.accept(opens.conn, conn, h1_request(b"POST", CHAT.encode(), body))
    rig.pb.done()


# -- 11. passive health ----------------------------------------------------------------------


def test_failed_server_is_skipped_until_fail_timeout_passed() -> None:
    servers = [Server(address=a, max_fails=1, fail_timeout=10) for a in (A, B)]
    rig = Routing(fleet(*servers))
    conn, client, first = rig.ask(to=A)
    second = fails_over(rig, first.conn, conn, avoid={A})
    rig.serve(conn, client, second)  # B
    for now in (5.0, 9.9):
        rig.pb.now = now
        calls = [rig.ask(to=B) for _ in range(2)]
        for call in calls:
            rig.serve(*call)
    rig.pb.now = 10.0
    servers_now = {rig.ask()[2].server for _ in range(2)}
    assert servers_now == {A, B}


def test_no_usable_server_answers_503_at_once() -> None:
    rig = Routing(fleet(A, B))
    pb = rig.pb
    conn, client, first = rig.ask()
    second = fails_over(rig, first.conn, conn, avoid={first.server})
    gave_up(rig, second.conn, conn, client, 502, no_server("upstream unavailable"))
    conn, client = rig.connect()
    pb >> data(conn, client.request("GET", CHAT))
    pb << CancelTimer(timer=("header", conn))
    rig.answered(conn, client, 503, no_server("no backend available"))  # no OpenConnection
    pb.done()


def test_backup_is_used_only_when_every_primary_is_down() -> None:
    servers = (Server(address=A), Server(address=B), Server(address=C, backup=True))
    rig = Routing(fleet(*servers, next_upstream=NextUpstream(tries=1)))
    calls = [rig.ask(avoid={C}) for _ in range(6)]
    assert {opens.server for _, _, opens in calls} == {A, B}
    for call in calls:
        rig.serve(*call)
    conn, client, first = rig.ask(avoid={C})
    # One primary down: the other takes the traffic.
    gave_up(rig, first.conn, conn, client, 502, no_server("upstream unavailable"))
    conn, client, second = rig.ask(avoid={C, first.server})
    # Both primaries down.
    gave_up(rig, second.conn, conn, client, 502, no_server("upstream unavailable"))
    for _ in range(3):
        rig.ask(to=C)
        rig.pb.done()


# -- 12. header rules ------------------------------------------------------------------------


def backend_head(request: Sends) -> h11.Request:
    head = request.events[0]
    assert isinstance(head, h11.Request)
    return head


def test_header_rules_set_and_remove_backend_request_headers() -> None:
    rules = (
        HeaderRule(name="x-chat-id", value="$session_key"),
        HeaderRule(name="x-user-id", value="$arg_user"),
    )
    rig = Routing(fleet(sticky=HEADER_KEY, set_headers=rules))
    conn, _, up = rig.ask(
        "/v1/chat/completions?user=alice",
        headers=[("X-Session-Id", "conv-7"), ("X-Chat-Id", "forged")],
    )
    sent_ = rig.accept(up.conn, conn, h1_request(b"GET", b"/v1/chat/completions?user=alice"))
    request = backend_head(sent_)
    assert header(request, b"x-chat-id") == [b"conv-7"]
    assert header(request, b"x-user-id") == [b"alice"]
    assert header(request, b"x-session-id") == [b"conv-7"]
    # Nothing to expand: the header is removed, also when the client sent one itself.
    conn, _, up = rig.ask(headers=[("X-User-Id", "spoofed"), ("X-Chat-Id", "forged")])
    request = backend_head(rig.accept(up.conn, conn))
    assert header(request, b"x-user-id") == []
    assert header(request, b"x-chat-id") == []
    assert header(request, b"host") == [b"proxy.example"]
    rig.pb.done()


# -- 13. active health -----------------------------------------------------------------------

CHECK = HealthCheck(path="/health", interval=5, timeout=2, passes=1, fails=1)
PROBE = h1_request(b"GET", b"/health")


def probes_due(rig: Routing) -> None:
    """The config comes in: both servers' probes are due at once."""
    rig.pb >> ConfigChanged(now=rig.pb.now, config=rig.config)
    rig.pb << SetTimer(timer=("probe", 1), at=0.0)
    rig.pb << SetTimer(timer=("probe", 2), at=0.0)
    rig.pb.done()


def probe_answered(rig: Routing, up: int, status: int) -> Log:
    """Server A's probe on ``up`` is answered ``status``: the connection is kept, the next
    probe is due ``interval`` later; returns the health log."""
    pb = rig.pb
    mark = len(pb.log)
    pb >> data(up, rig.response_bytes(up, status, b""))
    pb << SetTimer(timer=("pool", up), at=pb.now + 60)
    pb << CancelTimer(timer=("probe_timeout", 1))
    pb << SetTimer(timer=("probe", 1), at=pb.now + 5)
    pb.done()
    (health,) = [c for c in pb.log[mark:] if isinstance(c, Log) and c.event == "health"]
    return health


def test_active_health_check_takes_a_server_down_and_brings_it_back() -> None:
    # Probe connections are kept alive: the second probe reuses the first one's.
    rig = Routing(fleet(A, B, health_check=CHECK, pool_max_idle=4))
    pb = rig.pb
    probes_due(rig)
    pb >> wakeup("probe", 1)
    pb << SetTimer(timer=("probe_timeout", 1), at=2.0)
    pb << (probe := Opens(to=A))
    pb >> opened(probe.conn)
    rig.backends[probe.conn] = H1BackendPeer()
    pb << Sends(probe.conn, rig.backends[probe.conn], PROBE)
    down = probe_answered(rig, probe.conn, 500)
    assert down.fields["server"] == A and down.fields["up"] is False
    for _ in range(4):
        rig.ask(to=B)
    pb.now = 5.0
    pb >> wakeup("probe", 1)
    pb << SetTimer(timer=("probe_timeout", 1), at=7.0)
    pb << CancelTimer(timer=("pool", probe.conn))  # the kept-alive probe connection, reused
    pb << Sends(probe.conn, rig.backends[probe.conn], PROBE)
    up = probe_answered(rig, probe.conn, 200)
    assert up.fields["server"] == A and up.fields["up"] is True
    # Back in: A's first request takes its idle connection, the next ones spread over both.
    conn, client = rig.connect()
    pb >> data(conn, client.request("GET", CHAT))
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("connect", conn), at=10.0)
    pb << CancelTimer(timer=("pool", probe.conn))
    pb << CancelTimer(timer=("connect", conn))
    pb << Sends(probe.conn, rig.backends[probe.conn], h1_request(b"GET", CHAT.encode()))
    pb << SetTimer(timer=("head", conn), at=65.0)
    assert {rig.ask()[2].server for _ in range(3)} == {A, B}
    pb.done()


def test_probe_timeout_counts_as_a_failure() -> None:
    rig = Routing(fleet(A, B, health_check=CHECK))
    pb = rig.pb
    probes_due(rig)
    pb >> wakeup("probe", 1)
    pb << SetTimer(timer=("probe_timeout", 1), at=2.0)
    pb << (probe := Opens(to=A))
    pb.now = 2.0
    pb >> wakeup("probe_timeout", 1)
    pb << CloseConnection(conn=probe.conn)
    pb << SetTimer(timer=("probe", 1), at=7.0)
    pb.done()
    (down,) = rig.logs("health")
    assert down.fields["up"] is False and down.fields["detail"] == "timeout"
    rig.ask(to=B)
    rig.ask(to=B)
    pb.done()


# -- 14. least streams ------------------------------------------------------------------------


def test_least_streams_avoids_the_server_with_a_long_stream() -> None:
    rig = Routing(fleet(A, B, balance=Balance.LEAST_STREAMS))
    pb = rig.pb
    conn, client, long_stream = rig.ask(to=A)
    rig.accept(long_stream.conn, conn)
    pb >> data(long_stream.conn, rig.sse_head_bytes(long_stream.conn, "gpu0"))  # on and on
    pb << CancelTimer(timer=("head", conn))
    pb << SetTimer(timer=("send", conn), at=60.0)
    pb << Sends(conn, client, h1_response(200))
    pb << SetTimer(timer=("read", conn), at=300.0)
    for _ in range(3):
        # Round-robin would alternate back to A; least streams keeps choosing B.
        rig.serve(*rig.ask(to=B))
    pb >> data(long_stream.conn, rig.chunk(long_stream.conn, b"data: x\n\n"))
    pb << Sends(conn, client, body_is(b"data: x\n\n", end=False))
    rig.stream_ends(long_stream.conn, conn, client)
    assert {rig.ask()[2].server for _ in range(2)} == {A, B}
    pb.done()


def test_failure_of_the_last_primary_falls_through_to_the_backup() -> None:
    config = fleet(
        Server(address="127.0.0.1:9001"),
        Server(address="127.0.0.1:9002", backup=True),
        Server(address="127.0.0.1:9003"),
    )
    rig = Routing(config)
    conn, _, first = rig.ask(to="127.0.0.1:9001")
    first = fails_over(rig, first.conn, conn, avoid=())
    assert first.server == "127.0.0.1:9003"  # the other primary first
    second = fails_over(rig, first.conn, conn, avoid=())
    assert second.server == "127.0.0.1:9002"
    rig.pb.done()
