"""LLM-aware balancing and admission inside the core, as conversations: least load, prefix
affinity, the admission queue (fairness, priority, timeout, a client that leaves), token
budgets, and the engines' load reports.

Clients are real h11 peers, backends real h11 server peers (``Llm``, a ``Routing`` of
``test_routing_exchange`` with the phrases of a queue and a stream); each conversation
asserts every command, timers included. Time moves only through ``pb.now``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import attrs
import h11
from checks import h1_body, h1_request, h1_response
from playbook import (
    Capture,
    H1BackendPeer,
    H1ClientPeer,
    Sends,
    Where,
    closed,
    data,
    open_failed,
    opened,
    wakeup,
)
from test_routing_exchange import CHAT, A, B, Opens, Routing, body_is, fleet

from muxproxy.config import (
    AdmissionQueue,
    AffinityMode,
    Api,
    Balance,
    Config,
    LoadReporting,
    PrefixAffinity,
    RateLimit,
    Route,
    Server,
    SessionSource,
    Sticky,
)
from muxproxy.core.commands import CancelTimer, CloseConnection, Log, SetTimer
from muxproxy.core.events import ConfigChanged
from muxproxy.core.ports import Phase

SYSTEM = "You are the support agent of a large company. " * 40
JSON = ("Content-Type", "application/json")


def chat(user: str = "hi", *, system: str | None = None, max_tokens: int | None = None) -> bytes:
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": user})
    body: dict[str, Any] = {"model": "m", "messages": messages, "stream": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return json.dumps(body).encode()


def chat_turns(*turns: str, system: str | None = None) -> bytes:
    """A conversation's request: the user's and the assistant's turns in turn."""
    body = json.loads(chat(turns[0], system=system))
    roles = ("assistant", "user")
    body["messages"] += [{"role": roles[n % 2], "content": t} for n, t in enumerate(turns[1:])]
    return json.dumps(body).encode()


def stream_end(events: Any) -> None:
    assert [type(e) for e in events] == [h11.EndOfMessage], events


