"""``muxproxy.testing.simdriver``: the simulated driver plays whole conversations correctly."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import h11
import pytest

from muxproxy.config import FleetSettings, RateLimit, quick_config
from muxproxy.core.commands import BudgetReserve
from muxproxy.core.events import BudgetAnswered, ConnectionClosed
from muxproxy.core.proxy import ProxyCore
from muxproxy.fleet.budgets import Short, Verdict
from muxproxy.testing.simdriver import SimDriver

BudgetStore = Callable[[BudgetReserve, float], BudgetAnswered | None]

REQUEST = b"GET /v1/models HTTP/1.1\r\nhost: proxy.example\r\n\r\n"


def sim() -> SimDriver:
    core = ProxyCore(quick_config("127.0.0.1:8080", ["127.0.0.1:9001"]), raise_errors=True)
    return SimDriver(core, answer_backends=True)


def test_a_request_is_answered_by_the_simulated_backend() -> None:
    driver = sim()
    driver.accept(1)
    driver.deliver(1, REQUEST, [5, 17])
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/v1/models", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(bytes(driver.sent[1]))
    response = client.next_event()
    assert isinstance(response, h11.Response) and response.status_code == 200
    data = client.next_event()
    assert isinstance(data, h11.Data) and data.data == b"ok"
    assert len(driver.backends) == 1
    assert [log.event for log in driver.logs].count("access") == 1


def test_every_connection_is_reported_closed_exactly_once() -> None:
    driver = sim()
    closes: list[int] = []
    feed = driver.feed

    def recording(event):  # type: ignore[no-untyped-def]
        if isinstance(event, ConnectionClosed):
            closes.append(event.conn)
        feed(event)

    driver.feed = recording  # type: ignore[method-assign]  # every event reaches the core here
    driver.accept(1)
    driver.deliver(1, REQUEST)
    driver.close_everything()
    assert sorted(closes) == sorted({1, *driver.backends})
    assert driver.core.statistics().client_connections == 0


def test_a_conversation_that_never_settles_is_an_error() -> None:
    driver = sim()
    driver.max_events = 3
    driver.accept(1)
    with pytest.raises(AssertionError, match="does not settle"):
        driver.deliver(1, REQUEST)


def fleet_sim(budget_store: BudgetStore | None) -> SimDriver:
    config = quick_config("127.0.0.1:8080", ["127.0.0.1:9001"])
    group = attrs.evolve(
        config.upstreams["default"], rate_limit=RateLimit(requests_per_minute=10, max_concurrent=1)
    )
    config = attrs.evolve(
        config, upstreams={"default": group}, fleet=FleetSettings(store="redis://store:6379")
    )
    return SimDriver(
        ProxyCore(config, raise_errors=True), answer_backends=True, budget_store=budget_store
    )


def test_a_reservation_is_answered_by_the_simulated_store_then_settled() -> None:
    def grant(command: BudgetReserve, now: float) -> BudgetAnswered:
        verdict = Verdict(short=Short(0), wait=0.0, tokens=0.0, requests=9.0, held=1)
        return BudgetAnswered(now=now, store=command.store, ask=command.ask, verdict=verdict)

    driver = fleet_sim(grant)
    driver.accept(1)
    driver.deliver(1, REQUEST)
    assert b" 200 " in bytes(driver.sent[1]) and not driver.unanswered
    assert [settle.ask.request for settle in driver.settles] == [1]  # the lease released


def test_a_reservation_no_store_answers_waits_in_unanswered() -> None:
    driver = fleet_sim(None)
    driver.accept(1)
    driver.deliver(1, REQUEST)
    assert [command.ask.request for command in driver.unanswered] == [1]
    assert not driver.backends and not driver.sent[1]  # waiting in RESERVING
