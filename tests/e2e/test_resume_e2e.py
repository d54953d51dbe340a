"""End to end: a chat stream cut mid-answer is resumed with ``Last-Event-ID`` (``route.resume``).

Real sockets on 127.0.0.1: the fake LLM backend, the proxy, httpx over HTTP/1.1 and h2c, and
the OpenAI Python SDK. The first client reads some events and goes away; the second (over
either protocol) resumes with the id of the last event it had and must get the rest of the
same generation, every event exactly once, with no second generation on the backend.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import attrs
import httpx
import openai
import pytest
import trio

from muxproxy.config import Resume, Route, quick_config
from muxproxy.testing.fakellm import MODEL, reply_text

TOKENS = 40
ID = re.compile(r"^id: (\S+)$", re.M)
REQUEST = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "tell me a long story"}],
    "stream": True,
    "max_tokens": TOKENS,
}


def content_of(events: list[str]) -> str:
    text = ""
    for event in events:
        for line in event.splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[len("data: ") :])["choices"]:
                    text += choice.get("delta", {}).get("content") or ""
    return text


def ids_of(events: list[str]) -> list[str]:
    return [match for event in events for match in ID.findall(event)]


async def sse_events(response: httpx.Response) -> AsyncIterator[str]:
    """The complete SSE events of ``response``, as they arrive."""
    buffer = ""
    async for chunk in response.aiter_text():
        buffer += chunk
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            yield event
    assert buffer == ""


async def read_events(response: httpx.Response, limit: int | None = None) -> list[str]:
    """Complete SSE events of ``response``, at most ``limit`` (then stop reading)."""
    events: list[str] = []
    async for event in sse_events(response):
        events.append(event)
        if limit is not None and len(events) >= limit:
            break
    return events


async def resumable_proxy(start_backend, start_proxy, **resume):  # type: ignore[no-untyped-def]
    fake, port = await start_backend(tokens=TOKENS, delay=0.01)
    config = quick_config("127.0.0.1:0", [f"127.0.0.1:{port}"])
    route = Route(prefix="/", upstream="default", resume=Resume(**resume))
    proxy = await start_proxy(config=attrs.evolve(config, routes=(route,)))
    return fake, proxy


@pytest.mark.parametrize("first", ["http1", "h2c"])
@pytest.mark.parametrize("then", ["http1", "h2c"])
async def test_a_cut_stream_is_resumed_with_every_event_once(
    start_backend, start_proxy, first, then
):
    fake, proxy = await resumable_proxy(start_backend, start_proxy)
    url = proxy.url + "/v1/chat/completions"
    with trio.fail_after(20):
        # Leaving the block drops the connection (HTTP/1.1) or resets the stream (h2).
        async with (
            httpx.AsyncClient(http1=first == "http1", http2=first == "h2c") as one,
            one.stream("POST", url, json=REQUEST) as response,
        ):
            assert response.status_code == 200
            token = response.headers["x-resume-token"]
            before = await read_events(response, limit=5)
        last = ids_of(before)[-1]
        assert last == f"{token}.5"
        async with httpx.AsyncClient(http1=then == "http1", http2=then == "h2c") as two:
            headers = {"Last-Event-ID": last, "Accept": "text/event-stream"}
            async with two.stream("GET", url, headers=headers) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                after = await read_events(response)
    events = before + after
    assert ids_of(events) == [f"{token}.{n}" for n in range(1, len(events) + 1)]
    assert content_of(events) == reply_text(TOKENS)
    assert events[-1].startswith("data: [DONE]")
    assert fake.streams_started == 1  # one generation, never a second
    assert fake.streams_completed == 1


async def test_the_same_post_resent_with_last_event_id_resumes(start_backend, start_proxy):
    fake, proxy = await resumable_proxy(start_backend, start_proxy)
    url = proxy.url + "/v1/chat/completions"
    with trio.fail_after(20):
        async with httpx.AsyncClient() as client:
            async with client.stream("POST", url, json=REQUEST) as response:
                before = await read_events(response, limit=3)
            headers = {"Last-Event-ID": ids_of(before)[-1], "Accept": "text/event-stream"}
            async with client.stream("POST", url, json=REQUEST, headers=headers) as response:
                after = await read_events(response)
    assert content_of(before + after) == reply_text(TOKENS)
    assert fake.streams_started == 1


async def test_the_openai_sdk_resumes_by_counting_chunks(start_backend, start_proxy):
    """The SDK yields one chunk per event: ``<x-resume-token>.<chunks read>`` is the id."""
    fake, proxy = await resumable_proxy(start_backend, start_proxy)
    sdk = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=10)
    text = ""
    with trio.fail_after(20):
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=REQUEST["messages"], stream=True, max_tokens=TOKENS
        )
        token = stream.response.headers["x-resume-token"]
        read = 0
        async for chunk in stream:
            read += 1
            text += "".join(c.delta.content or "" for c in chunk.choices)
            if read == 7:
                break
        await stream.close()
        rest = await sdk.chat.completions.create(
            model=MODEL,
            messages=REQUEST["messages"],
            stream=True,
            max_tokens=TOKENS,
            extra_headers={"Last-Event-ID": f"{token}.{read}", "Accept": "text/event-stream"},
        )
        async for chunk in rest:
            text += "".join(c.delta.content or "" for c in chunk.choices)
    await sdk.close()
    assert text == reply_text(TOKENS)
    assert fake.streams_started == 1


async def test_an_unknown_id_gets_an_error_event_and_no_generation(start_backend, start_proxy):
    fake, proxy = await resumable_proxy(start_backend, start_proxy)
    url = proxy.url + "/v1/chat/completions"
    with trio.fail_after(10):
        async with httpx.AsyncClient() as client:
            headers = {"Last-Event-ID": "A" * 22 + ".4", "Accept": "text/event-stream"}
            async with client.stream("GET", url, headers=headers) as response:
                assert response.status_code == 200
                events = await read_events(response)
            gone = await client.post(url, json=REQUEST, headers={"Last-Event-ID": "A" * 22 + ".4"})
    (event,) = events
    assert event.startswith("event: error\ndata: ")
    assert json.loads(event.split("data: ", 1)[1])["error"]["code"] == "resume_unknown"
    assert gone.status_code == 410
    assert fake.requests == 0  # never a silent new generation


async def test_a_client_that_never_returns_stops_the_generation_after_linger(
    start_backend, start_proxy
):
    fake, port = await start_backend(tokens=10_000, delay=0.01)
    config = quick_config("127.0.0.1:0", [f"127.0.0.1:{port}"])
    route = Route(prefix="/", upstream="default", resume=Resume(linger=0.5))
    proxy = await start_proxy(config=attrs.evolve(config, routes=(route,)))
    with trio.fail_after(20):
        async with httpx.AsyncClient() as client:
            request = {**REQUEST, "max_tokens": 10_000}
            async with client.stream("POST", proxy.url + "/v1/chat/completions", json=request) as r:
                await read_events(r, limit=2)
        started = trio.current_time()
        await fake.wait_until(lambda: fake.disconnects >= 1)
    # Cut once ``linger`` passed, not at once and not after 10,000 tokens (100 s).
    assert 0.4 <= trio.current_time() - started < 10
    assert fake.streams_completed == 0


async def test_linger_runs_on_the_proxy_clock_a_mock_clock_jumps_through_it(
    start_backend, start_proxy, autojump_clock
):
    """The default ``linger`` (30 s) on Trio's ``MockClock``: the generation of a client that
    never returns is cut once the proxy's clock passed it, not before, and without the test
    waiting 30 real seconds."""
    fake, port = await start_backend(tokens=100_000, delay=0.05)
    config = quick_config("127.0.0.1:0", [f"127.0.0.1:{port}"])
    route = Route(prefix="/", upstream="default", resume=Resume())
    proxy = await start_proxy(config=attrs.evolve(config, routes=(route,)))
    with trio.fail_after(120):
        async with httpx.AsyncClient() as client:
            request = {**REQUEST, "max_tokens": 100_000}
            async with client.stream("POST", proxy.url + "/v1/chat/completions", json=request) as r:
                await read_events(r, limit=2)
        left = trio.current_time()
        await fake.wait_until(lambda: fake.disconnects >= 1)
    assert Resume().linger <= trio.current_time() - left < Resume().linger + 5
    assert fake.streams_completed == 0


async def test_a_resume_of_a_finished_stream_read_whole_is_204(start_backend, start_proxy):
    """An EventSource reconnects after every end; a 204 is what makes it stop."""
    fake, proxy = await resumable_proxy(start_backend, start_proxy)
    url = proxy.url + "/v1/chat/completions"
    with trio.fail_after(20):
        async with (
            httpx.AsyncClient() as client,
            client.stream("POST", url, json=REQUEST) as response,
        ):
            events = await read_events(response)
        sent = {"Last-Event-ID": ids_of(events)[-1], "Accept": "text/event-stream"}
        async with httpx.AsyncClient() as client:
            again = await client.get(url, headers=sent)
            before_last = await client.get(
                url, headers={**sent, "Last-Event-ID": ids_of(events)[-2]}
            )
    assert events[-1].startswith("data: [DONE]")
    assert again.status_code == 204 and again.content == b""
    assert before_last.status_code == 200 and before_last.text.startswith("data: [DONE]")
    assert fake.streams_started == 1


async def test_a_post_routed_by_its_model_resent_with_last_event_id_resumes(
    start_backend, start_proxy
):
    # The route is chosen by the body's model (read before routing, ``bymodel.py``): the
    # resume is found once the model chose it, and the body is not sent anywhere.
    fake, port = await start_backend(tokens=TOKENS, delay=0.01)
    config = quick_config("127.0.0.1:0", [f"127.0.0.1:{port}"])
    by_model = Route(prefix="/", upstream="default", models=(MODEL,), resume=Resume())
    fallback = Route(prefix="/", upstream="default")
    proxy = await start_proxy(config=attrs.evolve(config, routes=(by_model, fallback)))
    url = proxy.url + "/v1/chat/completions"
    with trio.fail_after(20):
        async with httpx.AsyncClient() as client:
            async with client.stream("POST", url, json=REQUEST) as response:
                before = await read_events(response, limit=3)
            headers = {"Last-Event-ID": ids_of(before)[-1], "Accept": "text/event-stream"}
            async with client.stream("POST", url, json=REQUEST, headers=headers) as response:
                assert response.status_code == 200
                after = await read_events(response)
    events = before + after
    assert content_of(events) == reply_text(TOKENS)
    assert ids_of(events)[len(before)] == ids_of(before)[-1].rsplit(".", 1)[0] + ".4"
    assert fake.streams_started == 1  # resumed: no second generation