class Llm(Routing):
    """A ``Routing`` whose requests may wait in the admission queue and whose backends
    answer with SSE streams; ``streams`` maps a backend connection to the exchange it
    serves (client connection, client peer, whether the request had a body)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.body_key = self.body_key or self.group.reads_body  # held to read the body first
        self.streams: dict[int, tuple[int, H1ClientPeer, bool]] = {}

    def post(
        self,
        body: bytes,
        headers: list[tuple[str, str]] | None = None,
        *,
        to: str | None = None,
        avoid: Iterable[str] = (),
    ) -> tuple[int, H1ClientPeer, Opens]:
        """A JSON POST that the core sends on at once, to ``to`` (not to one of ``avoid``)."""
        return self.ask(body=body, headers=[JSON, *(headers or [])], to=to, avoid=avoid)

    def waits(
        self, body: bytes, headers: list[tuple[str, str]] | None = None
    ) -> tuple[int, H1ClientPeer]:
        """A JSON POST that waits in the queue: nothing is sent (a retry stays possible),
        the queue deadline starts; returns the exchange and its client."""
        pb = self.pb
        conn, client = self.connect()
        pb >> data(conn, client.request("POST", CHAT, [JSON, *(headers or [])], body))
        pb << CancelTimer(timer=("header", conn))
        body_timer = SetTimer(timer=("body", conn), at=pb.now + self.body_gap_s)
        if self.body_key:  # held for the body: its timer first
            pb << body_timer
        pb << SetTimer(timer=("queue", conn), at=pb.now + self.group.queue.timeout)
        if not self.body_key:
            pb << body_timer
        pb.done()
        return conn, client

    def refused(
        self, body: bytes | None, headers: list[tuple[str, str]] | None = None
    ) -> tuple[h11.Response, bytes]:
        """A request (a JSON POST of ``body``, or a GET) refused 429 at once: no backend;
        the head and body the client got."""
        pb = self.pb
        conn, client = self.connect()
        method, hdrs = ("GET", headers) if body is None else ("POST", [JSON, *(headers or [])])
        pb >> data(conn, client.request(method, CHAT, hdrs, body))
        pb << CancelTimer(timer=("header", conn))
        held = body is not None and self.body_key  # refused once the body was read
        if held:
            pb << SetTimer(timer=("body", conn), at=pb.now + self.body_gap_s)
        pb << SetTimer(timer=("send", conn), at=pb.now + self.send_s)
        pb << (answer := Sends(conn, client, h1_response(429, end=True)))
        if held:
            pb << CancelTimer(timer=("body", conn))
        pb << CloseConnection(conn=conn)
        pb.done()
        head = answer.events[0]
        assert isinstance(head, h11.Response)
        return head, h1_body(answer.events)

    def stream(self, conn: int, client: H1ClientPeer, opens: Opens, body: bytes | None) -> Sends:
        """The backend ``opens`` went to gets the request (``body``: a POST of it) and answers
        with an SSE head that reaches the client; returns what the backend got."""
        pb = self.pb
        up = opens.conn
        check = h1_request(b"GET" if body is None else b"POST", CHAT.encode(), body)
        request = self.accept(up, conn, check)
        pb >> data(up, self.sse_head_bytes(up, opens.server))
        pb << CancelTimer(timer=("head", conn))
        pb << SetTimer(timer=("send", conn), at=pb.now + self.send_s)
        pb << Sends(conn, client, h1_response(200))
        pb << SetTimer(timer=("read", conn), at=pb.now + self.read_s)
        pb.done()
        self.streams[up] = (conn, client, body is not None)
        return request

    def posted(
        self, body: bytes, headers: list[tuple[str, str]] | None = None, *, to: str | None = None
    ) -> tuple[int, str]:
        """A JSON POST sent on at once and streamed: (backend connection, its server)."""
        conn, client, opens = self.post(body, headers, to=to)
        self.stream(conn, client, opens, body)
        return opens.conn, opens.server

    def event(self, up: int, payload: bytes) -> None:
        conn, client, _ = self.streams[up]
        self.pb >> data(up, self.chunk(up, payload))
        self.pb << Sends(conn, client, body_is(payload, end=False))
        self.pb.done()

    def finish(
        self,
        up: int,
        events: int = 0,
        usage: int | None = None,
        *,
        admits: int | Capture[int] | None = None,
        to: str | None = None,
    ) -> Opens | None:
        """The stream on ``up`` relays ``events`` (and a usage object), ``[DONE]`` and its end;
        the freed slot ``admits`` a waiting exchange (a ``Capture`` when the test does not
        fix which), whose attempt goes ``to``."""
        pb = self.pb
        for i in range(events):
            self.event(up, f'data: {{"choices":[{{"delta":{{"content":"t{i}"}}}}]}}\n\n'.encode())
        if usage is not None:
            tail = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": usage}}
            self.event(up, f"data: {json.dumps(tail)}\n\n".encode())
        self.event(up, b"data: [DONE]\n\n")
        conn, client, posted = self.streams.pop(up)
        pb >> data(up, self.end(up))
        pb << Sends(conn, client, stream_end)
        pb << CloseConnection(conn=up)
        pb << CancelTimer(timer=("read", conn))
        if posted:
            pb << CancelTimer(timer=("body", conn))
        opens = self.admitted(admits, to) if admits is not None else None
        pb << SetTimer(timer=("idle", conn), at=pb.now + self.idle_s)
        pb.done()
        return opens

    def admitted(self, admits: int | Capture[int], to: str | None) -> Opens:
        """A waiting exchange leaves the queue and opens a connection for its attempt."""
        if isinstance(admits, int):
            self.pb << CancelTimer(timer=("queue", admits))
            ex = admits
        else:
            self.pb << Where(
                CancelTimer, lambda c: c.timer[0] == "queue" and admits.offer(c.timer[1])
            )
            ex = admits.value
        return self.attempt(ex, to=to)

    def queue_len(self) -> int:
        return len(self.router.queue)


def limited(*servers: str, limit: int = 1, **group: Any) -> Any:
    return fleet(*(Server(address=s, max_streams=limit) for s in servers), **group)


# -- least load ----------------------------------------------------------------------------------


def test_least_load_sends_new_work_away_from_a_long_generation() -> None:
    rig = Llm(fleet(A, B, balance=Balance.LEAST_LOAD))
    _, long_server = rig.posted(chat(max_tokens=4000))
    other = B if long_server == A else A
    for _ in range(5):
        rig.posted(chat(max_tokens=10), to=other)


def test_relayed_events_shrink_a_streams_expected_work() -> None:
    rig = Llm(fleet(A, B, balance=Balance.LEAST_LOAD, default_max_tokens=50))
    up, address = rig.posted(chat(max_tokens=100))
    server = [s.address for s in rig.group.servers].index(address)
    assert rig.router.loads.own_work(server) == 100
    for i in range(30):
        rig.event(up, f"data: {i}\n\n".encode())
    assert rig.router.loads.own_work(server) == 100 - 30
    other = 1 - server
    rig.post(b"not json", to=rig.group.servers[other].address)  # no max_tokens: the default
    assert rig.router.loads.own_work(other) == 50
    rig.finish(up)
    assert rig.router.loads.own_work(server) == 0
    rig.pb.done()


# -- prefix affinity -----------------------------------------------------------------------------


def prefix_fleet(**group: Any) -> Any:
    return fleet(A, B, balance=Balance.LEAST_LOAD, affinity=AffinityMode.PREFIX, **group)


def test_a_conversations_turns_go_to_the_same_server() -> None:
    rig = Llm(prefix_fleet(prefix=PrefixAffinity(load_factor=4.0)))
    _, first = rig.posted(chat("question 1", system=SYSTEM))
    for n in range(2, 5):  # its later turns repeat the history: system, question 1, ...
        later = [text for k in range(2, n + 1) for text in (f"answer {k - 1}", f"question {k}")]
        rig.posted(chat_turns("question 1", *later, system=SYSTEM), to=first)


def test_single_questions_behind_one_long_system_prompt_spread_by_their_question() -> None:
    rig = Llm(prefix_fleet(prefix=PrefixAffinity(load_factor=4.0)))
    servers = {rig.posted(chat(f"question {n}", system=SYSTEM))[1] for n in range(12)}
    assert servers == {A, B}


def test_a_hot_prefix_spills_over_once_its_server_is_over_the_bound() -> None:
    rig = Llm(prefix_fleet())  # c = 1.25
    servers = [rig.posted(chat("the same question", system=SYSTEM))[1] for n in range(8)]
    counts = {s: servers.count(s) for s in (A, B)}
    assert counts[servers[0]] == 5 and counts[A] + counts[B] == 8  # ceil(1.25 * 8 / 2) = 5
    assert max(rig.router.active) <= 5


def test_a_session_key_wins_over_the_prefix() -> None:
    sticky = Sticky(sources=(SessionSource(kind="header", name="x-chat-id"),))
    rig = Llm(prefix_fleet(sticky=sticky, prefix=PrefixAffinity(load_factor=10.0)))
    prefix_server = rig.post(chat("q", system=SYSTEM))[2].server
    seen = set()
    for n in range(12):
        seen.add(rig.post(chat("q", system=SYSTEM), [("X-Chat-ID", f"chat-{n}")])[2].server)
    assert seen == {A, B}, prefix_server  # keys spread by their own hash, not the prefix's
    rig.pb.done()


# -- the admission queue -------------------------------------------------------------------------


def test_a_request_waits_while_every_server_is_full_and_goes_when_one_frees() -> None:
    rig = Llm(limited(A, B))
    ups = [rig.posted(chat())[0] for _ in range(2)]
    conn, client = rig.waits(chat())  # nothing is sent while it waits
    (waiting,) = [e for e in rig.pb.core.exchanges.values() if e.phase is Phase.QUEUED]
    assert rig.queue_len() == 1
    opens = rig.finish(ups[0], admits=conn)
    assert opens is not None
    assert rig.queue_len() == 0 and waiting.phase is Phase.CONNECTING
    rig.stream(conn, client, opens, chat())  # the client gets the 200 head
    (hist,) = [rig.pb.core.measurements.group("default").queue_wait]
    assert sum(hist.counts) == 1


def test_a_full_queue_answers_429_with_retry_after_in_the_openai_shape() -> None:
    config = limited(A, queue=AdmissionQueue(max=1, timeout=30, retry_after=3))
    route = Route(prefix="/", upstream="default", api=Api.OPENAI)
    rig = Llm(attrs.evolve(config, routes=(route,)))
    rig.posted(chat())
    rig.waits(chat())
    head, body = rig.refused(chat())
    headers = dict(head.headers)
    assert headers[b"retry-after"] == b"3" and headers[b"x-muxproxy-reason"] == b"queue_full"
    error = json.loads(body)["error"]
    assert error["code"] == "queue_full" and "queue is full" in error["message"]
    assert error["type"] == "requests"
    refused = rig.pb.core.measurements.refusals
    assert refused == {("default", "queue_full"): 1}
    group = rig.pb.core.status()["groups"]["default"]
    assert group["refused"] == {"queue_full": 1} and group["queue"] == {"waiting": 1, "max": 1}


def test_a_wait_past_the_queue_timeout_is_answered_429() -> None:
    rig = Llm(limited(A, queue=AdmissionQueue(max=10, timeout=5)))
    pb = rig.pb
    rig.posted(chat())
    conn, client = rig.waits(chat())  # its queue deadline: now + 5
    pb.now += 5
    pb >> wakeup("queue", conn)
    pb << SetTimer(timer=("send", conn), at=pb.now + rig.send_s)
    pb << Sends(conn, client, h1_response(429, end=True, headers={b"retry-after": b"1"}))
    pb << CancelTimer(timer=("body", conn))
    pb << CloseConnection(conn=conn)
    pb.done()
    assert rig.queue_len() == 0
    assert rig.pb.core.measurements.refusals == {("default", "queue_timeout"): 1}


def test_a_client_that_leaves_while_queued_leaves_the_queue_at_once() -> None:
    rig = Llm(limited(A))
    pb = rig.pb
    up, _ = rig.posted(chat())
    conn, _ = rig.waits(chat())
    assert rig.queue_len() == 1
    pb >> closed(conn)
    pb << CancelTimer(timer=("body", conn))
    pb << CancelTimer(timer=("queue", conn))
    pb.done()
    assert rig.queue_len() == 0
    rig.finish(up)  # nobody was admitted: nobody waited any more


def test_one_tenant_flooding_the_queue_does_not_delay_another_by_more_than_one_slot() -> None:
    tenant = SessionSource(kind="header", name="authorization")
    rig = Llm(limited(A, tenant=tenant, queue=AdmissionQueue(max=1000, timeout=60)))
    busy = [("Authorization", "Bearer busy")]
    up, _ = rig.posted(chat(), busy)
    clients = dict(rig.waits(chat(), busy) for _ in range(500))
    conn, client = rig.waits(chat("mine"), [("Authorization", "Bearer other")])
    clients[conn] = client
    assert rig.queue_len() == 501
    served: list[bytes] = []
    for _ in range(2):
        admitted = Capture[int]("admitted")
        opens = rig.finish(up, admits=admitted, to=A)
        assert opens is not None
        body = chat("mine") if admitted.value == conn else chat()
        request = rig.stream(admitted.value, clients[admitted.value], opens, body)
        served.append(dict(request.events[0].headers)[b"authorization"])
        up = opens.conn
    assert b"Bearer other" in served  # within the first two slots after the flood began


def test_priority_classes_are_strict() -> None:
    priority = SessionSource(kind="header", name="x-priority")
    rig = Llm(limited(A, priority=priority))
    up, _ = rig.posted(chat())
    waiting = {}
    for level in ("5", "9", "1", "bogus", "-3"):
        waiting[level.encode()] = rig.waits(chat(), [("X-Priority", level)])
    # bogus and negative values are class 0, served first, in arrival order.
    for level in (b"bogus", b"-3", b"1", b"5", b"9"):
        conn, client = waiting[level]
        opens = rig.finish(up, admits=conn, to=A)
        assert opens is not None
        request = rig.stream(conn, client, opens, chat())
        assert dict(request.events[0].headers)[b"x-priority"] == level
        up = opens.conn


def test_a_retry_never_goes_to_a_full_server() -> None:
    rig = Llm(limited(A, B))
    pb = rig.pb
    _, full = rig.posted(chat())  # one server full
    conn, client, second = rig.post(chat(), avoid={full})
    pb >> open_failed(second.conn)  # no other server to retry on: the full one is not one
    pb << CancelTimer(timer=("connect", conn))
    pb << SetTimer(timer=("send", conn), at=pb.now + rig.send_s)
    pb << Sends(conn, client, h1_response(502, end=True))
    pb << CancelTimer(timer=("body", conn))
    pb << CloseConnection(conn=conn)
    pb.done()
    skipped = rig.logs("retry_skipped")
    assert skipped and skipped[-1].fields["reason"] == "every other server is full"


# -- budgets -------------------------------------------------------------------------------------


def budget_fleet(**budget: int) -> Any:
    tenant = SessionSource(kind="header", name="authorization")
    return fleet(A, tenant=tenant, rate_limit=RateLimit(**budget))


def test_concurrent_requests_cannot_spend_more_than_the_token_budget() -> None:
    rig = Llm(budget_fleet(tokens_per_minute=1000))
    key = [("Authorization", "Bearer t1")]
    up, _ = rig.posted(chat(max_tokens=600), key)
    head, _ = rig.refused(chat(max_tokens=600), key)
    headers = dict(head.headers)
    assert headers[b"x-ratelimit-limit-tokens"] == b"1000"
    assert headers[b"x-ratelimit-remaining-tokens"] == b"400"
    assert int(headers[b"retry-after"]) >= 1
    # Another tenant has its own budget.
    rig.post(chat(max_tokens=600), [("Authorization", "Bearer t2")])
    assert headers[b"x-muxproxy-reason"] == b"budget"  # its tokens, not its request rate
    assert rig.pb.core.measurements.refusals == {("default", "budget"): 1}
    # The first stream used 100 of its 600: settled, 900 remain for t1.
    rig.finish(up, events=3, usage=100)
    rig.post(chat(max_tokens=800), key)
    stats = rig.pb.core.measurements.group("default")
    assert stats.tokens_used == 100 and stats.reservations == 2
    rig.pb.done()


def test_without_a_usage_object_the_events_relayed_are_charged() -> None:
    rig = Llm(budget_fleet(tokens_per_minute=1000))
    up, _ = rig.posted(chat(max_tokens=900), [("Authorization", "Bearer t1")])
    rig.finish(up, events=40)
    stats = rig.pb.core.measurements.group("default")
    assert stats.tokens_used == 41  # 40 tokens and [DONE]
    assert stats.reservations == 0


def test_a_request_larger_than_the_whole_budget_is_refused_without_retry_after() -> None:
    rig = Llm(budget_fleet(tokens_per_minute=100))
    head, _ = rig.refused(chat(max_tokens=500), [("Authorization", "k")])
    assert b"retry-after" not in dict(head.headers)


def test_requests_per_minute_alone() -> None:
    rig = Llm(budget_fleet(requests_per_minute=2))
    key = [("Authorization", "k")]
    for _ in range(2):
        rig.serve(*rig.ask(headers=key))
    head, _ = rig.refused(None, key)
    assert dict(head.headers)[b"x-ratelimit-remaining-requests"] == b"0"
    rig.pb.now += 30.0  # a minute's budget refills over the minute: one request back
    rig.ask(headers=key)
    rig.pb.done()


# -- load reports --------------------------------------------------------------------------------

VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}
"""


