"""Routing inside the exchange, driven with bytes only: failover and retries, the held SSE
head, sticky sessions, header rules, passive and active health, least streams.

Every request comes from a real h11/h2 client peer and every backend is a real h11 server
peer; the tests assert the commands the core returns and what the peers decode from them.
Time moves only through ``pb.now``.
"""

from __future__ import annotations

import json
from typing import Any

import h2.errors
import h2.events
import h11
import pytest
from playbook import H1ClientPeer, H2ClientPeer, Playbook, Where, data, default_config, wakeup

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
    SendData,
    SetTimer,
)
from muxproxy.core.events import ConfigChanged, OpenFailed, RuntimeChanged
from muxproxy.routing.balancer import rendezvous_order

A, B, C = "127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"
SERVERS = (A, B, C)
RETRY_ALL = frozenset({"error", "timeout", "http_503"})


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


class Rig:
    """A Playbook with many clients and backends; ``take`` returns only what is new."""

    def __init__(self, config: Config) -> None:
        self.pb = Playbook(config)
        self.config = config
        self.backends: dict[int, h11.Connection] = {}
        self._taken: dict[int, int] = {}
        self._next_client = 0

    @property
    def group(self) -> Upstream:
        return self.config.upstreams["default"]

    @property
    def router(self) -> Any:
        return self.pb.core.router(self.group)

    # -- clients -------------------------------------------------------------------------

    def request(
        self,
        target: str = "/v1/chat/completions",
        headers: list[tuple[str, str]] | None = None,
        body: bytes | None = None,
        method: str | None = None,
    ) -> tuple[int, H1ClientPeer]:
        """A new HTTP/1.1 client connection sending one whole request."""
        conn, client = self.connect()
        method = method or ("GET" if body is None else "POST")
        self.pb.receive(conn, client.request(method, target, headers, body))
        return conn, client

    def connect(self) -> tuple[int, H1ClientPeer]:
        self._next_client += 1
        conn = self._next_client
        self.pb.accept(conn)
        return conn, H1ClientPeer()

    def h2_request(self, path: bytes = b"/v1/chat/completions") -> tuple[int, H2ClientPeer, int]:
        conn, _ = self.connect()
        client = H2ClientPeer()
        sid, data = client.request(path=path)
        self.pb.receive(conn, client.preface() + data)
        return conn, client, sid

    def response(self, conn: int, client: H1ClientPeer) -> tuple[h11.Response, bytes, list]:
        events = client.events(self.take(conn))
        head = events[0]
        assert isinstance(head, h11.Response), events
        body = b"".join(bytes(e.data) for e in events if isinstance(e, h11.Data))
        return head, body, events

    def sole_response(self, conn: int, client: H1ClientPeer) -> tuple[h11.Response, bytes]:
        """The whole response the client got, and nothing of an abandoned attempt: one head,
        its body, its end."""
        head, body, events = self.response(conn, client)
        assert sum(isinstance(e, h11.Response) for e in events) == 1, events
        assert isinstance(events[-1], h11.EndOfMessage), events
        return head, body

    # -- backends ------------------------------------------------------------------------

    def opens(self, since: int = 0) -> list[OpenConnection]:
        return [c for c in self.pb.log[since:] if isinstance(c, OpenConnection)]

    def routed(self, since: int) -> set[str]:
        """The servers that got a connection opened, or bytes on a pooled one, since ``since``."""
        origins = {c.conn: str(c.origin) for c in self.opens()}
        return {
            origins[c.conn]
            for c in self.pb.log[since:]
            if isinstance(c, OpenConnection) or (isinstance(c, SendData) and c.conn in origins)
        }

    def last_open(self) -> OpenConnection:
        return self.opens()[-1]

    def open(self, conn: int) -> h11.Connection:
        """The backend accepts connection ``conn``."""
        backend = self.backends[conn] = h11.Connection(h11.SERVER)
        self.pb.opened(conn)
        return backend

    def refuse(self, conn: int) -> list[Command]:
        return self.pb.feed(OpenFailed(now=self.pb.now, conn=conn, reason="refused"))

    def received(self, conn: int) -> list[Any]:
        """Events the backend on ``conn`` decodes from the bytes sent to it since last time."""
        backend = self.backends[conn]
        data = self.take(conn)
        if data:  # b"" would mean EOF to h11
            backend.receive_data(data)
        out = []
        while True:
            event = backend.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return out
            out.append(event)
            if type(event) is h11.ConnectionClosed:
                return out

    def answer(
        self,
        conn: int,
        status: int = 200,
        body: bytes = b"ok",
        headers: list[tuple[str, str]] | None = None,
    ) -> list[Command]:
        """The backend on ``conn`` sends a whole response with a Content-Length."""
        return self.pb.receive(conn, self.response_bytes(conn, status, body, headers))

    def response_bytes(
        self,
        conn: int,
        status: int = 200,
        body: bytes = b"ok",
        headers: list[tuple[str, str]] | None = None,
    ) -> bytes:
        """What ``answer`` feeds: a whole response of the backend on ``conn``."""
        backend = self.backends[conn]
        hdrs = [("Content-Length", str(len(body))), *(headers or [])]
        wire = backend.send(h11.Response(status_code=status, headers=hdrs)) or b""
        wire += (backend.send(h11.Data(data=body)) or b"") if body else b""
        wire += backend.send(h11.EndOfMessage()) or b""
        if backend.our_state is h11.DONE and backend.their_state is h11.DONE:
            backend.start_next_cycle()  # ready for the next request on a kept-alive connection
        return wire

    def sse_start(self, conn: int, backend_id: str) -> list[Command]:
        """The backend accepts ``conn``, reads the request and answers with an SSE head."""
        self.open(conn)
        self.received(conn)
        return self.sse_head(conn, backend_id)

    def sse_head(self, conn: int, backend_id: str) -> list[Command]:
        headers = [("Content-Type", "text/event-stream"), ("X-Backend-Id", backend_id)]
        wire = self.backends[conn].send(h11.Response(status_code=200, headers=headers)) or b""
        return self.pb.receive(conn, wire)

    def chunk(self, conn: int, data: bytes) -> list[Command]:
        return self.pb.receive(conn, self.backends[conn].send(h11.Data(data=data)) or b"")

    def end(self, conn: int) -> list[Command]:
        return self.pb.receive(conn, self.backends[conn].send(h11.EndOfMessage()) or b"")

    def retry_after_close(self, first: OpenConnection) -> OpenConnection:
        """The backend of ``first`` closes before its answer went out; the one connection the
        core opens in its place, to another server."""
        mark = len(self.pb.log)
        self.pb.closed(first.conn)
        (second,) = self.opens(mark)
        assert origin(second) != origin(first)
        return second

    def serve(self, body: bytes = b"ok") -> list[str]:
        """Accept and answer 200 every connection still being opened; return their servers."""
        served = []
        for cmd in self.opens():
            if cmd.conn not in self.backends and cmd.conn in self.pb.core.upstreams:
                self.open(cmd.conn)
                self.received(cmd.conn)
                self.answer(cmd.conn, body=body)
                served.append(str(cmd.origin))
        return served

    # -- output --------------------------------------------------------------------------

    def take(self, conn: int) -> bytes:
        start = self._taken.get(conn, 0)
        self._taken[conn] = len(self.pb.log)
        return self.pb.take(conn, self.pb.log[start:])

    def logs(self, event: str) -> list[Log]:
        return [c for c in self.pb.log if isinstance(c, Log) and c.event == event]

    def timer(self, kind: str) -> SetTimer:
        """The latest SetTimer of ``kind``."""
        return [c for c in self.pb.log if isinstance(c, SetTimer) and c.timer[0] == kind][-1]

    def fire(self, kind: str) -> list[Command]:
        """Move time to the latest ``kind`` timer's deadline and deliver its Wakeup."""
        armed = self.timer(kind)
        self.pb.now = max(self.pb.now, armed.at)
        return self.pb.wakeup(*armed.timer)


