"""Discovery's decision (``muxproxy/fleet/discovery.py``): lookup outcomes in, server-set
changes and the next lookup's time out."""

from __future__ import annotations

import attrs
import pytest

from muxproxy.config import Config, Listener, Route, Server, Upstream
from muxproxy.config.discovery import Discover
from muxproxy.fleet.discovery import (
    MIN_INTERVAL,
    Answer,
    Change,
    Failure,
    Known,
    LookupResult,
    Target,
    decide,
    servers_of,
    srv_targets,
    with_discovered,
)

A, B, C, D = (Target(address=f"10.0.0.{n}:8000") for n in range(1, 5))


def answer(*targets: Target, ttl: float | None = None) -> Answer:
    return Answer(targets=targets, ttl=ttl)


def test_a_first_answer_joins_every_address_at_now() -> None:
    decision = decide(Known(), answer(B, A, C), now=10.0, interval=5.0)
    assert decision.result is LookupResult.OK
    assert decision.change == Change(joined=(A.address, B.address, C.address))
    assert decision.known.targets == (A, B, C)  # address order
    assert {m.joined for m in decision.known.members} == {10.0}
    assert decision.known.last_success == 10.0
    assert decision.next_lookup == 15.0


def test_a_grown_then_shrunk_answer_joins_and_removes_and_keeps_join_times() -> None:
    first = decide(Known(), answer(A, B, C), now=0.0, interval=5.0).known
    grown = decide(first, answer(A, B, C, D), now=5.0, interval=5.0)
    assert grown.change == Change(joined=(D.address,))
    joined = {m.target.address: m.joined for m in grown.known.members}
    assert joined == {A.address: 0.0, B.address: 0.0, C.address: 0.0, D.address: 5.0}
    shrunk = decide(grown.known, answer(D, B), now=10.0, interval=5.0)
    assert shrunk.change == Change(left=(A.address, C.address))
    assert shrunk.known.targets == (B, D)
    assert {m.target.address: m.joined for m in shrunk.known.members}[D.address] == 5.0


@pytest.mark.parametrize(
    "outcome",
    [
        Failure(result=LookupResult.TIMEOUT, reason="no answer within 2s"),
        Failure(result=LookupResult.NXDOMAIN, reason="the name does not exist"),
        Failure(result=LookupResult.ERROR, reason="REFUSED"),
        answer(),
    ],
)
def test_a_failed_or_empty_lookup_keeps_the_last_good_set(outcome: Answer | Failure) -> None:
    good = decide(Known(), answer(A, B), now=0.0, interval=5.0).known
    decision = decide(good, outcome, now=5.0, interval=5.0)
    assert not decision.change
    assert decision.known.members == good.members
    assert decision.known.last_success == 0.0
    assert decision.known.last_error_at == 5.0 and decision.known.last_error
    assert decision.result is (
        LookupResult.EMPTY if isinstance(outcome, Answer) else outcome.result
    )


def test_failures_retry_sooner_backing_off_to_the_interval_and_success_resets() -> None:
    known = decide(Known(), answer(A), now=0.0, interval=30.0).known
    waits = []
    now = 0.0
    for _ in range(7):
        decision = decide(known, Failure(result=LookupResult.TIMEOUT, reason="t"), now, 30.0)
        waits.append(decision.next_lookup - now)
        known, now = decision.known, decision.next_lookup
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert known.failures == 7
    after = decide(known, answer(A), now, 30.0)
    assert after.known.failures == 0 and after.known.last_error == "t"
    assert after.next_lookup - now == 30.0


@pytest.mark.parametrize(
    ("ttl", "wait"), [(None, 5.0), (60.0, 5.0), (2.0, 2.0), (0.0, MIN_INTERVAL)]
)
def test_the_next_lookup_is_at_the_smaller_of_interval_and_ttl_at_least_a_second(
    ttl: float | None, wait: float
) -> None:
    assert decide(Known(), answer(A, ttl=ttl), now=1.0, interval=5.0).next_lookup == 1.0 + wait


def test_a_changed_weight_is_a_change_but_no_join() -> None:
    heavy = attrs.evolve(A, weight=5)
    known = decide(Known(), answer(A), now=0.0, interval=5.0).known
    decision = decide(known, answer(heavy), now=3.0, interval=5.0)
    assert decision.change == Change(changed=(A.address,))
    assert decision.known.members[0].joined == 0.0


def test_srv_records_give_ports_weights_and_backups_by_priority() -> None:
    records = [(10, 0, 8000, "a.example."), (10, 3, 8001, "b.example."), (20, 1, 9000, "c.")]
    addresses = {
        "a.example.": ["10.0.0.1", "fd00::1"],
        "b.example.": ["10.0.0.2"],
        "c.": ["1.1.1.1"],
    }
    assert srv_targets(records, addresses) == (
        Target(address="10.0.0.1:8000", weight=1, name="a.example."),
        Target(address="[fd00::1]:8000", weight=1, name="a.example."),
        Target(address="10.0.0.2:8001", weight=3, name="b.example."),
        Target(address="1.1.1.1:9000", weight=1, backup=True, name="c."),
    )


def test_servers_get_the_discover_tables_settings() -> None:
    discover = Discover(dns="vllm.example.", port=8443, protocol="h2", tls=True, max_streams=8)
    (server,) = servers_of(discover, [Target(address="10.0.0.1:8443")])
    assert server == Server(
        address="10.0.0.1:8443",
        protocol="h2",
        tls=True,
        tls_server_name="vllm.example",
        max_streams=8,
    )
    (weighted,) = servers_of(attrs.evolve(discover, tls=False), [attrs.evolve(A, weight=4)])
    assert weighted.weight == 4 and weighted.tls_server_name is None


def test_a_reloaded_configuration_gets_the_last_discovered_sets_back() -> None:
    discover = Discover(dns="vllm.example", port=8000)
    config = Config(
        listeners=(Listener(address="127.0.0.1:0"),),
        upstreams={
            "found": Upstream(name="found", discover=discover),
            "listed": Upstream(name="listed", servers=(Server(address="10.9.9.9:1"),)),
        },
        routes=(Route(prefix="/", upstream="found"),),
    )
    assert with_discovered(config, {}) is config
    filled = with_discovered(config, {"found": [A, B], "listed": [C]})
    assert [s.address for s in filled.upstreams["found"].servers] == [A.address, B.address]
    assert filled.upstreams["listed"] is config.upstreams["listed"]
    assert with_discovered(filled, {"found": [A, B]}) is filled