def reporting_fleet(*servers: Server | str, **group: Any) -> Any:
    return fleet(*servers, load_report=LoadReporting(interval=1.0), **group)


def polls_due(rig: Llm) -> None:
    """The config comes in: both servers' load polls are due at once."""
    rig.pb >> ConfigChanged(now=rig.pb.now, config=rig.config)
    rig.pb << SetTimer(timer=("probe", 1), at=rig.pb.now)
    rig.pb << SetTimer(timer=("probe", 2), at=rig.pb.now)
    rig.pb.done()


def poll(
    rig: Llm, ident: int, body: bytes, status: int = 200, *, admits: int | None = None
) -> list[Log]:
    """Load poll ``ident``: its GET arrives at its server on a fresh connection, which
    answers ``body`` and closes; the next poll is due an interval later (``admits``: the
    report frees a slot for this waiting exchange). Returns the load_report logs."""
    pb = rig.pb
    mark = len(pb.log)
    report = rig.group.load_report
    assert report is not None
    pb >> wakeup("probe", ident)
    pb << SetTimer(timer=("probe_timeout", ident), at=pb.now + 0.8 * report.interval)
    pb << (poller := Opens(to=rig.group.servers[ident - 1].address))
    backend = rig.backends[poller.conn] = H1BackendPeer()
    pb >> opened(poller.conn)
    pb << Sends(poller.conn, backend, h1_request(b"GET", b"/metrics"))
    head = h11.Response(
        status_code=status,
        headers=[("Content-Length", str(len(body))), ("Content-Type", "text/plain")],
    )
    wire = (backend.conn.send(head) or b"") + (backend.conn.send(h11.Data(data=body)) or b"")
    pb >> data(poller.conn, wire + (backend.conn.send(h11.EndOfMessage()) or b""))
    pb << CloseConnection(conn=poller.conn)
    pb << CancelTimer(timer=("probe_timeout", ident))
    pb << SetTimer(timer=("probe", ident), at=pb.now + report.interval)
    if admits is not None:
        rig.admitted(admits, to=rig.group.servers[ident - 1].address)
    pb.done()
    return [c for c in pb.log[mark:] if isinstance(c, Log) and c.event == "load_report"]


