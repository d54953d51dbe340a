"""``core/exchange/fleetadmit.py``: an exchange waits in RESERVING for the fleet store's answer.

Conversations with real h11 peers on both sides (``playbook.py``); the store's answers are fed
as the driver would feed them (``BudgetAnswered``), and its commands (``BudgetReserve``,
``BudgetSettle``) are asserted in place with every other command, timers included.
"""

from __future__ import annotations

import json

import attrs
import pytest
from checks import h1_body, h1_request, h1_response
from playbook import (
    ANY,
    CHAT,
    Capture,
    H1BackendPeer,
    H1ClientPeer,
    Playbook,
    Sends,
    closed,
    data,
    default_config,
    opened,
)

from muxproxy.config import FleetSettings, RateLimit, SessionSource, StoreErrorPolicy
from muxproxy.core.commands import (
    BudgetReserve,
    BudgetSettle,
    CancelTimer,
    CloseConnection,
    OpenConnection,
    SetTimer,
)
from muxproxy.core.events import BudgetAnswered
from muxproxy.core.ports import Phase
from muxproxy.fleet.budgets import Ask, Short, Verdict
from muxproxy.routing.ratelimit import Budget

STORE = "redis://127.0.0.1:6379"
LIMIT = RateLimit(tokens_per_minute=1000, max_concurrent=2)
BUDGET = Budget(tokens_per_minute=1000, max_concurrent=2)
BODY = json.dumps({"model": "m", "max_tokens": 100, "messages": []}).encode()
RESERVED = Verdict(short=Short(0), wait=0, tokens=900, requests=0, held=1)
HEADERS = [("Authorization", "Bearer k"), ("Content-Type", "application/json")]


def playbook(policy: StoreErrorPolicy = StoreErrorPolicy.LOCAL) -> Playbook:
    config = default_config(fleet=FleetSettings(store=STORE, on_store_error=policy))
    (name, group), *_ = config.upstreams.items()
    tenant = SessionSource(kind="header", name="authorization")
    group = attrs.evolve(group, rate_limit=LIMIT, tenant=tenant)
    return Playbook(attrs.evolve(config, upstreams={name: group}))


def ask_one(pb: Playbook, conn: int = 1) -> tuple[H1ClientPeer, Ask]:
    """A request from tenant ``k`` on ``conn``: the body is read, then the store is asked
    for a reservation, and nothing else happens before it answers."""
    client = H1ClientPeer()
    pb.accept(conn)
    pb >> data(conn, client.request("POST", CHAT.decode(), HEADERS, BODY))
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("body", conn), at=pb.now + 30.0)
    ask = Capture[Ask]("ask")
    pb << BudgetReserve(store=STORE, ask=ask.slot)
    pb.done()  # no OpenConnection before the answer
    exchange = pb.core.exchanges[conn]
    assert exchange.phase is Phase.RESERVING
    return client, ask.value


def answer(pb: Playbook, ask: Ask, verdict: Verdict | None, replicas: int = 2) -> None:
    pb >> BudgetAnswered(
        now=pb.now,
        store=STORE,
        ask=ask,
        verdict=verdict,
        error="no answer within 250 ms",
        replicas=replicas,
    )


def admitted(pb: Playbook, conn: int) -> int:
    """The exchange on ``conn`` goes on: it opens a backend connection; returns it."""
    up = Capture[int]("up")
    pb << SetTimer(timer=("connect", conn), at=pb.now + 5.0)
    pb << OpenConnection(conn=up.slot, origin=ANY)
    pb.done()
    return up.value


def refused(
    pb: Playbook,
    conn: int,
    client: H1ClientPeer,
    status: int,
    headers: dict[bytes, bytes] | None = None,
) -> Sends:
    """The client gets ``status`` and the connection closes; nothing opened, nothing settled."""
    pb << SetTimer(timer=("send", conn), at=pb.now + 60.0)
    pb << (reply := Sends(conn, client, h1_response(status, end=True, headers=headers)))
    pb << CancelTimer(timer=("body", conn))
    pb << CloseConnection(conn=conn)
    pb.done()
    return reply


