"""Discovery's I/O (``muxproxy/trio/discovery.py``) against a real DNS server
(``tests/dnsserver.py``): what each answer and failure becomes, and the lookup loop."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
import trio

from muxproxy.config import Config, Listener, Route, Upstream
from muxproxy.config.discovery import Discover
from muxproxy.config.fleet import ResolverSettings
from muxproxy.fleet.discovery import Answer, Failure, LookupResult, Target
from muxproxy.testing.dnsserver import NXDOMAIN, REFUSE, SILENT, DnsServer, dns_server
from muxproxy.trio.discovery import Discovery, lookup, make_resolver

NAME = "vllm.llm.svc.cluster.local"
SRV_NAME = "_http._tcp.vllm.llm.svc.cluster.local"


@pytest.fixture
def dns() -> Iterator[DnsServer]:
    with dns_server() as server:
        yield server


def resolver_for(dns: DnsServer, timeout: float = 0.5) -> ResolverSettings:
    return ResolverSettings(nameservers=(dns.nameserver,), timeout=timeout, attempts=2)


async def test_a_and_aaaa_records_are_the_servers_with_the_smallest_ttl(dns: DnsServer) -> None:
    dns.set_a(NAME, ["10.0.0.2", "10.0.0.1"], ttl=7)
    dns.set_aaaa(NAME, ["fd00::1"])
    with trio.fail_after(5):
        outcome = await lookup(make_resolver(resolver_for(dns)), Discover(dns=NAME, port=8000))
    assert isinstance(outcome, Answer)
    assert sorted(t.address for t in outcome.targets) == [
        "10.0.0.1:8000",
        "10.0.0.2:8000",
        "[fd00::1]:8000",
    ]
    assert outcome.ttl == 7


async def test_srv_records_give_each_targets_addresses_ports_and_weights(dns: DnsServer) -> None:
    dns.set_srv(SRV_NAME, [(0, 5, 9001, "a.example"), (1, 0, 9002, "b.example")], ttl=3)
    dns.set_a("a.example", ["10.0.0.1"])
    dns.set_a("b.example", ["10.0.0.2"])
    with trio.fail_after(5):
        outcome = await lookup(make_resolver(resolver_for(dns)), Discover(srv=SRV_NAME))
    assert isinstance(outcome, Answer)
    assert set(outcome.targets) == {
        Target(address="10.0.0.1:9001", weight=5, name="a.example."),
        Target(address="10.0.0.2:9002", weight=1, backup=True, name="b.example."),
    }


@pytest.mark.parametrize(
    ("mode", "result"),
    [
        (NXDOMAIN, LookupResult.NXDOMAIN),
        (REFUSE, LookupResult.ERROR),
        (SILENT, LookupResult.TIMEOUT),
    ],
)
async def test_each_failure_is_named(dns: DnsServer, mode: str, result: LookupResult) -> None:
    dns.set_a(NAME, ["10.0.0.1"])
    dns.set_mode(mode)
    with trio.fail_after(5):
        outcome = await lookup(make_resolver(resolver_for(dns)), Discover(dns=NAME, port=80))
    assert isinstance(outcome, Failure) and outcome.result is result
    assert NAME in outcome.reason


async def test_a_stopped_server_and_a_name_without_records_fail_without_raising(
    dns: DnsServer,
) -> None:
    dns.set_srv(SRV_NAME, [(0, 1, 9001, "a.example")])  # the name exists, with no A record
    resolver = make_resolver(resolver_for(dns))
    with trio.fail_after(5):
        empty = await lookup(resolver, Discover(dns=SRV_NAME, port=80))
        dns.stop()
        stopped = await lookup(resolver, Discover(dns=SRV_NAME, port=80))
    assert empty == Answer(targets=())
    assert isinstance(stopped, Failure)
    assert stopped.result in (LookupResult.ERROR, LookupResult.TIMEOUT)


def config_for(server: DnsServer, **discover: object) -> Config:
    return Config(
        listeners=(Listener(address="127.0.0.1:0"),),
        upstreams={"gpus": Upstream(name="gpus", discover=Discover(**discover))},  # type: ignore[arg-type]
        routes=(Route(prefix="/", upstream="gpus"),),
        resolver=resolver_for(server),
    )


class Applied:
    def __init__(self) -> None:
        self.sets: list[dict[str, list[str]]] = []
        self.changed = trio.Event()

    async def __call__(self, sets: Mapping[str, tuple[Target, ...]]) -> None:
        self.sets.append({g: [t.address for t in targets] for g, targets in sets.items()})
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, addresses: list[str]) -> None:
        while not self.sets or self.sets[-1]["gpus"] != addresses:
            await self.changed.wait()


async def test_the_loop_follows_the_answer_and_keeps_the_set_while_dns_is_down(
    dns: DnsServer,
) -> None:
    dns.set_a(NAME, ["10.0.0.1", "10.0.0.2"], ttl=1)
    config = config_for(dns, dns=NAME, port=8000, interval=60)
    applied = Applied()
    discovery = Discovery(lambda: config, applied)
    with trio.fail_after(15):
        await discovery.first_round()
        assert applied.sets == [{"gpus": ["10.0.0.1:8000", "10.0.0.2:8000"]}]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(discovery.run)
            # The TTL (1 s), not the interval (60 s), brings the next lookup.
            dns.set_a(NAME, ["10.0.0.3", "10.0.0.2"], ttl=1)
            await applied.wait_for(["10.0.0.2:8000", "10.0.0.3:8000"])
            dns.stop()
            failures = discovery.lookups[("gpus", "error")] + discovery.lookups[("gpus", "timeout")]
            while (
                discovery.lookups[("gpus", "error")] + discovery.lookups[("gpus", "timeout")]
                < failures + 2
            ):
                await trio.sleep(0.05)
            status = discovery.status(trio.current_time())["gpus"]
            assert status["addresses"] == ["10.0.0.2:8000", "10.0.0.3:8000"]
            assert status["name"] == NAME and status["last_error"]
            assert status["last_success_age"] >= 1.0
            dns.set_mode(NXDOMAIN)
            dns.start()
            while not discovery.lookups[("gpus", "nxdomain")]:
                await trio.sleep(0.05)
            assert discovery.sets()["gpus"] == tuple(
                Target(address=a, name=NAME) for a in ("10.0.0.2:8000", "10.0.0.3:8000")
            )
            nursery.cancel_scope.cancel()
    assert len(applied.sets) == 2  # failures applied nothing
    snapshot = discovery.snapshot(trio.current_time())["metrics"]
    assert snapshot["muxproxy_discovery_servers"]["samples"] == [[["gpus"], 2]]
    results = {
        tuple(labels): n for labels, n in snapshot["muxproxy_discovery_lookups_total"]["samples"]
    }
    assert results[("gpus", "ok")] >= 2 and results[("gpus", "nxdomain")] >= 1