def page(running: int = 0, waiting: int = 0, kv: float = 0.1) -> bytes:
    return VLLM_PAGE.format(running=running, waiting=waiting, kv=kv).encode()


def test_a_reported_engine_queue_steers_least_load_away() -> None:
    rig = Llm(reporting_fleet(A, B, balance=Balance.LEAST_LOAD))
    polls_due(rig)
    poll(rig, 1, page(running=8, waiting=20))  # A's engine is busy with others' work
    poll(rig, 2, page())
    status = rig.router.status(rig.pb.now)
    assert status["servers"][0]["reported"]["waiting"] == 20
    for _ in range(4):
        rig.post(chat(max_tokens=10), to=B)
    # Three intervals later the report is stale: our own counts stand alone.
    rig.pb.now += 3.5
    rig.post(chat(max_tokens=10), to=A)
    rig.pb.done()


def test_a_server_over_the_kv_cache_limit_gets_no_new_sessions() -> None:
    rig = Llm(reporting_fleet(A, B))
    polls_due(rig)
    poll(rig, 1, page(kv=0.99))
    poll(rig, 2, page(kv=0.5))
    for _ in range(4):
        rig.ask(to=B)
    rig.pb.done()


def test_max_waiting_makes_a_server_full_while_its_engine_queues() -> None:
    servers = [Server(address=A, max_waiting=2), Server(address=B, max_waiting=2)]
    rig = Llm(reporting_fleet(*servers))
    polls_due(rig)
    poll(rig, 1, page(waiting=2))
    poll(rig, 2, page(waiting=5))
    conn, _ = rig.waits(chat())  # nothing opened
    assert rig.queue_len() == 1
    rig.pb.now = 1.0
    poll(rig, 1, page(waiting=0), admits=conn)  # the report that frees A admits it, to A
    assert rig.queue_len() == 0