def origin(cmd: OpenConnection) -> str:
    return str(cmd.origin)


def request_body(events: list[Any]) -> bytes:
    return b"".join(bytes(e.data) for e in events if isinstance(e, h11.Data))


def header(msg: Any, name: bytes) -> list[bytes]:
    return [v for n, v in msg.headers if n == name]


# -- 1. failover on connect errors ------------------------------------------------------------


def test_refused_connect_fails_over_to_the_next_server() -> None:
    rig = Rig(fleet())
    conn, client = rig.request()
    (first,) = rig.opens()
    mark = len(rig.pb.log)
    rig.refuse(first.conn)
    (second,) = rig.opens(mark)
    assert origin(second) != origin(first)
    (retry,) = rig.logs("retry")
    assert retry.fields["upstream"] == origin(first)
    assert retry.fields["condition"] == "error"
    assert not rig.take(conn)  # nothing reached the client yet
    rig.open(second.conn)
    assert isinstance(rig.received(second.conn)[0], h11.Request)
    rig.answer(second.conn, body=b"from the second backend")
    head, body, _ = rig.response(conn, client)
    assert head.status_code == 200
    assert body == b"from the second backend"
    (access,) = rig.logs("access")
    assert access.fields["tries"] == 2
    assert access.fields["server"] == origin(second)


def test_tries_bounds_the_attempts_then_502() -> None:
    rig = Rig(fleet(next_upstream=NextUpstream(tries=2)))
    conn, client = rig.request()
    rig.refuse(rig.last_open().conn)
    rig.refuse(rig.last_open().conn)
    opens = rig.opens()
    assert len(opens) == 2
    assert len({origin(o) for o in opens}) == 2
    assert len(rig.logs("retry")) == 1
    head, body, _ = rig.response(conn, client)
    assert head.status_code == 502
    assert body == b"upstream unavailable\n"
    assert rig.logs("access")[0].fields["tries"] == 2


# -- 2. failover on timeouts ----------------------------------------------------------------


