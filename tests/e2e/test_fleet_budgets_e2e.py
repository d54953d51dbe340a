"""Fleet-wide budgets end to end: three ``python -m muxproxy serve`` replicas share one real
``redis-server`` (``[fleet] store``) in front of fake LLM backends in this process.

- A tenant's ``tokens_per_minute`` holds across the replicas under concurrent load: what the
  three admit is the budget plus its refill over the run, overspent by 5 % at most.
- ``max_concurrent`` holds across them: of 12 streams sent at once to the three, 4 reach the
  backend and the rest are refused with 429.
- Redis killed mid-run: ``local`` serves on, each replica enforcing its share of the budget;
  ``closed`` answers 503; ``open`` admits; Redis restarted: the budgets are the store's again.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import coredis
import httpx
import pytest
import trio
from processes import ProxyProcess, proxy_process

from muxproxy.testing.fakellm import MODEL

TOKEN = "admin-secret"
TEST_TIMEOUT = 55.0


def request(max_tokens: int, *, stream: bool = True) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
    }


TENANT = {"authorization": "Bearer tenant-a"}


def write_config(
    path: Path, backend: int, store: str, rate_limit: str, policy: str = "local"
) -> Path:
    path.write_text(
        '[[listeners]]\naddress = "127.0.0.1:0"\n'
        f'[upstreams.gpus]\nservers = ["127.0.0.1:{backend}"]\n'
        'tenant = "header:authorization"\n'
        f"[upstreams.gpus.rate_limit]\n{rate_limit}\n"
        f'[fleet]\nstore = "{store}"\non_store_error = "{policy}"\n'
        f'[admin]\naddress = "127.0.0.1:0"\ntoken = "{TOKEN}"\n'
    )
    return path


@asynccontextmanager
async def replicas(config: Path, count: int = 3) -> AsyncIterator[list[ProxyProcess]]:
    """``count`` replicas of ``config``, once each counts them all in the store."""
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        started: list[ProxyProcess] = []

        async def start() -> None:
            started.append(
                await stack.enter_async_context(proxy_process(nursery, config=config, admin=True))
            )

        async with trio.open_nursery() as starting:
            for _ in range(count):
                starting.start_soon(start)
        for proxy in started:
            await wait_metric(proxy, "muxproxy_fleet_replicas", lambda value: value == count)
        yield started
        nursery.cancel_scope.cancel()


async def metric(proxy: ProxyProcess, name: str) -> float | None:
    async with httpx.AsyncClient() as client:
        response = await client.get(
            proxy.admin_url + "/metrics", headers={"authorization": f"Bearer {TOKEN}"}
        )
    found = re.search(rf"^{re.escape(name)} (\S+)$", response.text, re.M)
    return None if found is None else float(found[1])


async def wait_metric(proxy: ProxyProcess, name: str, ok: Any) -> None:
    """Until ``name`` (a sample without labels) satisfies ``ok``: a poll of an observable."""
    while (value := await metric(proxy, name)) is None or not ok(value):
        await trio.sleep(0.05)


def completion_tokens(body: str) -> int:
    """The ``usage.completion_tokens`` of a streamed answer's usage chunk."""
    for line in body.splitlines():
        if line.startswith("data: {") and '"usage"' in line:
            usage = json.loads(line[len("data: ") :]).get("usage")
            if usage:
                return int(usage["completion_tokens"])
    raise AssertionError(f"no usage in {body[:200]!r}")


async def test_a_token_budget_holds_across_three_replicas_under_load(
    tmp_path: Path, start_backend: Any, redis_server: Any
) -> None:
    budget = 3000  # tokens a minute; 60 requests of 50 tokens when full
    _, port = await start_backend(tokens=50, delay=0.0)
    config = write_config(
        tmp_path / "muxproxy.toml", port, redis_server.url, f"tokens_per_minute = {budget}"
    )
    with trio.fail_after(TEST_TIMEOUT):
        async with replicas(config) as proxies:
            used = 0
            statuses: dict[int, int] = {}
            load_for = 5.0

            async def client(index: int) -> None:
                nonlocal used
                url = proxies[index % 3].url + "/v1/chat/completions"
                async with httpx.AsyncClient(timeout=10) as http:
                    while trio.current_time() < deadline:
                        response = await http.post(url, json=request(50), headers=TENANT)
                        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                        if response.status_code == 200:
                            used += completion_tokens(response.text)
                        else:
                            assert response.status_code == 429, response.text

            began = trio.current_time()
            deadline = began + load_for
            async with trio.open_nursery() as load:
                for index in range(12):
                    load.start_soon(client, index)
            elapsed = trio.current_time() - began
    allowed = budget + budget * elapsed / 60  # full at the start, refilled as it ran
    overspend = used / allowed - 1
    print(f"tokens used {used}, allowed {allowed:.0f}: overspend {overspend:+.2%}; {statuses}")
    assert statuses.get(429, 0) > 0  # the load went past the budget
    assert overspend <= 0.05
    assert used >= 0.9 * allowed - 50 * 3  # and the budget was not starved either


