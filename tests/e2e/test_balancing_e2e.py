"""End to end: LLM-aware balancing and admission through a real proxy, in front of fake
engines (``FakeLLM`` with its engine model: a bounded number of running generations, a
prefix KV cache, vLLM's gauges on ``/metrics``).

Real sockets on 127.0.0.1, Hypercorn-served backends, httpx and the openai SDK as clients.
Every wait is on a condition (a backend counter, a proxy log record) under
``trio.fail_after``; the one wait on elapsed time is the queue timeout under test.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpx
import openai
import pytest
import trio
from peers import open_h2
from test_routing_e2e import LogCapture

from muxproxy.config import (
    AdmissionQueue,
    AffinityMode,
    Api,
    Balance,
    Config,
    Listener,
    LoadReporting,
    RateLimit,
    Route,
    Server,
    SessionSource,
    Upstream,
)

CHAT = "/v1/chat/completions"
SYSTEM = "You are the assistant of a large support desk. Answer politely. " * 40
TEST_TIMEOUT = 20


def config(ports: list[int], *, api: Api | None = None, **group: Any) -> Config:
    servers = group.pop("servers", None) or tuple(Server(address=f"127.0.0.1:{p}") for p in ports)
    upstream = Upstream(name="llm", servers=servers, pool_max_idle=8, **group)
    return Config(
        listeners=(Listener(address="127.0.0.1:0"),),
        upstreams={"llm": upstream},
        routes=(Route(prefix="/", upstream="llm", api=api),),
    )


def chat(user: str = "hi", *, system: str | None = None, max_tokens: int = 4) -> dict[str, Any]:
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": user})
    return {"model": "m", "messages": messages, "stream": True, "max_tokens": max_tokens}


BODY = json.dumps(chat()).encode()
JSON_TYPE = [("content-type", "application/json")]


async def one_slot(start_backend: Any, start_proxy: Any, **backend: Any) -> tuple[Any, Any, Any]:
    """A backend behind a proxy that lets it run one stream at once: (fake, proxy, router)."""
    fake, port = await start_backend(**backend)
    servers = (Server(address=f"127.0.0.1:{port}", max_streams=1),)
    proxy = await start_proxy(config=config([port], servers=servers))
    return fake, proxy, proxy.server.core.router(proxy.server.core.config.upstreams["llm"])


async def stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], **kw: Any) -> Any:
    """POST a streaming chat request; the response (read to its end)."""
    response = await client.post(url + CHAT, json=body, **kw)
    return response


async def test_an_engines_reported_queue_steers_least_load_away(
    start_backend: Any, start_proxy: Any
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        busy, busy_port = await start_backend(backend_id="busy", max_running=1, delay=0.05)
        _, idle_port = await start_backend(backend_id="idle", max_running=1, tokens=2)
        async with httpx.AsyncClient() as direct, trio.open_nursery() as others:
            # Others' work on "busy", sent to it directly: one running, two waiting.
            for _ in range(3):
                url = f"http://127.0.0.1:{busy_port}{CHAT}"
                others.start_soon(partial(direct.post, url, json=chat(max_tokens=200)))
            await busy.wait_until(lambda: busy.running == 1 and busy.waiting == 2)
            await check_steered(start_proxy, busy_port, idle_port)
            others.cancel_scope.cancel()


async def check_steered(start_proxy: Any, busy_port: int, idle_port: int) -> None:
    """Through a least_load proxy with load reports: new work avoids the busy engine."""
    reporting = LoadReporting(interval=0.2)
    proxy = await start_proxy(
        config=config([busy_port, idle_port], balance=Balance.LEAST_LOAD, load_report=reporting)
    )
    logs = LogCapture(proxy)
    await logs.wait_until(
        lambda: sum(r.event == "load_report" and r.fields["ok"] for r in logs.records) >= 2
    )
    async with httpx.AsyncClient() as client:
        answered = []
        for _ in range(4):
            response = await stream(client, proxy.url, chat(max_tokens=2))
            assert response.status_code == 200
            answered.append(response.headers["x-backend-id"])
    assert answered == ["idle"] * 4
    status = proxy.server.core.router(proxy.server.core.config.upstreams["llm"]).status(
        proxy.server.core.now
    )
    reported = status["servers"][0]["reported"]
    assert reported["running"] == 1 and reported["waiting"] == 2 and reported["fresh"]


async def test_the_turns_of_one_conversation_share_one_engines_kv_cache(
    start_backend: Any, start_proxy: Any
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        engines = [
            await start_backend(backend_id=f"gpu{i}", kv_blocks=512, prefill_per_token=0.0001)
            for i in range(3)
        ]
        ports = [port for _, port in engines]
        proxy = await start_proxy(
            config=config(ports, balance=Balance.LEAST_LOAD, affinity=AffinityMode.PREFIX)
        )
        async with httpx.AsyncClient() as client:
            served = set()
            for n in range(6):  # a conversation: each turn repeats the ones before it
                turn = chat("question 0", system=SYSTEM)
                for k in range(1, n + 1):
                    turn["messages"] += [
                        {"role": "assistant", "content": f"answer {k - 1}"},
                        {"role": "user", "content": f"question {k}"},
                    ]
                response = await stream(client, proxy.url, turn)
                assert response.status_code == 200
                served.add(response.headers["x-backend-id"])
        (owner,) = served
        fake = next(f for f, _ in engines if f.backend_id == owner)
        # The first request filled the cache; the five after it hit the system prompt's blocks.
        assert fake.prefix_cache_hits >= 5 * 500
        assert all(f.prefix_cache_queries == 0 for f, _ in engines if f is not fake)


async def test_a_full_server_makes_the_next_request_wait_then_serves_it(
    start_backend: Any, start_proxy: Any
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        fake, proxy, router = await one_slot(start_backend, start_proxy, tokens=3, delay=0.05)
        async with open_h2(proxy.port) as peer:
            first = await peer.request("POST", CHAT, JSON_TYPE, BODY)
            await fake.wait_streams_started(1)
            second = await peer.request("POST", CHAT, JSON_TYPE, BODY)
            await peer.sync()
            assert len(router.queue) == 1  # waiting in the proxy, not sent to the backend
            assert fake.requests == 1
            # It reaches the backend only once the first stream is over.
            await fake.wait_streams_started(2)
            assert fake.streams_completed == 1
            done = [await peer.wait_done(sid) for sid in (first, second)]
        assert [s.header(":status") for s in done] == ["200", "200"]
        assert all(s.body.endswith(b"data: [DONE]\n\n") for s in done)
        wait = proxy.server.core.measurements.group("llm").queue_wait
        assert sum(wait.counts) == 1 and len(router.queue) == 0


async def test_the_openai_sdk_sees_a_429_with_the_reason_after_the_queue_timeout(
    start_backend: Any, start_proxy: Any
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        fake, port = await start_backend(tokens=1000, delay=0.05)
        servers = (Server(address=f"127.0.0.1:{port}", max_streams=1),)
        queue = AdmissionQueue(max=10, timeout=0.3, retry_after=7)
        proxy = await start_proxy(
            config=config([port], servers=servers, queue=queue, api=Api.OPENAI)
        )
        async with httpx.AsyncClient() as holder, trio.open_nursery() as held:
            held.start_soon(stream, holder, proxy.url, chat(max_tokens=1000))
            await fake.wait_streams_started(1)
            sdk = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
            with pytest.raises(openai.RateLimitError) as refused:
                await sdk.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], stream=True
                )
            await sdk.close()
            held.cancel_scope.cancel()
        assert refused.value.status_code == 429
        assert refused.value.response.headers["retry-after"] == "7"
        assert "stayed busy for the queue's timeout" in str(refused.value)
        assert fake.streams_started == 1


async def test_a_client_that_resets_its_queued_stream_is_never_forwarded(
    start_backend: Any, start_proxy: Any
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        fake, proxy, router = await one_slot(start_backend, start_proxy, tokens=5, delay=0.05)
        logs = LogCapture(proxy)
        async with open_h2(proxy.port) as peer:
            first = await peer.request("POST", CHAT, JSON_TYPE, BODY)
            await fake.wait_streams_started(1)
            leaving = await peer.request("POST", CHAT, JSON_TYPE, BODY)
            await peer.sync()
            assert len(router.queue) == 1
            await peer.reset(leaving)
            await peer.sync()
            assert len(router.queue) == 0  # left at once, not when a server frees
            (aborted,) = await logs.wait_access(1)
            assert aborted["outcome"].startswith("client aborted")
            await peer.wait_done(first)
            after = await peer.request("POST", CHAT, JSON_TYPE, BODY)
            state = await peer.wait_done(after)
        assert state.header(":status") == "200"
        assert fake.requests == 2  # the reset request never reached the backend


async def test_a_spent_token_budget_answers_429_with_openai_rate_limit_fields(
    start_backend: Any, start_proxy: Any
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        _, port = await start_backend(tokens=3)
        tenant = SessionSource(kind="header", name="authorization")
        budget = RateLimit(tokens_per_minute=100)
        proxy = await start_proxy(config=config([port], tenant=tenant, rate_limit=budget))
        key = {"Authorization": "Bearer team-a"}
        with_usage = {**chat(max_tokens=5), "stream_options": {"include_usage": True}}
        async with httpx.AsyncClient() as client:
            ok = await stream(client, proxy.url, with_usage, headers=key)
            assert ok.status_code == 200
            # 5 reserved and 5 used (the usage object's completion_tokens): 95 left, and what
            # refilled since (100 a minute).
            refused = await stream(client, proxy.url, chat(max_tokens=98), headers=key)
            assert refused.status_code == 429
            assert refused.headers["x-ratelimit-limit-tokens"] == "100"
            assert 95 <= int(refused.headers["x-ratelimit-remaining-tokens"]) < 98
            assert int(refused.headers["retry-after"]) >= 1
            other = {"Authorization": "Bearer team-b"}
            answered = await stream(client, proxy.url, chat(max_tokens=98), headers=other)
            assert answered.status_code == 200
        assert b"rate limit" in refused.content
        stats = proxy.server.core.measurements.group("llm")
        assert stats.tokens_reserved == 5 + 98 and stats.reservations == 0
        assert stats.tokens_used == 5 + 100  # no usage object: its 98 events, a finish, [DONE]