def test_a_failing_load_report_is_logged_once_and_touches_nothing_else() -> None:
    rig = Llm(reporting_fleet(A, B))
    polls_due(rig)
    (first,) = poll(rig, 2, page())
    assert first.fields["ok"] is True and first.fields["server"] == B  # the first is logged
    (log,) = poll(rig, 1, b"<html>not metrics</html>")
    assert log.fields["ok"] is False and "unreadable report" in log.fields["detail"]
    rig.pb.now = 1.0
    assert poll(rig, 1, b"still not") == []  # the same failure: not logged again
    rig.pb.now = 2.0
    assert poll(rig, 1, b"", status=404) == []
    rig.pb.now = 3.0
    (back,) = poll(rig, 1, page())
    assert back.fields["ok"] is True
    assert rig.router.healthy(0, rig.pb.now)
    assert {rig.ask()[2].server for _ in range(2)} == {A, B}
    rig.pb.done()


# -- the queue keeps a prefix on its server ------------------------------------------------------


def owned(rig: Llm, address: str, user: str) -> bytes:
    """A chat request asking ``user`` behind a system prompt chosen so that its prefix key
    ranks ``address`` first."""
    return chat(user, system=system_owned_by(rig, address, user))


def system_owned_by(rig: Llm, address: str, user: str = "hi") -> str:
    """A system prompt whose prefix key, asking ``user``, ranks ``address`` first."""
    from muxproxy.routing.balancer import rendezvous_order
    from muxproxy.routing.llmrequest import parse_json_body, read_request

    index = [s.address for s in rig.group.servers].index(address)
    for n in range(100):
        system = f"prompt {n} " + SYSTEM
        key = read_request(parse_json_body(chat(user, system=system)), length=1024).prefix_key
        assert key is not None
        if rendezvous_order(key, rig.router.ids, rig.router.weights, range(2))[0] == index:
            return system
    raise AssertionError("no prompt found")


