"""``core/exchange/fleetadmit.py``: an exchange waits in RESERVING for the fleet store's answer.

Real h11 peers on both sides (``playbook.py``); the store's answers are fed as the driver
would feed them (``BudgetAnswered``), and its commands (``BudgetReserve``, ``BudgetSettle``)
are read back as data.
"""

from __future__ import annotations

import json

import attrs
import h11
import pytest
from playbook import H1BackendPeer, H1ClientPeer, Playbook, default_config

from muxproxy.config import FleetSettings, RateLimit, SessionSource, StoreErrorPolicy
from muxproxy.core.commands import BudgetReserve, BudgetSettle, OpenConnection
from muxproxy.core.events import BudgetAnswered
from muxproxy.core.ports import Phase
from muxproxy.fleet.budgets import Short, Verdict
from muxproxy.routing.ratelimit import Budget

STORE = "redis://127.0.0.1:6379"
LIMIT = RateLimit(tokens_per_minute=1000, max_concurrent=2)
BUDGET = Budget(tokens_per_minute=1000, max_concurrent=2)
BODY = json.dumps({"model": "m", "max_tokens": 100, "messages": []}).encode()
RESERVED = Verdict(short=Short(0), wait=0, tokens=900, requests=0, held=1)


def playbook(policy: StoreErrorPolicy = StoreErrorPolicy.LOCAL) -> Playbook:
    config = default_config(fleet=FleetSettings(store=STORE, on_store_error=policy))
    (name, group), *_ = config.upstreams.items()
    tenant = SessionSource(kind="header", name="authorization")
    group = attrs.evolve(group, rate_limit=LIMIT, tenant=tenant)
    return Playbook(attrs.evolve(config, upstreams={name: group}))


def ask_one(pb: Playbook, client: H1ClientPeer) -> BudgetReserve:
    """A request from tenant ``k``; the reservation it asks the store for."""
    pb.accept(1)
    headers = [("Authorization", "Bearer k"), ("Content-Type", "application/json")]
    commands = pb.receive(1, client.request("POST", "/v1/chat/completions", headers, BODY))
    (reserve,) = [c for c in commands if isinstance(c, BudgetReserve)]
    assert not [c for c in commands if isinstance(c, OpenConnection)]  # nothing before it
    (exchange,) = pb.core.exchanges.values()
    assert exchange.phase is Phase.RESERVING
    return reserve


def answer(pb: Playbook, reserve: BudgetReserve, verdict: Verdict | None) -> list[object]:
    return list(
        pb.feed(
            BudgetAnswered(
                now=pb.now,
                store=reserve.store,
                ask=reserve.ask,
                verdict=verdict,
                error="no answer within 250 ms",
                replicas=2,
            )
        )
    )


def response_of(pb: Playbook, client: H1ClientPeer) -> h11.Response:
    (response, *_) = [e for e in client.events(pb.take(1)) if isinstance(e, h11.Response)]
    return response


def test_a_request_waits_for_the_stores_reservation_then_goes() -> None:
    pb, client = playbook(), H1ClientPeer()
    reserve = ask_one(pb, client)
    assert reserve.store == STORE
    assert reserve.ask.budget == BUDGET and reserve.ask.tokens == 100 and reserve.ask.leased
    commands = answer(pb, reserve, RESERVED)
    (opening,) = [c for c in commands if isinstance(c, OpenConnection)]
    # The answer's usage settles it at the end: 100 reserved, 7 used; the lease goes back.
    backend = H1BackendPeer()
    backend.events(pb.take(opening.conn, pb.opened(opening.conn)))
    usage = b'{"usage": {"completion_tokens": 7}, "x": 1}'
    done = pb.receive(opening.conn, backend.reply(usage))
    (settle,) = [c for c in done if isinstance(c, BudgetSettle)]
    assert settle == BudgetSettle(store=STORE, ask=reserve.ask, correction=93)
    assert response_of(pb, client).status_code == 200


def test_a_refusal_from_the_store_is_a_429_with_retry_after() -> None:
    pb, client = playbook(), H1ClientPeer()
    reserve = ask_one(pb, client)
    refused = Verdict(short=Short.CONCURRENCY, wait=1.0, tokens=900, requests=0, held=2)
    commands = answer(pb, reserve, refused)
    assert not [c for c in commands if isinstance(c, (OpenConnection, BudgetSettle))]
    response = response_of(pb, client)
    assert response.status_code == 429
    assert (b"retry-after", b"1") in response.headers
    assert (b"x-ratelimit-remaining-tokens", b"900") in response.headers
    assert pb.core.measurements.fleet_reservations == {("refused",): 1}


def test_a_failed_store_with_closed_answers_503_with_the_reason() -> None:
    pb, client = playbook(StoreErrorPolicy.CLOSED), H1ClientPeer()
    answer(pb, ask_one(pb, client), None)
    assert response_of(pb, client).status_code == 503
    assert b"no answer within 250 ms" in pb.take(1)
    assert pb.core.measurements.fleet_reservations == {("error",): 1}


def test_a_failed_store_with_open_admits_with_no_budget() -> None:
    pb, client = playbook(StoreErrorPolicy.OPEN), H1ClientPeer()
    commands = answer(pb, ask_one(pb, client), None)
    assert [c for c in commands if isinstance(c, OpenConnection)]
    (exchange,) = pb.core.exchanges.values()
    assert exchange.admission is not None and exchange.admission.reserved is None


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_a_failed_store_with_local_enforces_this_replicas_share(replicas: int) -> None:
    """max_concurrent 2 among ``replicas``: this one admits its share (rounded up) alone."""
    pb = playbook()
    share = -(-2 // replicas)
    admitted = 0
    for conn in range(1, 5):
        client = H1ClientPeer()
        pb.accept(conn)
        headers = [("Authorization", "Bearer k"), ("Content-Type", "application/json")]
        commands = pb.receive(conn, client.request("POST", "/v1/chat/completions", headers, BODY))
        (reserve,) = [c for c in commands if isinstance(c, BudgetReserve)]
        answered = pb.feed(
            BudgetAnswered(
                now=pb.now, store=STORE, ask=reserve.ask, verdict=None, replicas=replicas
            )
        )
        admitted += bool([c for c in answered if isinstance(c, OpenConnection)])
    assert admitted == share


def test_an_answer_for_an_exchange_that_ended_gives_back_what_the_store_took() -> None:
    pb, client = playbook(), H1ClientPeer()
    reserve = ask_one(pb, client)
    pb.closed(1)  # the client left while the store was asked
    assert not pb.core.exchanges
    commands = answer(pb, reserve, RESERVED)
    assert commands == [BudgetSettle(store=STORE, ask=reserve.ask, correction=100)]
    # A refusal took nothing: nothing to give back.
    pb2, client2 = playbook(), H1ClientPeer()
    reserve2 = ask_one(pb2, client2)
    pb2.closed(1)
    refused = attrs.evolve(RESERVED, short=Short.TOKENS)
    assert answer(pb2, reserve2, refused) == []


def test_a_group_without_a_budget_never_asks_the_store() -> None:
    config = default_config(fleet=FleetSettings(store=STORE))
    pb, client = Playbook(config), H1ClientPeer()
    pb.accept(1)
    commands = pb.receive(1, client.request("POST", "/v1/chat/completions", [], BODY))
    assert not [c for c in commands if isinstance(c, BudgetReserve)]
    assert [c for c in commands if isinstance(c, OpenConnection)]