def test_a_request_waits_for_the_stores_reservation_then_goes() -> None:
    pb = playbook()
    client, ask = ask_one(pb)
    assert ask.budget == BUDGET and ask.tokens == 100 and ask.leased
    answer(pb, ask, RESERVED)
    up = admitted(pb, 1)
    # The answer's usage settles it at the end: 100 reserved, 7 used; the lease goes back.
    backend = H1BackendPeer()
    pb >> opened(up)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(up, backend, h1_request(b"POST", CHAT, BODY))
    pb << SetTimer(timer=("head", 1), at=60.0)
    usage = b'{"usage": {"completion_tokens": 7}, "x": 1}'
    pb >> data(up, backend.reply(usage))
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(200))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, lambda events: h1_body(events) == usage)
    pb << SetTimer(timer=("pool", up), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << BudgetSettle(store=STORE, ask=ask, correction=93)
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


def test_a_refusal_from_the_store_is_a_429_with_retry_after() -> None:
    pb = playbook()
    client, ask = ask_one(pb)
    answer(pb, ask, Verdict(short=Short.CONCURRENCY, wait=1.0, tokens=900, requests=0, held=2))
    headers = {b"retry-after": b"1", b"x-ratelimit-remaining-tokens": b"900"}
    refused(pb, 1, client, 429, headers)
    assert pb.core.measurements.fleet_reservations == {("refused",): 1}


def test_a_failed_store_with_closed_answers_503_with_the_reason() -> None:
    pb = playbook(StoreErrorPolicy.CLOSED)
    client, ask = ask_one(pb)
    answer(pb, ask, None)
    reply = refused(pb, 1, client, 503)
    assert b"no answer within 250 ms" in reply.data
    assert pb.core.measurements.fleet_reservations == {("error",): 1}


def test_a_failed_store_with_open_admits_with_no_budget() -> None:
    pb = playbook(StoreErrorPolicy.OPEN)
    _, ask = ask_one(pb)
    answer(pb, ask, None)
    admitted(pb, 1)
    (exchange,) = pb.core.exchanges.values()
    assert exchange.admission is not None and exchange.admission.reserved is None


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_a_failed_store_with_local_enforces_this_replicas_share(replicas: int) -> None:
    """max_concurrent 2 among ``replicas``: this one admits its share (rounded up) alone."""
    pb = playbook()
    share = -(-2 // replicas)
    for conn in range(1, 5):
        client, ask = ask_one(pb, conn)
        answer(pb, ask, None, replicas=replicas)
        if conn <= share:
            admitted(pb, conn)
        else:
            refused(pb, conn, client, 429)


def test_an_answer_for_an_exchange_that_ended_gives_back_what_the_store_took() -> None:
    pb = playbook()
    _, ask = ask_one(pb)
    pb >> closed(1)  # the client left while the store was asked
    pb << CancelTimer(timer=("body", 1))
    assert not pb.core.exchanges
    answer(pb, ask, RESERVED)
    pb << BudgetSettle(store=STORE, ask=ask, correction=100)
    pb.done()
    # A refusal took nothing: nothing to give back.
    pb2 = playbook()
    _, ask2 = ask_one(pb2)
    pb2 >> closed(1)
    pb2 << CancelTimer(timer=("body", 1))
    answer(pb2, ask2, attrs.evolve(RESERVED, short=Short.TOKENS))
    pb2.done()


def test_a_group_without_a_budget_never_asks_the_store() -> None:
    pb, client = Playbook(default_config(fleet=FleetSettings(store=STORE))), H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request("POST", CHAT.decode(), [], BODY))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=ANY, origin=ANY)  # no BudgetReserve
    pb << SetTimer(timer=("body", 1), at=30.0)
    pb.done()