def test_a_freed_slot_goes_to_the_first_waiting_request_that_belongs_there() -> None:
    rig = Llm(
        limited(
            A,
            B,
            balance=Balance.LEAST_LOAD,
            affinity=AffinityMode.PREFIX,
            prefix=PrefixAffinity(load_factor=2.0),
        )
    )
    up_a, _ = rig.posted(owned(rig, A, "x"), to=A)
    up_b, _ = rig.posted(owned(rig, B, "y"), to=B)
    first, _ = rig.waits(owned(rig, A, "first in line"))  # waits for A
    second, _ = rig.waits(owned(rig, B, "second in line"))  # waits for B
    assert rig.queue_len() == 2
    # B frees first: the request that belongs on B goes, not the first.
    rig.finish(up_b, admits=second, to=B)
    (waiting,) = [e for e in rig.pb.core.exchanges.values() if e.phase is Phase.QUEUED]
    assert b"first in line" in waiting.upload.body.prefix()
    rig.finish(up_a, admits=first, to=A)
    assert rig.queue_len() == 0


def test_a_request_passed_over_for_affinity_wait_takes_the_next_slot_anywhere() -> None:
    rig = Llm(
        limited(
            A,
            B,
            affinity=AffinityMode.PREFIX,
            prefix=PrefixAffinity(load_factor=2.0),
            queue=AdmissionQueue(affinity_wait=0.5),
        )
    )
    rig.posted(owned(rig, A, "x"))
    up_b, _ = rig.posted(owned(rig, B, "y"))
    patient = rig.waits(owned(rig, A, "patient"))  # first in line, belongs on A
    local = rig.waits(owned(rig, B, "local 1"))
    rig.pb.now += 0.4
    # B frees: "local 1" belongs there and goes first.
    opens = rig.finish(up_b, admits=local[0], to=B)
    assert opens is not None
    rig.stream(*local, opens, owned(rig, B, "local 1"))
    up_b = opens.conn
    rig.waits(owned(rig, B, "local 2"))
    rig.pb.now += 0.2  # "patient" has waited 0.6 s: passed over long enough
    opens = rig.finish(up_b, admits=patient[0], to=B)
    assert opens is not None
    request = rig.accept(opens.conn, patient[0], h1_request(b"POST", CHAT.encode()))
    assert b"patient" in h1_body(request.events)
    (waiting,) = [e for e in rig.pb.core.exchanges.values() if e.phase is Phase.QUEUED]
    assert b"local 2" in waiting.upload.body.prefix()
    rig.pb.done()