@pytest.mark.parametrize("timer", ["connect", "head"])
def test_timeout_fails_over_to_the_next_server(timer: str) -> None:
    rig = Rig(fleet(timeouts=Timeouts(connect=2, response_head=3)))
    conn, client = rig.request()
    first = rig.last_open()
    if timer == "head":
        rig.open(first.conn)
        rig.received(first.conn)
    armed = rig.timer(timer)
    assert armed.at == (2 if timer == "connect" else 3)
    pb = rig.pb
    pb.now = armed.at
    mark = len(pb.log)
    pb >> wakeup(*armed.timer)
    pb << CloseConnection(conn=first.conn)  # the slow attempt is abandoned
    # The next attempt has its own deadline, counted from its own start.
    pb << SetTimer(timer=("connect", 1), at=pb.now + 2)
    pb << Where(OpenConnection, lambda c: origin(c) != origin(first))
    pb.done()
    (second,) = rig.opens(mark)
    assert rig.logs("retry")[0].fields["condition"] == "timeout"
    rig.open(second.conn)
    rig.received(second.conn)
    rig.answer(second.conn, body=b"second")
    head, body, _ = rig.response(conn, client)
    assert (head.status_code, body) == (200, b"second")


@pytest.mark.parametrize("timer", ["connect", "head"])
def test_timeout_not_in_next_upstream_answers_504_at_once(timer: str) -> None:
    config = fleet(
        timeouts=Timeouts(connect=2, response_head=3),
        next_upstream=NextUpstream(on=frozenset({"error"})),
    )
    rig = Rig(config)
    conn, client = rig.request()
    if timer == "head":
        rig.open(rig.last_open().conn)
    rig.fire(timer)
    assert len(rig.opens()) == 1
    assert not rig.logs("retry")
    head, _, _ = rig.response(conn, client)
    assert head.status_code == 504


# -- 3. failover on a configured status ------------------------------------------------------


def test_configured_status_is_retried_on_another_server() -> None:
    rig = Rig(fleet(next_upstream=NextUpstream(on=RETRY_ALL)))
    conn, client = rig.request()
    first = rig.last_open()
    rig.open(first.conn)
    rig.received(first.conn)
    mark = len(rig.pb.log)
    rig.pb >> data(first.conn, rig.response_bytes(first.conn, 503, b"overloaded"))
    rig.pb << CancelTimer(timer=("head", 1))
    rig.pb << CloseConnection(conn=first.conn)
    rig.pb << SetTimer(timer=("connect", 1), at=5.0)
    rig.pb << Where(OpenConnection, lambda c: origin(c) != origin(first))
    rig.pb.done()  # the 503 never reached the client
    (second,) = rig.opens(mark)
    assert rig.logs("retry")[0].fields["condition"] == "http_503"
    rig.open(second.conn)
    rig.received(second.conn)
    rig.answer(second.conn, body=b"fine")
    head, body, _ = rig.response(conn, client)
    assert (head.status_code, body) == (200, b"fine")


def test_status_not_configured_is_passed_through() -> None:
    rig = Rig(fleet())  # on = {"error", "timeout"}
    conn, client = rig.request()
    first = rig.last_open()
    rig.open(first.conn)
    rig.received(first.conn)
    rig.answer(first.conn, 503, b"overloaded")
    assert len(rig.opens()) == 1
    head, body, _ = rig.response(conn, client)
    assert (head.status_code, body) == (503, b"overloaded")


def test_stale_messages_of_an_abandoned_attempt_do_not_touch_the_retry() -> None:
    """A 503 head and a broken body arrive in one read: the broken body belongs to the
    abandoned attempt and must not fail (or count against) the server now being tried."""
    rig = Rig(fleet(next_upstream=NextUpstream(on=RETRY_ALL)))
    conn, client = rig.request()
    first = rig.last_open()
    backend = rig.open(first.conn)
    rig.received(first.conn)
    head = backend.send(h11.Response(status_code=503, headers=[("Transfer-Encoding", "chunked")]))
    mark = len(rig.pb.log)
    rig.pb.receive(first.conn, (head or b"") + b"zz-not-a-chunk-size\r\n")
    opens = rig.opens(mark)
    assert len(opens) == 1, "only the server after the 503 is tried"
    assert len(rig.logs("retry")) == 1
    assert not rig.logs("access")  # the exchange is still running on the second server
    rig.open(opens[0].conn)
    rig.received(opens[0].conn)
    rig.answer(opens[0].conn, body=b"fine")
    status, body, _ = rig.response(conn, client)
    assert (status.status_code, body) == (200, b"fine")


# -- 4. body replay ------------------------------------------------------------------------