class Peak:
    """The most streams ``fake`` ran at once, seen at each change of its counts (``watch``)."""

    def __init__(self, fake: Any) -> None:
        self.fake = fake
        self.most = 0

    def counts(self) -> tuple[int, int, int]:
        return self.fake.streams_started, self.fake.streams_completed, self.fake.disconnects

    async def watch(self) -> None:
        while True:
            seen = self.counts()
            self.most = max(self.most, seen[0] - seen[1] - seen[2])
            await self.fake.wait_until(lambda seen=seen: self.counts() != seen)


async def test_max_concurrent_holds_across_three_replicas(
    tmp_path: Path, start_backend: Any, redis_server: Any
) -> None:
    fake, port = await start_backend(tokens=20, delay=0.1)  # each stream lasts about 2 s
    config = write_config(tmp_path / "muxproxy.toml", port, redis_server.url, "max_concurrent = 4")
    peak = Peak(fake)

    with trio.fail_after(TEST_TIMEOUT):
        async with replicas(config) as proxies, trio.open_nursery() as nursery:
            nursery.start_soon(peak.watch)
            statuses: list[int] = []

            async def stream(index: int) -> None:
                url = proxies[index % 3].url + "/v1/chat/completions"
                async with httpx.AsyncClient(timeout=20) as http:
                    response = await http.post(url, json=request(20), headers=TENANT)
                    statuses.append(response.status_code)
                    if response.status_code == 429:
                        assert response.headers["retry-after"] == "1"
                        assert "4 requests in flight" in response.text

            async with trio.open_nursery() as clients:
                for index in range(12):
                    clients.start_soon(stream, index)
            assert sorted(statuses) == [200] * 4 + [429] * 8
            assert peak.most == 4
            # Every lease went back at its stream's end: four at once are admitted again.
            statuses.clear()
            async with trio.open_nursery() as again:
                for index in range(4):
                    again.start_soon(stream, index)
            assert statuses == [200] * 4
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("policy", ["local", "closed", "open"])
async def test_the_store_killed_mid_run_and_restarted(
    tmp_path: Path, start_backend: Any, redis_server: Any, policy: str
) -> None:
    _, port = await start_backend(tokens=2, delay=0.0)
    config = write_config(
        tmp_path / "muxproxy.toml",
        port,
        redis_server.url,
        "requests_per_minute = 60",
        policy,
    )
    with trio.fail_after(TEST_TIMEOUT):
        async with replicas(config) as proxies, httpx.AsyncClient(timeout=10) as http:
            urls = [proxy.url + "/v1/chat/completions" for proxy in proxies]

            async def send(url: str) -> int:
                response = await http.post(url, json=request(2), headers=TENANT)
                return response.status_code

            assert [await send(url) for url in urls] == [200, 200, 200]
            await redis_server.kill()
            # 25 to one replica: its share of 60 a minute among 3 is 20.
            one = [await send(urls[0]) for _ in range(25)]
            others = [await send(url) for url in urls[1:] for _ in range(5)]
            match policy:
                case "local":
                    assert one.count(200) in (20, 21) and set(one) == {200, 429}
                    assert one[:20] == [200] * 20
                    assert others == [200] * 10
                case "closed":
                    assert set(one + others) == {503}
                case "open":
                    assert set(one + others) == {200}
            errors = await metric(proxies[0], "muxproxy_fleet_budget_store_errors_total")
            assert errors is not None and errors > 0
            await redis_server.restart()
            async with coredis.Redis.from_url(redis_server.url, verify_version=False) as redis:
                # Back to the store: a request's reservation is in Redis again.
                while not await redis.keys("muxproxy:fleet:budget:*"):
                    assert await send(urls[0]) in (200, 429, 503)
                    await trio.sleep(0.05)
                # Each replica finds the store again by itself (its next heartbeat, within a
                # second): until then a "closed" one still answers 503.
                while (status := await send(urls[1])) != 200:
                    assert status in (429, 503)
                    await trio.sleep(0.05)
