"""End to end: the OpenAI Responses and Anthropic Messages streams, understood by the proxy.

Real sockets on 127.0.0.1: the fake LLM backends, the proxy, and the official SDKs as clients
(``openai`` for Responses, ``anthropic`` for Messages, each in a worker thread) or httpx where
the test reads the raw events. Time to first token is the first content event (not
``response.created`` or ``message_start``, which come at once), the usage of the last event
settles a token budget, an error event before any content fails over to the next server, and a
cut stream resumes with ``Last-Event-ID``.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from muxproxy.config import (
    Config,
    Listener,
    NextUpstream,
    RateLimit,
    Resume,
    Route,
    Server,
    SessionSource,
    Upstream,
)
from muxproxy.testing.fakellm import reply_text

TOKENS = 5
FIRST_DELAY = 0.3
KEY = "Bearer team-a"


def config(ports: list[int], **group: Any) -> Config:
    """One group ``llm`` of ``ports`` (the later ones backups), one route to it."""
    route = group.pop("route", {})
    servers = tuple(Server(address=f"127.0.0.1:{p}", backup=n > 0) for n, p in enumerate(ports))
    upstream = Upstream(name="llm", servers=servers, pool_max_idle=8, **group)
    return Config(
        listeners=(Listener(address="127.0.0.1:0"),),
        upstreams={"llm": upstream},
        routes=(Route(prefix="/", upstream="llm", **route),),
    )


def responses_text(url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="team-a", timeout=10, max_retries=0)
    events = list(client.responses.create(model="m1", input="say hi", stream=True))
    assert events[-1].type == "response.completed"
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def messages_text(url: str) -> str:
    client = anthropic.Anthropic(base_url=url, api_key="x", timeout=10, max_retries=0)
    with client.messages.stream(
        model="m1",
        max_tokens=64,
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"Authorization": KEY, "x-fake-tokens": str(TOKENS)},
    ) as stream:
        return "".join(stream.text_stream)


CLIENTS = {"responses": responses_text, "messages": messages_text}


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_time_to_first_token_and_usage_settle_a_token_budget(
    start_backend: Any, start_proxy: Any, api: str
) -> None:
    # The stream's opening events (``response.created``, ``message_start``, a ``ping``) come
    # at once; the first token FIRST_DELAY later: time to first token is that of the token.
    _, port = await start_backend(tokens=TOKENS, delay=0.001, first_delay=FIRST_DELAY)
    tenant = SessionSource(kind="header", name="authorization")
    budget = RateLimit(tokens_per_minute=1000)
    proxy = await start_proxy(config=config([port], tenant=tenant, rate_limit=budget))
    with trio.fail_after(15):
        text = await trio.to_thread.run_sync(CLIENTS[api], proxy.url)
    assert text == reply_text(TOKENS)
    measurements = proxy.server.core.measurements
    ttft = measurements.token_times("llm", f"127.0.0.1:{port}").ttft
    assert sum(ttft.counts) == 1
    assert FIRST_DELAY <= ttft.sum < FIRST_DELAY + 1.0
    stats = measurements.group("llm")
    # Reserved: the request's max_tokens (Messages) or the group's default (Responses names
    # max_output_tokens); settled to the usage's output_tokens (the fake answers TOKENS), not
    # to the events relayed (TOKENS and a dozen or so of framing).
    assert stats.tokens_reserved == (64 if api == "messages" else 256)
    assert stats.tokens_used == TOKENS and stats.reservations == 0


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_an_error_event_before_the_first_token_fails_over(
    start_backend: Any, start_proxy: Any, api: str
) -> None:
    # The first server opens its stream and then reports overloaded (Messages'
    # ``overloaded_error``, Responses' ``error`` event) before any token.
    failing, one = await start_backend(tokens=TOKENS, delay=0.001, die_after=0)
    backup, two = await start_backend(tokens=TOKENS, delay=0.001)
    proxy = await start_proxy(config=config([one, two], route={"retry_until_first_event": True}))
    with trio.fail_after(15):
        text = await trio.to_thread.run_sync(CLIENTS[api], proxy.url)
    assert text == reply_text(TOKENS)  # one clean stream, the backup's
    assert failing.streams_started == 1 and backup.streams_completed == 1
    retries = proxy.server.core.measurements.retries
    assert retries == {("llm", "error"): 1}


async def test_without_a_try_left_the_error_event_is_relayed(
    start_backend: Any, start_proxy: Any
) -> None:
    _, port = await start_backend(tokens=TOKENS, delay=0.001, die_after=0)
    proxy = await start_proxy(config=config([port], route={"retry_until_first_event": True}))
    with trio.fail_after(15), pytest.raises(anthropic.APIStatusError) as raised:
        await trio.to_thread.run_sync(messages_text, proxy.url)
    assert "overloaded_error" in str(raised.value)


BODIES = {
    "responses": ("/v1/responses", {"model": "m1", "input": "a story", "stream": True}),
    "messages": (
        "/v1/messages",
        {
            "model": "m1",
            "max_tokens": 30,
            "stream": True,
            "messages": [{"role": "user", "content": "a story"}],
        },
    ),
}


def events_of(raw: str) -> list[tuple[str | None, str | None, dict[str, Any]]]:
    """Each event's ``id``, ``event`` name and data object."""
    out = []
    for block in raw.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields:
            out.append((fields.get("id"), fields.get("event"), json.loads(fields["data"])))
    return out


