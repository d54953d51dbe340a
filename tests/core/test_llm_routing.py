"""LLM-aware balancing and admission inside the core, driven with bytes only: least load,
prefix affinity, the admission queue (fairness, priority, timeout, a client that leaves),
token budgets, and the engines' load reports.

Clients are real h11 peers, backends real h11 server peers (``test_routing_exchange.Rig``);
time moves only through ``pb.now``.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
from test_routing_exchange import A, B, Rig, fleet, origin, request_body

from muxproxy.config import (
    AdmissionQueue,
    AffinityMode,
    Api,
    Balance,
    LoadReporting,
    PrefixAffinity,
    RateLimit,
    Route,
    Server,
    SessionSource,
    Sticky,
)
from muxproxy.core.commands import Log, OpenConnection, SetTimer
from muxproxy.core.events import ConfigChanged
from muxproxy.core.ports import Phase

SYSTEM = "You are the support agent of a large company. " * 40


def chat(user: str = "hi", *, system: str | None = None, max_tokens: int | None = None) -> bytes:
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": user})
    body: dict[str, Any] = {"model": "m", "messages": messages, "stream": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return json.dumps(body).encode()


def post(rig: Rig, body: bytes, headers: list[tuple[str, str]] | None = None) -> tuple[int, Any]:
    hdrs = [("Content-Type", "application/json"), *(headers or [])]
    return rig.request(body=body, headers=hdrs)


def start_stream(rig: Rig) -> int:
    """Accept the last opened backend connection and answer with an SSE head."""
    cmd = rig.last_open()
    rig.sse_start(cmd.conn, origin(cmd))
    return cmd.conn


def finish(rig: Rig, up: int, events: int = 0, usage: int | None = None) -> None:
    for i in range(events):
        rig.chunk(up, f'data: {{"choices":[{{"delta":{{"content":"t{i}"}}}}]}}\n\n'.encode())
    if usage is not None:
        tail = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": usage}}
        rig.chunk(up, f"data: {json.dumps(tail)}\n\n".encode())
    rig.chunk(up, b"data: [DONE]\n\n")
    rig.end(up)


def status_of(rig: Rig, conn: int, client: Any) -> tuple[int, dict[bytes, bytes], bytes]:
    head, body, _ = rig.response(conn, client)
    return head.status_code, dict(head.headers), body


def queue_len(rig: Rig) -> int:
    return len(rig.router.queue)


def limited(*servers: str, limit: int = 1, **group: Any) -> Any:
    return fleet(*(Server(address=s, max_streams=limit) for s in servers), **group)


# -- least load ----------------------------------------------------------------------------------


def test_least_load_sends_new_work_away_from_a_long_generation() -> None:
    rig = Rig(fleet(A, B, balance=Balance.LEAST_LOAD))
    post(rig, chat(max_tokens=4000))
    long_server = origin(rig.last_open())
    start_stream(rig)
    other = B if long_server == A else A
    for _ in range(5):
        post(rig, chat(max_tokens=10))
        assert origin(rig.last_open()) == other
        start_stream(rig)


def test_relayed_events_shrink_a_streams_expected_work() -> None:
    rig = Rig(fleet(A, B, balance=Balance.LEAST_LOAD, default_max_tokens=50))
    post(rig, chat(max_tokens=100))
    server = rig.group.servers.index(
        next(s for s in rig.group.servers if s.address == origin(rig.last_open()))
    )
    up = start_stream(rig)
    assert rig.router.loads.own_work(server) == 100
    for i in range(30):
        rig.chunk(up, f"data: {i}\n\n".encode())
    assert rig.router.loads.own_work(server) == 100 - 30
    post(rig, b"not json")  # no max_tokens: the default counts
    other = 1 - server
    assert rig.router.loads.own_work(other) == 50
    finish(rig, up)
    assert rig.router.loads.own_work(server) == 0


# -- prefix affinity -----------------------------------------------------------------------------


def prefix_fleet(**group: Any) -> Any:
    return fleet(A, B, balance=Balance.LEAST_LOAD, affinity=AffinityMode.PREFIX, **group)


def test_users_of_one_system_prompt_go_to_the_same_server() -> None:
    rig = Rig(prefix_fleet(prefix=PrefixAffinity(load_factor=4.0)))
    post(rig, chat("question 1", system=SYSTEM))
    first = origin(rig.last_open())
    start_stream(rig)
    for n in range(2, 5):
        post(rig, chat(f"question {n}", system=SYSTEM))
        assert origin(rig.last_open()) == first
        start_stream(rig)


def test_a_hot_prefix_spills_over_once_its_server_is_over_the_bound() -> None:
    rig = Rig(prefix_fleet())  # c = 1.25
    servers = []
    for n in range(8):
        post(rig, chat(f"q{n}", system=SYSTEM))
        servers.append(origin(rig.last_open()))
        start_stream(rig)
    counts = {s: servers.count(s) for s in (A, B)}
    assert counts[servers[0]] == 5 and counts[A] + counts[B] == 8  # ceil(1.25 * 8 / 2) = 5
    assert max(rig.router.active) <= 5


def test_a_session_key_wins_over_the_prefix() -> None:
    sticky = Sticky(sources=(SessionSource(kind="header", name="x-chat-id"),))
    rig = Rig(prefix_fleet(sticky=sticky, prefix=PrefixAffinity(load_factor=10.0)))
    post(rig, chat("q", system=SYSTEM))
    prefix_server = origin(rig.last_open())
    seen = set()
    for n in range(12):
        post(rig, chat("q", system=SYSTEM), headers=[("X-Chat-ID", f"chat-{n}")])
        seen.add(origin(rig.last_open()))
    assert seen == {A, B}, prefix_server  # keys spread by their own hash, not the prefix's


# -- the admission queue -------------------------------------------------------------------------


def test_a_request_waits_while_every_server_is_full_and_goes_when_one_frees() -> None:
    rig = Rig(limited(A, B))
    ups = []
    for _ in range(2):
        post(rig, chat())
        ups.append(start_stream(rig))
    opened = len(rig.opens())
    conn, client = post(rig, chat())
    (waiting,) = [e for e in rig.pb.core.exchanges.values() if e.phase is Phase.QUEUED]
    assert len(rig.opens()) == opened and queue_len(rig) == 1
    assert rig.take(conn) == b""  # nothing is sent while it waits: a retry stays possible
    finish(rig, ups[0])
    assert queue_len(rig) == 0 and waiting.phase is Phase.CONNECTING
    assert len(rig.opens()) == opened + 1
    start_stream(rig)
    head, _, _ = rig.response(conn, client)
    assert head.status_code == 200
    (hist,) = [rig.pb.core.measurements.group("default").queue_wait]
    assert sum(hist.counts) == 1


def test_a_full_queue_answers_429_with_retry_after_in_the_openai_shape() -> None:
    config = limited(A, queue=AdmissionQueue(max=1, timeout=30, retry_after=3))
    route = Route(prefix="/", upstream="default", api=Api.OPENAI)
    rig = Rig(attrs.evolve(config, routes=(route,)))
    post(rig, chat())
    start_stream(rig)
    post(rig, chat())  # waits
    conn, client = post(rig, chat())
    status, headers, body = status_of(rig, conn, client)
    assert status == 429 and headers[b"retry-after"] == b"3"
    error = json.loads(body)["error"]
    assert error["code"] == "rate_limit_exceeded" and "queue is full" in error["message"]
    refused = rig.pb.core.measurements.refusals
    assert refused == {("default", "queue_full"): 1}
    group = rig.pb.core.status()["groups"]["default"]
    assert group["refused"] == {"queue_full": 1} and group["queue"] == {"waiting": 1, "max": 1}


def test_a_wait_past_the_queue_timeout_is_answered_429() -> None:
    rig = Rig(limited(A, queue=AdmissionQueue(max=10, timeout=5)))
    post(rig, chat())
    start_stream(rig)
    conn, client = post(rig, chat())
    armed = rig.timer("queue")
    assert armed.at == rig.pb.now + 5
    rig.fire("queue")
    status, headers, _ = status_of(rig, conn, client)
    assert status == 429 and headers[b"retry-after"] == b"1"
    assert queue_len(rig) == 0
    assert rig.pb.core.measurements.refusals == {("default", "queue_timeout"): 1}


def test_a_client_that_leaves_while_queued_leaves_the_queue_at_once() -> None:
    rig = Rig(limited(A))
    post(rig, chat())
    up = start_stream(rig)
    conn, _ = post(rig, chat())
    assert queue_len(rig) == 1
    commands = rig.pb.closed(conn)
    assert queue_len(rig) == 0
    assert any(getattr(c, "timer", None) == ("queue", 2) for c in commands)  # cancelled
    opened = len(rig.opens())
    finish(rig, up)
    assert len(rig.opens()) == opened  # nobody was admitted: nobody waited any more


def test_one_tenant_flooding_the_queue_does_not_delay_another_by_more_than_one_slot() -> None:
    tenant = SessionSource(kind="header", name="authorization")
    rig = Rig(limited(A, tenant=tenant, queue=AdmissionQueue(max=1000, timeout=60)))
    post(rig, chat(), headers=[("Authorization", "Bearer busy")])
    up = start_stream(rig)
    for _ in range(500):
        post(rig, chat(), headers=[("Authorization", "Bearer busy")])
    post(rig, chat("mine"), headers=[("Authorization", "Bearer other")])
    assert queue_len(rig) == 501
    served: list[bytes] = []
    for _ in range(2):
        finish(rig, up)
        cmd = rig.last_open()
        rig.open(cmd.conn)
        request = rig.received(cmd.conn)[0]
        served.append(dict(request.headers)[b"authorization"])
        rig.sse_head(cmd.conn, "a")
        up = cmd.conn
    assert b"Bearer other" in served  # within the first two slots after the flood began


def test_priority_classes_are_strict() -> None:
    priority = SessionSource(kind="header", name="x-priority")
    rig = Rig(limited(A, priority=priority))
    post(rig, chat())
    up = start_stream(rig)
    for level in ("5", "9", "1", "bogus", "-3"):
        post(rig, chat(), headers=[("X-Priority", level)])
    order = []
    for _ in range(5):
        finish(rig, up)
        cmd = rig.last_open()
        rig.open(cmd.conn)
        order.append(dict(rig.received(cmd.conn)[0].headers)[b"x-priority"])
        rig.sse_head(cmd.conn, "a")
        up = cmd.conn
    # bogus and negative values are class 0, served first, in arrival order.
    assert order == [b"bogus", b"-3", b"1", b"5", b"9"]


def test_a_retry_never_goes_to_a_full_server() -> None:
    rig = Rig(limited(A, B))
    post(rig, chat())
    start_stream(rig)  # one server full
    post(rig, chat())
    second = rig.last_open()
    mark = len(rig.pb.log)
    rig.refuse(second.conn)
    assert rig.opens()[-1] is second or not rig.opens(mark)
    skipped = [log for log in rig.logs("retry_skipped")]
    assert skipped and skipped[-1].fields["reason"] == "every other server is full"


# -- budgets -------------------------------------------------------------------------------------


def budget_fleet(**budget: int) -> Any:
    tenant = SessionSource(kind="header", name="authorization")
    return fleet(A, tenant=tenant, rate_limit=RateLimit(**budget))


def test_concurrent_requests_cannot_spend_more_than_the_token_budget() -> None:
    rig = Rig(budget_fleet(tokens_per_minute=1000))
    key = [("Authorization", "Bearer t1")]
    post(rig, chat(max_tokens=600), headers=key)
    up = start_stream(rig)
    conn, client = post(rig, chat(max_tokens=600), headers=key)
    status, headers, _ = status_of(rig, conn, client)
    assert status == 429
    assert headers[b"x-ratelimit-limit-tokens"] == b"1000"
    assert headers[b"x-ratelimit-remaining-tokens"] == b"400"
    assert int(headers[b"retry-after"]) >= 1
    # Another tenant has its own budget.
    post(rig, chat(max_tokens=600), headers=[("Authorization", "Bearer t2")])
    assert rig.pb.core.measurements.refusals == {("default", "rate_limited"): 1}
    # The first stream used 100 of its 600: settled, 900 remain for t1.
    finish(rig, up, events=3, usage=100)
    opened = len(rig.opens())
    post(rig, chat(max_tokens=800), headers=key)
    assert len(rig.opens()) == opened + 1
    stats = rig.pb.core.measurements.group("default")
    assert stats.tokens_used == 100 and stats.reservations == 2


def test_without_a_usage_object_the_events_relayed_are_charged() -> None:
    rig = Rig(budget_fleet(tokens_per_minute=1000))
    key = [("Authorization", "Bearer t1")]
    post(rig, chat(max_tokens=900), headers=key)
    up = start_stream(rig)
    finish(rig, up, events=40)
    stats = rig.pb.core.measurements.group("default")
    assert stats.tokens_used == 41  # 40 tokens and [DONE]
    assert stats.reservations == 0


def test_a_request_larger_than_the_whole_budget_is_refused_without_retry_after() -> None:
    rig = Rig(budget_fleet(tokens_per_minute=100))
    conn, client = post(rig, chat(max_tokens=500), headers=[("Authorization", "k")])
    status, headers, _ = status_of(rig, conn, client)
    assert status == 429 and b"retry-after" not in headers


def test_requests_per_minute_alone() -> None:
    rig = Rig(budget_fleet(requests_per_minute=2))
    key = [("Authorization", "k")]
    for _ in range(2):
        rig.request(headers=key)
        rig.serve()
    conn, client = rig.request(headers=key)
    status, headers, _ = status_of(rig, conn, client)
    assert status == 429 and headers[b"x-ratelimit-remaining-requests"] == b"0"
    rig.pb.now += 30.0  # a minute's budget refills over the minute: one request back
    opened = len(rig.opens())
    rig.request(headers=key)
    assert len(rig.opens()) == opened + 1


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


def poll(rig: Rig, ident: int, body: bytes, status: int = 200) -> list[Log]:
    """Run load poll ``ident``: its GET arrives at its server, which answers ``body``."""
    mark = len(rig.pb.log)
    commands = rig.pb.wakeup("probe", ident)
    opens = [c for c in commands if isinstance(c, OpenConnection)]
    if opens:
        rig.open(opens[0].conn)
        up = opens[0].conn
    else:
        up = next(
            c.conn
            for c in reversed(rig.pb.log)
            if isinstance(c, OpenConnection) and c.conn in rig.backends
        )
    request, _end = rig.received(up)
    assert request.target == b"/metrics"
    rig.answer(up, status, body, headers=[("Content-Type", "text/plain")])
    assert SetTimer(timer=("probe", ident), at=rig.pb.now + 1.0) in rig.pb.log[mark:]
    return [c for c in rig.pb.log[mark:] if isinstance(c, Log) and c.event == "load_report"]


def page(running: int = 0, waiting: int = 0, kv: float = 0.1) -> bytes:
    return VLLM_PAGE.format(running=running, waiting=waiting, kv=kv).encode()


def test_a_reported_engine_queue_steers_least_load_away() -> None:
    rig = Rig(reporting_fleet(A, B, balance=Balance.LEAST_LOAD))
    rig.pb.feed(ConfigChanged(now=0.0, config=rig.config))
    poll(rig, 1, page(running=8, waiting=20))  # A's engine is busy with others' work
    poll(rig, 2, page())
    status = rig.router.status(rig.pb.now)
    assert status["servers"][0]["reported"]["waiting"] == 20
    mark = len(rig.pb.log)
    for _ in range(4):
        post(rig, chat(max_tokens=10))
    assert {origin(o) for o in rig.opens(mark)} == {B}
    # Three intervals later the report is stale: our own counts stand alone.
    rig.pb.now += 3.5
    mark = len(rig.pb.log)
    post(rig, chat(max_tokens=10))
    assert {origin(o) for o in rig.opens(mark)} == {A}


def test_a_server_over_the_kv_cache_limit_gets_no_new_sessions() -> None:
    rig = Rig(reporting_fleet(A, B))
    rig.pb.feed(ConfigChanged(now=0.0, config=rig.config))
    poll(rig, 1, page(kv=0.99))
    poll(rig, 2, page(kv=0.5))
    mark = len(rig.pb.log)
    for _ in range(4):
        rig.request()
    assert {origin(o) for o in rig.opens(mark)} == {B}


def test_max_waiting_makes_a_server_full_while_its_engine_queues() -> None:
    servers = [Server(address=A, max_waiting=2), Server(address=B, max_waiting=2)]
    rig = Rig(reporting_fleet(*servers))
    rig.pb.feed(ConfigChanged(now=0.0, config=rig.config))
    poll(rig, 1, page(waiting=2))
    poll(rig, 2, page(waiting=5))
    opened = len(rig.opens())
    post(rig, chat())
    assert len(rig.opens()) == opened and queue_len(rig) == 1
    rig.pb.now = 1.0
    poll(rig, 1, page(waiting=0))  # the report that frees A admits the waiting request
    assert queue_len(rig) == 0
    assert origin(rig.opens()[-1]) == A


def test_a_failing_load_report_is_logged_once_and_touches_nothing_else() -> None:
    rig = Rig(reporting_fleet(A, B))
    rig.pb.feed(ConfigChanged(now=0.0, config=rig.config))
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
    mark = len(rig.pb.log)
    rig.request()
    rig.request()
    assert {origin(o) for o in rig.opens(mark)} == {A, B}


# -- the queue keeps a prefix on its server ------------------------------------------------------


def system_owned_by(rig: Rig, address: str) -> str:
    """A system prompt whose prefix key ranks ``address`` first."""
    from muxproxy.routing.balancer import rendezvous_order
    from muxproxy.routing.llmrequest import parse_json_body, read_request

    index = [s.address for s in rig.group.servers].index(address)
    for n in range(100):
        system = f"prompt {n} " + SYSTEM
        key = read_request(parse_json_body(chat(system=system)), length=1024).prefix_key
        assert key is not None
        if rendezvous_order(key, rig.router.ids, rig.router.weights, range(2))[0] == index:
            return system
    raise AssertionError("no prompt found")


def test_a_freed_slot_goes_to_the_first_waiting_request_that_belongs_there() -> None:
    rig = Rig(
        limited(
            A,
            B,
            balance=Balance.LEAST_LOAD,
            affinity=AffinityMode.PREFIX,
            prefix=PrefixAffinity(load_factor=2.0),
        )
    )
    to_a, to_b = system_owned_by(rig, A), system_owned_by(rig, B)
    post(rig, chat("x", system=to_a))
    up_a = start_stream(rig)
    post(rig, chat("y", system=to_b))
    up_b = start_stream(rig)
    post(rig, chat("first in line", system=to_a))  # waits for A
    post(rig, chat("second in line", system=to_b))  # waits for B
    assert queue_len(rig) == 2
    finish(rig, up_b)  # B frees first: the request that belongs on B goes, not the first
    assert origin(rig.last_open()) == B
    (waiting,) = [e for e in rig.pb.core.exchanges.values() if e.phase is Phase.QUEUED]
    assert b"first in line" in waiting.upload.body.prefix()
    finish(rig, up_a)
    assert origin(rig.last_open()) == A and queue_len(rig) == 0


def test_a_request_passed_over_for_affinity_wait_takes_the_next_slot_anywhere() -> None:
    rig = Rig(
        limited(
            A,
            B,
            affinity=AffinityMode.PREFIX,
            prefix=PrefixAffinity(load_factor=2.0),
            queue=AdmissionQueue(affinity_wait=0.5),
        )
    )
    to_a, to_b = system_owned_by(rig, A), system_owned_by(rig, B)
    post(rig, chat("x", system=to_a))
    start_stream(rig)
    post(rig, chat("y", system=to_b))
    up_b = start_stream(rig)
    post(rig, chat("patient", system=to_a))  # first in line, belongs on A
    post(rig, chat("local 1", system=to_b))
    rig.pb.now += 0.4
    finish(rig, up_b)  # B frees: "local 1" belongs there and goes first
    up_b = start_stream(rig)
    post(rig, chat("local 2", system=to_b))
    rig.pb.now += 0.2  # "patient" has waited 0.6 s: passed over long enough
    finish(rig, up_b)
    cmd = rig.last_open()
    assert origin(cmd) == B
    rig.open(cmd.conn)
    assert b"patient" in request_body(rig.received(cmd.conn))
    (waiting,) = [e for e in rig.pb.core.exchanges.values() if e.phase is Phase.QUEUED]
    assert b"local 2" in waiting.upload.body.prefix()


def test_with_nobody_belonging_there_the_fairest_takes_a_freed_slot() -> None:
    rig = Rig(limited(A, B, affinity=AffinityMode.PREFIX, prefix=PrefixAffinity(load_factor=2.0)))
    to_a, to_b = system_owned_by(rig, A), system_owned_by(rig, B)
    post(rig, chat("x", system=to_a))
    start_stream(rig)
    post(rig, chat("y", system=to_b))
    up_b = start_stream(rig)
    post(rig, chat("belongs on A", system=to_a))
    finish(rig, up_b)  # no slot is left idle: it goes to B
    assert origin(rig.last_open()) == B and queue_len(rig) == 0