def test_request_body_is_replayed_on_the_retry() -> None:
    rig = Rig(fleet())
    payload = json.dumps({"messages": [{"role": "user", "content": "hi" * 50}]}).encode()
    conn, client = rig.request(body=payload)
    first = rig.last_open()
    rig.open(first.conn)
    got = rig.received(first.conn)
    assert request_body(got) == payload
    assert isinstance(got[-1], h11.EndOfMessage)
    mark = len(rig.pb.log)
    rig.pb.closed(first.conn)  # dies before answering
    (second,) = rig.opens(mark)
    rig.open(second.conn)
    got = rig.received(second.conn)
    assert isinstance(got[0], h11.Request) and got[0].method == b"POST"
    assert request_body(got) == payload
    assert isinstance(got[-1], h11.EndOfMessage)
    rig.answer(second.conn, body=b"done")
    head, body, _ = rig.response(conn, client)
    assert (head.status_code, body) == (200, b"done")


def test_body_larger_than_the_replay_buffer_is_not_retried() -> None:
    rig = Rig(fleet(next_upstream=NextUpstream(replay_buffer=16)))
    payload = b"x" * 40
    conn, client = rig.request(body=payload)
    first = rig.last_open()
    rig.open(first.conn)
    assert request_body(rig.received(first.conn)) == payload  # streamed without a copy
    rig.pb.closed(first.conn)
    assert len(rig.opens()) == 1
    assert not rig.logs("retry")
    (skipped,) = rig.logs("retry_skipped")
    assert "replay buffer" in skipped.fields["reason"]
    head, _, _ = rig.response(conn, client)
    assert head.status_code == 502


def test_retry_onto_a_kept_alive_connection_replays_the_body() -> None:
    """The next server's idle pooled connection is taken at once (no OpenConnection); the
    body still goes out in full, after the head."""
    rig = Rig(fleet(A, B, pool_max_idle=4))
    for expected in (A, B):  # leave one idle kept-alive connection on each server
        rig.request()
        assert rig.serve() == [expected]
    pooled = {origin(o): o.conn for o in rig.opens()}
    payload = b'{"prompt": "replay me"}'
    mark = len(rig.pb.log)
    conn, client = rig.request(body=payload)
    assert rig.routed(mark) == {A}
    got = rig.received(pooled[A])
    assert request_body(got) == payload
    # Written, so this POST is no stale-pool retry (test_stale_pool.py): next_upstream's.
    rig.pb.sent(pooled[A], len(got))
    rig.pb.closed(pooled[A])  # the keep-alive race: A closed as the request went out
    assert len(rig.opens()) == 2  # B's idle connection was used, nothing new opened
    got = rig.received(pooled[B])
    assert isinstance(got[0], h11.Request)
    assert request_body(got) == payload
    assert isinstance(got[-1], h11.EndOfMessage)
    rig.answer(pooled[B], body=b"from B")
    head, body, _ = rig.response(conn, client)
    assert (head.status_code, body) == (200, b"from B")


def test_deadlines_of_an_abandoned_attempt_do_not_reach_the_next_one() -> None:
    rig = Rig(fleet(group_timeouts=GroupTimeouts(first_token=5), timeouts=Timeouts(connect=8)))
    rig.request()
    first = rig.last_open()
    rig.open(first.conn)
    rig.received(first.conn)
    first_token = rig.timer("first_token")
    rig.pb.now = 1.0
    rig.pb.closed(first.conn)  # fails before answering: retried, the next one connects
    second = rig.last_open()
    assert second != first
    rig.pb.now = first_token.at
    # The first attempt's first-token deadline passes while the second still connects.
    assert rig.pb.wakeup(*first_token.timer) == []
    assert len(rig.opens()) == 2
    assert len(rig.logs("retry")) == 1


# -- 5. nothing is retried after the first response byte -------------------------------------