def test_with_nobody_belonging_there_the_fairest_takes_a_freed_slot() -> None:
    rig = Llm(limited(A, B, affinity=AffinityMode.PREFIX, prefix=PrefixAffinity(load_factor=2.0)))
    rig.posted(owned(rig, A, "x"))
    up_b, _ = rig.posted(owned(rig, B, "y"))
    belongs_on_a, _ = rig.waits(owned(rig, A, "belongs on A"))
    rig.finish(up_b, admits=belongs_on_a, to=B)  # no slot is left idle: it goes to B
    assert rig.queue_len() == 0


LORA_INFO = (
    'vllm:lora_requests_info{{max_lora="{slots}",running_lora_adapters="{held}",'
    'waiting_lora_adapters=""}} 1.7e9\n'
)


def lora_page(held: str, slots: int) -> bytes:
    return page() + LORA_INFO.format(held=held, slots=slots).encode()


def naming(model: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_a_request_naming_a_lora_adapter_goes_where_it_is_held() -> None:
    """The body's ``model`` is read (a group with load reports holds the body first) and
    places the request: on the engine holding the adapter, a new one on a free slot; the
    base model (the gauges' ``model_name``) round-robin as before."""
    rig = Llm(reporting_fleet(A, B))
    assert rig.group.reads_body
    polls_due(rig)
    poll(rig, 1, lora_page("sql", 1))  # A holds "sql", no slot free
    poll(rig, 2, lora_page("chat", 2))  # B holds "chat", one slot free
    assert rig.router.status(rig.pb.now)["servers"][0]["reported"]["lora_adapters"] == ["sql"]
    for _ in range(2):
        rig.post(naming("sql"), to=A)  # the streams stay open
    rig.post(naming("sql"), to=B)  # A is over its bound: 2 + 1 > ceil(1.25 x 3 / 2)
    for _ in range(2):
        rig.post(naming("legal"), to=B)  # held nowhere: B's free slot
    base = {rig.post(naming("m"))[2].server for _ in range(2)}
    assert base == {A, B}  # round-robin, as without LoRA
    # Three intervals later the reports are stale: every name is placed as before.
    rig.pb.now += 3.5
    assert {rig.post(naming("sql"))[2].server for _ in range(2)} == {A, B}
    rig.pb.done()