def text_of(events: list[tuple[str | None, str | None, dict[str, Any]]]) -> str:
    text = ""
    for _, _, data in events:
        delta = data.get("delta")
        if data["type"] == "response.output_text.delta":
            text += delta  # type: ignore[operator]
        elif data["type"] == "content_block_delta":
            text += delta["text"]  # type: ignore[index]
    return text


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_a_cut_stream_resumes_with_last_event_id(
    start_backend: Any, start_proxy: Any, api: str
) -> None:
    tokens = 30
    fake, port = await start_backend(tokens=tokens, delay=0.01)
    proxy = await start_proxy(config=config([port], route={"resume": Resume()}))
    path, body = BODIES[api]
    with trio.fail_after(15):
        async with httpx.AsyncClient(timeout=10) as client:
            raw = ""
            async with client.stream("POST", proxy.url + path, json=body) as response:
                assert response.status_code == 200
                async for chunk in response.aiter_text():
                    raw += chunk
                    if raw.count("\n\n") >= 8:
                        break
            before = events_of(raw[: raw.rindex("\n\n") + 2])
            headers = {"Last-Event-ID": before[-1][0] or "", "Accept": "text/event-stream"}
            async with client.stream("GET", proxy.url + path, headers=headers) as response:
                assert response.status_code == 200
                await response.aread()
                after = events_of(response.text)
    events = before + after
    token = events[0][0].rsplit(".", 1)[0]  # type: ignore[union-attr]
    assert [e[0] for e in events] == [f"{token}.{n}" for n in range(1, len(events) + 1)]
    assert text_of(events) == reply_text(tokens)
    last = events[-1][2]["type"]
    assert last == ("response.completed" if api == "responses" else "message_stop")
    assert fake.streams_started == 1


async def test_a_messages_answer_cut_mid_stream_is_finished_by_the_next_server(
    start_backend: Any, start_proxy: Any
) -> None:
    tokens = 12
    first, one = await start_backend(backend_id="gpu0", delay=0.002, die_after=5)
    backup, two = await start_backend(backend_id="gpu1", delay=0.002)
    proxy = await start_proxy(
        config=config(
            [one, two],
            next_upstream=NextUpstream(tries=3),
            route={"continue_on_failure": True},
        )
    )
    client = anthropic.Anthropic(base_url=proxy.url, api_key="x", timeout=10, max_retries=0)

    def use_sdk() -> tuple[list[Any], Any]:
        with client.messages.stream(
            model="m1", max_tokens=tokens, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            events = list(stream)
            return events, stream.get_final_message()

    with trio.fail_after(15):
        events, message = await trio.to_thread.run_sync(use_sdk)
    assert message.content[0].text == reply_text(tokens)  # one block, the whole answer
    assert len(message.content) == 1 and message.stop_reason == "end_turn"
    assert "gpu0" in message.id  # the original message's id: one message_start
    assert [e.type for e in events].count("message_start") == 1
    assert message.usage.output_tokens == tokens  # the continuation's, plus those relayed
    assert {e.index for e in events if e.type.startswith("content_block")} == {0}
    assert first.aborts == 1 and backup.continuations == 1
