"""DNS discovery end to end: a real ``muxproxy serve`` process asks a real DNS server
(``tests/dnsserver.py``) for its servers while sticky multi-turn streams run through it.

Six fake engines listen on 127.0.0.2 to 127.0.0.7 at one port (A records give addresses,
not ports). The name's answer grows from 3 addresses to 6 and shrinks to 2 while streaming
conversations (an ``X-Chat-ID`` key, several turns each) keep coming; then the DNS server
is stopped for :data:`OUTAGE` seconds. What must hold: no request fails and every stream is
whole; the servers that join ramp in (``effective_weight`` below ``weight`` at first) and
take new conversations once ramped; streams in flight on the servers that vanish finish
there and no turn begins on them afterwards; the outage changes nothing but ``/status``'s
last error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from processes import proxy_process

from muxproxy.testing.dnsserver import DnsServer, dns_server
from muxproxy.testing.fakellm import FakeLLM, serve_fakellm

NAME = "vllm.llm.svc.cluster.local"
HOSTS = [f"127.0.0.{n}" for n in range(2, 8)]
TOKENS = 10
DELAY = 0.05
"""A turn streams for about half a second: shrinks and growths land mid-stream."""
CLIENTS = 12
OUTAGE = float(os.environ.get("MUXPROXY_TEST_DNS_OUTAGE", "30"))
SLOW_START = 3.0


@attrs.define
class Turn:
    conversation: str
    backend: str | None = None
    began: float = 0.0
    ended: float = 0.0
    tokens: int = 0
    done: bool = False
    error: str | None = None


def chat() -> dict[str, object]:
    return {
        "model": "m",
        "stream": True,
        "max_tokens": TOKENS,
        "messages": [{"role": "user", "content": "hi"}],
    }


async def turn(client: httpx.AsyncClient, url: str, key: str) -> Turn:
    out = Turn(conversation=key, began=trio.current_time())
    try:
        async with client.stream("POST", url, json=chat(), headers={"X-Chat-ID": key}) as response:
            out.backend = response.headers.get("x-backend-id")
            if response.status_code != 200:
                out.error = f"status {response.status_code}"
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    out.done = True
                elif line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get(
                    "content"
                ):
                    out.tokens += 1
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.ended = trio.current_time()
    if out.error is None and not (out.done and out.tokens == TOKENS):
        out.error = f"incomplete: {out.tokens} tokens, done={out.done}"
    return out


async def converse(url: str, client_id: int, turns: list[Turn], stop: trio.Event) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        number = 0
        while not stop.is_set():
            key = f"c{client_id}-{number}"
            number += 1
            for _ in range(3):  # three turns of one conversation
                turns.append(await turn(client, url, key))


def config_text(dns: DnsServer, port: int) -> str:
    return f"""