def test_backend_death_mid_stream_truncates_and_is_not_retried() -> None:
    rig = Rig(fleet(next_upstream=NextUpstream(on=RETRY_ALL)))
    conn, client, sid = rig.h2_request()
    first = rig.last_open()
    rig.sse_start(first.conn, "gpu0")
    rig.chunk(first.conn, b"data: 1\n\n")
    rig.pb.closed(first.conn)
    assert len(rig.opens()) == 1
    assert not rig.logs("retry")
    events = client.events(rig.take(conn))
    resets = [e for e in events if isinstance(e, h2.events.StreamReset)]
    assert [(r.stream_id, r.error_code) for r in resets] == [
        (sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
    ]
    assert not any(isinstance(e, h2.events.StreamEnded) for e in events)


# -- 6. tries_timeout -----------------------------------------------------------------------


@pytest.mark.parametrize(("elapsed", "retried"), [(4.0, True), (5.0, False), (7.0, False)])
def test_no_retry_after_tries_timeout(elapsed: float, retried: bool) -> None:
    rig = Rig(fleet(next_upstream=NextUpstream(tries_timeout=5)))
    conn, client = rig.request()
    first = rig.last_open()
    rig.pb.now = elapsed
    rig.refuse(first.conn)
    assert (len(rig.opens()) == 2) is retried
    assert bool(rig.logs("retry")) is retried
    if not retried:
        head, _, _ = rig.response(conn, client)
        assert head.status_code == 502


# -- 7. retry_until_first_event ---------------------------------------------------------------


def test_held_sse_head_goes_out_with_the_first_event() -> None:
    rig = Rig(fleet(retry_until_first_event=True))
    conn, client = rig.request()
    up = rig.last_open().conn
    rig.sse_start(up, "gpu0")
    assert not rig.take(conn)  # held
    rig.chunk(up, b"data: first\n\n")
    events = client.events(rig.take(conn))
    assert isinstance(events[0], h11.Response)
    assert header(events[0], b"x-backend-id") == [b"gpu0"]
    assert [bytes(e.data) for e in events[1:]] == [b"data: first\n\n"]
    rig.chunk(up, b"data: second\n\n")
    rig.end(up)
    events = client.events(rig.take(conn))
    assert [type(e) for e in events] == [h11.Data, h11.EndOfMessage]


def test_backend_dying_before_the_first_event_is_retried_transparently() -> None:
    rig = Rig(fleet(retry_until_first_event=True))
    conn, client = rig.request()
    first = rig.last_open()
    rig.sse_start(first.conn, "gpu0")
    second = rig.retry_after_close(first)
    assert rig.logs("retry")[0].fields["condition"] == "error"
    assert not rig.take(conn)
    rig.sse_start(second.conn, "gpu1")
    rig.chunk(second.conn, b"data: a\n\n")
    rig.chunk(second.conn, b"data: b\n\n")
    rig.end(second.conn)
    head, body = rig.sole_response(conn, client)
    assert header(head, b"x-backend-id") == [b"gpu1"]
    assert body == b"data: a\n\ndata: b\n\n"
    assert rig.logs("access")[0].fields["outcome"] == "ok"


def test_non_sse_response_is_not_held() -> None:
    rig = Rig(fleet(retry_until_first_event=True))
    conn, client = rig.request()
    up = rig.last_open().conn
    backend = rig.open(up)
    rig.received(up)
    head = backend.send(
        h11.Response(
            status_code=200,
            headers=[("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")],
        )
    )
    rig.pb.receive(up, head or b"")
    events = client.events(rig.take(conn))
    assert len(events) == 1 and isinstance(events[0], h11.Response)


def test_held_head_is_bounded_by_the_read_timeout() -> None:
    """A backend that sends an SSE head and then nothing must not hold the client forever:
    the idle (read) deadline applies while the head is held, and its expiry is retried."""
    rig = Rig(fleet(retry_until_first_event=True, timeouts=Timeouts(read=4)))
    conn, client = rig.request()
    first = rig.last_open()
    rig.open(first.conn)
    rig.received(first.conn)
    rig.pb.now = 1.0
    rig.sse_head(first.conn, "gpu0")
    assert rig.timer("read").at == 5.0  # within tries_timeout (10), so it may be retried
    mark = len(rig.pb.log)
    commands = rig.fire("read")
    assert CloseConnection(conn=first.conn) in commands
    (second,) = rig.opens(mark)
    assert origin(second) != origin(first)
    assert rig.logs("retry")[0].fields["condition"] == "timeout"
    rig.sse_start(second.conn, "gpu1")
    rig.chunk(second.conn, b"data: a\n\n")
    events = client.events(rig.take(conn))
    assert header(events[0], b"x-backend-id") == [b"gpu1"]


# -- 8. first-token timeout ---------------------------------------------------------------


def test_first_token_timeout_while_held_is_retried() -> None:
    rig = Rig(fleet(retry_until_first_event=True, group_timeouts=GroupTimeouts(first_token=5)))
    conn, client = rig.request()
    first = rig.last_open()
    rig.open(first.conn)
    rig.received(first.conn)
    assert rig.timer("first_token").at == 5
    rig.pb.now = 1.0
    rig.sse_head(first.conn, "gpu0")
    mark = len(rig.pb.log)
    commands = rig.fire("first_token")
    assert CloseConnection(conn=first.conn) in commands
    (second,) = rig.opens(mark)
    assert origin(second) != origin(first)
    assert rig.logs("retry")[0].fields["condition"] == "timeout"
    rig.open(second.conn)
    rig.received(second.conn)
    assert rig.timer("first_token").at == rig.pb.now + 5  # a fresh deadline per attempt
    rig.sse_head(second.conn, "gpu1")
    rig.chunk(second.conn, b"data: a\n\n")
    events = client.events(rig.take(conn))
    assert header(events[0], b"x-backend-id") == [b"gpu1"]
    assert request_body(events) == b"data: a\n\n"


def test_first_token_timeout_after_the_head_went_out_truncates() -> None:
    config = fleet(
        next_upstream=NextUpstream(on=RETRY_ALL), group_timeouts=GroupTimeouts(first_token=5)
    )
    rig = Rig(config)
    conn, client, sid = rig.h2_request()
    first = rig.last_open()
    rig.sse_start(first.conn, "gpu0")
    events = client.events(rig.take(conn))
    assert any(isinstance(e, h2.events.ResponseReceived) for e in events)
    commands = rig.fire("first_token")
    assert CloseConnection(conn=first.conn) in commands
    assert len(rig.opens()) == 1
    events = client.events(rig.take(conn))
    resets = [e for e in events if isinstance(e, h2.events.StreamReset)]
    assert [(r.stream_id, r.error_code) for r in resets] == [
        (sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
    ]


# -- 9. sticky sessions ----------------------------------------------------------------------

HEADER_KEY = Sticky(sources=(SessionSource(kind="header", name="x-session-id"),))


def owner(rig: Rig, key: bytes) -> str:
    """The server that weighted rendezvous hashing gives ``key`` with every server usable."""
    router = rig.router
    order = rendezvous_order(key, router.ids, router.weights, range(len(rig.group.servers)))
    return rig.group.servers[order[0]].address


def test_header_session_key_maps_to_the_same_server_and_keys_spread() -> None:
    rig = Rig(fleet(sticky=HEADER_KEY))
    chosen: dict[str, set[str]] = {}
    for round_ in range(3):
        for i in range(12):
            key = f"conv-{i}"
            rig.request(headers=[("X-Session-Id", key)])
            chosen.setdefault(key, set()).add(origin(rig.last_open()))
        rig.serve()
        assert round_ < 1 or all(len(s) == 1 for s in chosen.values())
    assert all(s == {owner(rig, k.encode())} for k, s in chosen.items())
    assert len(set().union(*chosen.values())) >= 2  # different keys spread over the fleet


COOKIE = Sticky(cookie=StickyCookie(name="mp_srv"))


def sticky_cookie(head: h11.Response) -> bytes | None:
    values = [v for v in header(head, b"set-cookie") if v.startswith(b"mp_srv=")]
    assert len(values) <= 1
    return values[0].split(b";")[0].partition(b"=")[2] if values else None


def cookie_request(rig: Rig, value: bytes | None) -> tuple[h11.Response, str]:
    headers = [] if value is None else [("Cookie", f"a=1; mp_srv={value.decode()}")]
    conn, client = rig.request(headers=headers)
    (served,) = rig.serve()
    head, _, _ = rig.response(conn, client)
    assert head.status_code == 200
    return head, served


def test_sticky_cookie_pins_the_server_even_while_it_drains() -> None:
    rig = Rig(fleet(sticky=COOKIE))
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
    rig.pb.feed(RuntimeChanged(now=rig.pb.now, state=drain))  # no new sessions, pins stay
    for _ in range(4):
        head, served = cookie_request(rig, value)
        assert served == first
        assert sticky_cookie(head) is None  # already pinned there: no new cookie
    for _ in range(4):
        _, served = cookie_request(rig, None)
        assert served != first


def test_sticky_cookie_naming_an_unknown_server_falls_back() -> None:
    rig = Rig(fleet(sticky=COOKIE))
    head, served = cookie_request(rig, b"0123456789abcdef")
    index = [s.address for s in rig.group.servers].index(served)
    assert sticky_cookie(head) == rig.router.ids[index]  # re-pinned to where it went
    head, _ = cookie_request(rig, b"not a server id at all")
    assert sticky_cookie(head) is not None


def test_sticky_cookie_naming_a_down_server_falls_back() -> None:
    rig = Rig(fleet(sticky=COOKIE))
    head, pinned = cookie_request(rig, None)
    value = sticky_cookie(head)
    assert value is not None
    # A pinned request finds its server refusing: it fails over, and the server is out.
    conn, client = rig.request(headers=[("Cookie", f"mp_srv={value.decode()}")])
    assert origin(rig.last_open()) == pinned
    rig.refuse(rig.last_open().conn)
    (other,) = rig.serve()
    assert other != pinned
    head, _, _ = rig.response(conn, client)
    assert head.status_code == 200
    assert sticky_cookie(head) not in (None, value)  # re-pinned to the server that answered
    # While the pinned server is out, its cookie no longer routes there.
    rig.pb.now = 1.0
    mark = len(rig.pb.log)
    _, served = cookie_request(rig, value)
    assert served != pinned
    assert all(origin(o) != pinned for o in rig.opens(mark))


# -- 10. JSON body key -----------------------------------------------------------------------

BODY_KEY = Sticky(sources=(SessionSource(kind="body", name="metadata.session_id"),))


def test_json_body_key_holds_the_request_until_the_body_is_complete() -> None:
    rig = Rig(fleet(sticky=BODY_KEY))
    # A key owned by a server other than the one the balancer would pick first (A).
    key = next(f"s-{i}" for i in range(100) if owner(rig, f"s-{i}".encode()) == C)
    body = json.dumps({"model": "m", "metadata": {"session_id": key}}).encode()
    conn, client = rig.connect()
    head = client.conn.send(
        h11.Request(
            method="POST",
            target="/v1/chat/completions",
            headers=[("Host", "proxy.example"), ("Content-Length", str(len(body)))],
        )
    )
    rig.pb.receive(conn, head or b"")
    assert not rig.opens()  # held: the key may be in the body
    rig.pb.receive(conn, client.conn.send(h11.Data(data=body[:10])) or b"")
    assert not rig.opens()
    rig.pb.receive(conn, client.conn.send(h11.Data(data=body[10:])) or b"")
    rig.pb.receive(conn, client.conn.send(h11.EndOfMessage()) or b"")
    (open_cmd,) = rig.opens()
    assert origin(open_cmd) == C
    rig.open(open_cmd.conn)
    got = rig.received(open_cmd.conn)
    assert request_body(got) == body  # the backend gets the body unchanged
    assert isinstance(got[-1], h11.EndOfMessage)
    rig.answer(open_cmd.conn)
    status, _, _ = rig.response(conn, client)
    assert status.status_code == 200
    # The same key in another request goes to the same server; another key elsewhere.
    other = next(f"s-{i}" for i in range(100) if owner(rig, f"s-{i}".encode()) == B)
    for session, expected in ((key, C), (other, B)):
        body = json.dumps({"metadata": {"session_id": session}}).encode()
        rig.request(body=body)
        assert origin(rig.last_open()) == expected


@pytest.mark.parametrize("replay_buffer", [0, 16])
def test_json_body_key_works_without_a_replay_copy(replay_buffer: int) -> None:
    """The held body is all there when it is routed, even if it is too big to be kept for a
    replay: the key must still be found (``replay_buffer = 0`` turns replays off)."""
    config = fleet(sticky=BODY_KEY, next_upstream=NextUpstream(replay_buffer=replay_buffer))
    rig = Rig(config)
    key = next(f"s-{i}" for i in range(100) if owner(rig, f"s-{i}".encode()) == C)
    body = json.dumps({"metadata": {"session_id": key}, "padding": "x" * 40}).encode()
    assert len(body) > replay_buffer
    rig.request(body=body)
    (open_cmd,) = rig.opens()
    assert origin(open_cmd) == C
    rig.open(open_cmd.conn)
    assert request_body(rig.received(open_cmd.conn)) == body


# -- 11. passive health ----------------------------------------------------------------------


def test_failed_server_is_skipped_until_fail_timeout_passed() -> None:
    servers = [Server(address=a, max_fails=1, fail_timeout=10) for a in (A, B)]
    rig = Rig(fleet(*servers))
    rig.request()
    assert origin(rig.last_open()) == A
    rig.refuse(rig.last_open().conn)
    assert rig.serve() == [B]
    for now in (5.0, 9.9):
        rig.pb.now = now
        for _ in range(2):
            rig.request()
            assert origin(rig.last_open()) == B
        rig.serve()
    rig.pb.now = 10.0
    mark = len(rig.pb.log)
    rig.request()
    rig.request()
    assert {origin(o) for o in rig.opens(mark)} == {A, B}


def test_no_usable_server_answers_503_at_once() -> None:
    rig = Rig(fleet(A, B))
    conn, client = rig.request()
    rig.refuse(rig.last_open().conn)
    rig.refuse(rig.last_open().conn)
    head, _, _ = rig.response(conn, client)
    assert head.status_code == 502
    opened = len(rig.opens())
    conn, client = rig.request()
    assert len(rig.opens()) == opened  # no OpenConnection
    head, body, _ = rig.response(conn, client)
    assert head.status_code == 503
    assert body == b"no backend available\n"


def test_backup_is_used_only_when_every_primary_is_down() -> None:
    servers = (Server(address=A), Server(address=B), Server(address=C, backup=True))
    rig = Rig(fleet(*servers, next_upstream=NextUpstream(tries=1)))
    for _ in range(6):
        rig.request()
    assert {origin(o) for o in rig.opens()} == {A, B}
    rig.serve()
    mark = len(rig.pb.log)
    rig.request()
    rig.refuse(rig.last_open().conn)  # one primary down: the other takes the traffic
    rig.request()
    assert origin(rig.last_open()) != C
    rig.refuse(rig.last_open().conn)  # both primaries down
    assert {origin(o) for o in rig.opens(mark)} == {A, B}
    for _ in range(3):
        rig.request()
        assert origin(rig.last_open()) == C


# -- 12. header rules ------------------------------------------------------------------------


def test_header_rules_set_and_remove_backend_request_headers() -> None:
    rules = (
        HeaderRule(name="x-chat-id", value="$session_key"),
        HeaderRule(name="x-user-id", value="$arg_user"),
    )
    rig = Rig(fleet(sticky=HEADER_KEY, set_headers=rules))
    rig.request(
        "/v1/chat/completions?user=alice",
        headers=[("X-Session-Id", "conv-7"), ("X-Chat-Id", "forged")],
    )
    up = rig.last_open().conn
    rig.open(up)
    request = rig.received(up)[0]
    assert header(request, b"x-chat-id") == [b"conv-7"]
    assert header(request, b"x-user-id") == [b"alice"]
    assert header(request, b"x-session-id") == [b"conv-7"]
    # Nothing to expand: the header is removed, also when the client sent one itself.
    rig.request(headers=[("X-User-Id", "spoofed"), ("X-Chat-Id", "forged")])
    up = rig.last_open().conn
    rig.open(up)
    request = rig.received(up)[0]
    assert header(request, b"x-user-id") == []
    assert header(request, b"x-chat-id") == []
    assert header(request, b"host") == [b"proxy.example"]


# -- 13. active health -----------------------------------------------------------------------

CHECK = HealthCheck(path="/health", interval=5, timeout=2, passes=1, fails=1)


def start_probes(rig: Rig) -> list[Command]:
    commands = rig.pb.feed(ConfigChanged(now=rig.pb.now, config=rig.config))
    probes = [c.timer for c in commands if isinstance(c, SetTimer) and c.timer[0] == "probe"]
    assert [c.at for c in commands if isinstance(c, SetTimer)] == [0.0, 0.0]
    assert len(probes) == 2
    return commands


def probe_a(rig: Rig, status: int) -> list[Log]:
    """Run server A's probe (ident 1) answering ``status``; return the health logs."""
    mark = len(rig.pb.log)
    commands = rig.pb.wakeup("probe", 1)
    assert SetTimer(timer=("probe_timeout", 1), at=rig.pb.now + 2) in commands
    opens = [c for c in commands if isinstance(c, OpenConnection)]
    if opens:  # a fresh connection; later probes reuse the kept-alive one
        assert origin(opens[0]) == A
        rig.open(opens[0].conn)
        up = opens[0].conn
    else:
        (up,) = rig.backends
    request, end = rig.received(up)
    assert (request.method, request.target) == (b"GET", b"/health")
    assert isinstance(end, h11.EndOfMessage)
    rig.answer(up, status, b"")
    assert SetTimer(timer=("probe", 1), at=rig.pb.now + 5) in rig.pb.log[mark:]
    return [c for c in rig.pb.log[mark:] if isinstance(c, Log) and c.event == "health"]


def test_active_health_check_takes_a_server_down_and_brings_it_back() -> None:
    # Probe connections are kept alive: the second probe reuses the first one's.
    rig = Rig(fleet(A, B, health_check=CHECK, pool_max_idle=4))
    start_probes(rig)
    (down,) = probe_a(rig, 500)
    assert down.fields["server"] == A and down.fields["up"] is False
    mark = len(rig.pb.log)
    for _ in range(4):
        rig.request()
    assert rig.routed(mark) == {B}
    rig.pb.now = 5.0
    opened = len(rig.opens())
    (up,) = probe_a(rig, 200)
    assert len(rig.opens()) == opened  # the kept-alive probe connection was reused
    assert up.fields["server"] == A and up.fields["up"] is True
    mark = len(rig.pb.log)
    for _ in range(4):
        rig.request()
    assert rig.routed(mark) == {A, B}


def test_probe_timeout_counts_as_a_failure() -> None:
    rig = Rig(fleet(A, B, health_check=CHECK))
    start_probes(rig)
    commands = rig.pb.wakeup("probe", 1)
    (open_cmd,) = [c for c in commands if isinstance(c, OpenConnection)]
    rig.pb.now = 2.0
    commands = rig.pb.wakeup("probe_timeout", 1)
    assert CloseConnection(conn=open_cmd.conn) in commands
    (down,) = [c for c in commands if isinstance(c, Log) and c.event == "health"]
    assert down.fields["up"] is False and down.fields["detail"] == "timeout"
    assert SetTimer(timer=("probe", 1), at=7.0) in commands
    mark = len(rig.pb.log)
    rig.request()
    rig.request()
    assert {origin(o) for o in rig.opens(mark)} == {B}


# -- 14. least streams ------------------------------------------------------------------------


def test_least_streams_avoids_the_server_with_a_long_stream() -> None:
    rig = Rig(fleet(A, B, balance=Balance.LEAST_STREAMS))
    rig.request()
    long_stream = rig.last_open()
    assert origin(long_stream) == A
    rig.sse_start(long_stream.conn, "gpu0")  # streams on and on
    for _ in range(3):
        # Round-robin would alternate back to A; least streams keeps choosing B.
        rig.request()
        assert origin(rig.last_open()) == B
        rig.serve()
    rig.chunk(long_stream.conn, b"data: x\n\n")
    rig.end(long_stream.conn)
    mark = len(rig.pb.log)
    rig.request()
    rig.request()
    assert {origin(o) for o in rig.opens(mark)} == {A, B}


def test_failure_of_the_last_primary_falls_through_to_the_backup() -> None:
    config = fleet(
        Server(address="127.0.0.1:9001"),
        Server(address="127.0.0.1:9002", backup=True),
        Server(address="127.0.0.1:9003"),
    )
    pb = Playbook(config)
    client = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, client.request())
    (first,) = pb.opens()
    assert first.origin.port == 9001
    pb.feed(OpenFailed(now=pb.now, conn=first.conn, reason="refused"))
    first = pb.opens()[-1]
    assert first.origin.port == 9003  # the other primary first
    pb.feed(OpenFailed(now=pb.now, conn=first.conn, reason="refused"))
    second = pb.opens()[-1]
    assert second.origin.port == 9002