[[listeners]]
address = "127.0.0.1:0"
[admin]
address = "127.0.0.1:0"
[log]
access = "off"
[resolver]
nameservers = ["{dns.nameserver}"]
timeout = 0.5
[upstreams.gpus]
discover = {{ dns = "{NAME}", port = {port}, interval = 1 }}
slow_start = {SLOW_START}
[upstreams.gpus.sticky]
sources = ["header:X-Chat-ID"]
"""


async def start_engines(nursery: trio.Nursery) -> tuple[dict[str, FakeLLM], int]:
    fakes = {host: FakeLLM(backend_id=host, tokens=TOKENS, delay=DELAY) for host in HOSTS}
    port = await nursery.start(partial(serve_fakellm, fakes[HOSTS[0]], host=HOSTS[0]))
    for host in HOSTS[1:]:
        await nursery.start(partial(serve_fakellm, fakes[host], host=host, port=port))
    return fakes, port


async def status_of(admin: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{admin}/status")
    document: dict[str, Any] = response.json()["groups"]["gpus"]
    return document


async def wait_for_servers(admin: str, hosts: list[str], port: int) -> dict[str, Any]:
    wanted = sorted(f"{h}:{port}" for h in hosts)
    while True:
        group = await status_of(admin)
        if sorted(s["address"] for s in group["servers"]) == wanted:
            return group
        await trio.sleep(0.05)


@pytest.fixture
def dns() -> Iterator[DnsServer]:
    with dns_server() as server:
        yield server


async def test_servers_join_ramp_drain_and_survive_a_dns_outage_under_sticky_streams(
    tmp_path: Path, nursery: trio.Nursery, dns: DnsServer
) -> None:
    fakes, port = await start_engines(nursery)
    dns.set_a(NAME, HOSTS[:3], ttl=1)
    path = tmp_path / "muxproxy.toml"
    path.write_text(config_text(dns, port))
    turns: list[Turn] = []
    stop = trio.Event()
    with trio.fail_after(OUTAGE + 40):
        async with proxy_process(nursery, config=path, admin=True) as proxy:
            url = f"{proxy.url}/v1/chat/completions"
            admin = proxy.admin_url
            group = await wait_for_servers(admin, HOSTS[:3], port)  # before any request
            async with trio.open_nursery() as clients:
                for client_id in range(CLIENTS):
                    clients.start_soon(converse, url, client_id, turns, stop)
                await trio.sleep(1.0)  # conversations on the first three

                dns.set_a(NAME, HOSTS, ttl=1)
                group = await wait_for_servers(admin, HOSTS, port)
                grown_at = trio.current_time()
                new = {f"{h}:{port}" for h in HOSTS[3:]}
                ramping = [s for s in group["servers"] if s["address"] in new]
                assert all(s["weight"] == 1 and s["effective_weight"] < 0.5 for s in ramping), (
                    ramping
                )
                while trio.current_time() < grown_at + SLOW_START + 1.5:
                    await trio.sleep(0.1)
                group = await status_of(admin)
                assert all(s["effective_weight"] == 1.0 for s in group["servers"])
                ramped_at = grown_at + SLOW_START
                with trio.fail_after(15):  # new conversations hash over six: wait for all three
                    while not {t.backend for t in turns if t.began > ramped_at} >= set(HOSTS[3:]):
                        await trio.sleep(0.1)

                kept = [HOSTS[1], HOSTS[4]]
                dns.set_a(NAME, kept, ttl=1)
                await wait_for_servers(admin, kept, port)
                shrunk_at = trio.current_time()
                await trio.sleep(1.5)

                dns.stop()
                outage_at = trio.current_time()
                while trio.current_time() < outage_at + OUTAGE:
                    await trio.sleep(0.5)
                    group = await status_of(admin)
                    assert sorted(s["address"] for s in group["servers"]) == sorted(
                        f"{h}:{port}" for h in kept
                    )
                assert group["discovery"]["last_error"], group["discovery"]
                assert group["discovery"]["addresses"] == sorted(f"{h}:{port}" for h in kept)
                dns.start()
                stop.set()
    failed = [t for t in turns if t.error is not None]
    assert not failed, failed[:5]
    assert len(turns) > 100
    ramped = [t for t in turns if t.began > ramped_at and t.ended < shrunk_at]
    assert {t.backend for t in ramped} >= set(HOSTS[3:])  # the new ones, ramped
    vanished = set(HOSTS) - set(kept)
    in_flight = [t for t in turns if t.backend in vanished and t.began < shrunk_at < t.ended]
    assert in_flight, "no stream was in flight on a vanishing server at the shrink"
    assert all(t.done for t in in_flight)
    after = [t for t in turns if t.began > shrunk_at + 0.1]
    assert after and {t.backend for t in after} <= set(kept)
    during_outage = [t for t in turns if outage_at < t.began < outage_at + OUTAGE]
    assert len(during_outage) > 50
    assert sum(fakes[h].requests for h in HOSTS[3:]) > 0


async def test_every_worker_routes_over_the_set_the_supervisor_discovered(
    tmp_path: Path, nursery: trio.Nursery, dns: DnsServer
) -> None:
    _fakes, port = await start_engines(nursery)
    dns.set_a(NAME, HOSTS[:2], ttl=1)
    path = tmp_path / "muxproxy.toml"
    path.write_text(config_text(dns, port))

    async def spread(url: str, count: int) -> set[str | None]:
        """``count`` turns, each on a connection of its own (spread over the workers)."""
        seen: list[Turn] = []

        async def one(number: int) -> None:
            async with httpx.AsyncClient(timeout=10) as client:
                seen.append(await turn(client, url, f"spread-{number}-{trio.current_time()}"))

        async with trio.open_nursery() as turns:
            for number in range(count):
                turns.start_soon(one, number)
        assert all(t.error is None for t in seen), [t.error for t in seen if t.error]
        return {t.backend for t in seen}

    with trio.fail_after(50):
        async with proxy_process(nursery, "--workers", "2", config=path, admin=True) as proxy:
            url = f"{proxy.url}/v1/chat/completions"
            assert await spread(url, 24) == set(HOSTS[:2])
            dns.set_a(NAME, [HOSTS[1], HOSTS[2], HOSTS[3]], ttl=1)
            group = await wait_for_servers(proxy.admin_url, HOSTS[1:4], port)
            assert group["discovery"]["name"] == NAME
            await trio.sleep(SLOW_START)  # ramped in every worker
            assert await spread(url, 30) == set(HOSTS[1:4])  # none on the vanished one
            document = await status_of(proxy.admin_url)
            assert all(s["effective_weight"] == 1.0 for s in document["servers"])
