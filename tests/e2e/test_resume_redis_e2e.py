"""End to end: a stream begun through one proxy is resumed through another, by Redis.

Two ``ProxyServer`` instances in one Trio run, each with its own core, as two replicas behind
a load balancer: they share nothing but a real ``redis-server`` (``tests/services.py``) named
by ``resume.store``. The fake LLM backend, the proxies and httpx talk over real sockets on
127.0.0.1. The first client reads some events through A and goes away; the reconnect through
B must get the rest of the same generation, every event exactly once, with no second
generation on the backend.
"""

from __future__ import annotations

import attrs
import coredis
import httpx
import pytest
import trio

from muxproxy.config import Resume, Route, quick_config
from muxproxy.testing.fakellm import reply_text
from muxproxy.trio.metrics import render
from muxproxy.trio.resumestore import meta_key
from tests.e2e.test_resume_e2e import REQUEST, TOKENS, content_of, ids_of, read_events, sse_events

SSE = {"Accept": "text/event-stream"}


async def two_replicas(
    start_backend, start_proxy, redis_server, *, delay=0.01, linger=30.0, store=None, models=()
):  # type: ignore[no-untyped-def]
    """``models``: the route serves these models only (routed by the body's model), beside
    a route for the rest."""
    fake, port = await start_backend(tokens=TOKENS, delay=delay)
    config = quick_config("127.0.0.1:0", [f"127.0.0.1:{port}"])
    resume = Resume(store=store or redis_server.url + "/0", linger=linger)
    route = Route(prefix="/", upstream="default", resume=resume, models=models)
    fallback = (Route(prefix="/", upstream="default"),) if models else ()
    config = attrs.evolve(config, routes=(route, *fallback))
    one = await start_proxy(config=config)
    two = await start_proxy(config=config)
    return fake, one, two


async def begin(url: str, count: int, headers: dict[str, str] | None = None) -> list[str]:
    """``count`` events of a new stream, then the connection is dropped."""
    async with (
        httpx.AsyncClient() as client,
        client.stream("POST", url, json=REQUEST, headers=headers) as response,
    ):
        assert response.status_code == 200
        return await read_events(response, limit=count)


async def resume(
    url: str, last: str, headers: dict[str, str] | None = None, *, h2c: bool = False
) -> httpx.Response:
    async with httpx.AsyncClient(http1=not h2c, http2=h2c) as client:
        sent = {"Last-Event-ID": last, **SSE, **(headers or {})}
        async with client.stream("GET", url, headers=sent) as response:
            await response.aread()
            return response


def events_of(response: httpx.Response) -> list[str]:
    text = response.text
    assert text.endswith("\n\n")
    return text[:-2].split("\n\n")


async def wait_state(url: str, token: str, state: bytes) -> None:
    """Until the stream's meta hash in Redis says ``state`` (the owner's append is async)."""
    async with coredis.Redis.from_url(url) as client:
        while await client.hget(meta_key(token.encode()), b"state") != state:
            await trio.sleep(0.01)


@pytest.mark.parametrize("then", ["http1", "h2c"])
async def test_a_stream_cut_on_one_replica_is_resumed_on_another(
    start_backend, start_proxy, redis_server, then
):
    fake, one, two = await two_replicas(start_backend, start_proxy, redis_server)
    path = "/v1/chat/completions"
    with trio.fail_after(20):
        before = await begin(one.url + path, 5)
        response = await resume(two.url + path, ids_of(before)[-1], h2c=then == "h2c")
    assert response.status_code == 200
    assert response.http_version == ("HTTP/2" if then == "h2c" else "HTTP/1.1")
    assert response.headers["content-type"].startswith("text/event-stream")
    after = events_of(response)
    events = before + after
    token = ids_of(before)[0].split(".")[0]
    assert ids_of(events) == [f"{token}.{n}" for n in range(1, len(events) + 1)]
    assert content_of(events) == reply_text(TOKENS)
    assert events[-1].startswith("data: [DONE]")
    assert fake.streams_started == 1  # one generation, never a second
    assert two.server.core.resumes.resumed == 1
    assert one.server.core.resumes.resumed == 0
    assert one.server.core.resumes.store_errors == two.server.core.resumes.store_errors == 0


async def test_a_stream_cut_on_one_replica_is_resumed_on_another_through_sentinel(
    start_backend, start_proxy, redis_server, redis_sentinel
):
    """``redis+sentinel://``: both replicas find the primary through the Sentinel, and the
    stream (read back from that primary, by its own URL) is there."""
    store = redis_sentinel.url
    assert store == f"redis+sentinel://127.0.0.1:{redis_sentinel.port}/mymaster"
    fake, one, two = await two_replicas(start_backend, start_proxy, redis_server, store=store)
    path = "/v1/chat/completions"
    with trio.fail_after(20):
        before = await begin(one.url + path, 5)
        response = await resume(two.url + path, ids_of(before)[-1])
        token = ids_of(before)[0].split(".")[0]
        await wait_state(redis_server.url, token, b"ended")
    assert response.status_code == 200
    after = events_of(response)
    events = before + after
    assert ids_of(events) == [f"{token}.{n}" for n in range(1, len(events) + 1)]
    assert content_of(events) == reply_text(TOKENS)
    assert events[-1].startswith("data: [DONE]")
    assert fake.streams_started == 1
    assert two.server.core.resumes.resumed == 1
    assert one.server.core.resumes.resumed == 0
    assert one.server.core.resumes.store_errors == two.server.core.resumes.store_errors == 0


async def test_a_reader_on_another_replica_keeps_the_backend_past_the_owners_linger(
    start_backend, start_proxy, redis_server
):
    # 40 tokens 50 ms apart: 2 s of generation, four times the owner's linger.
    fake, one, two = await two_replicas(
        start_backend, start_proxy, redis_server, delay=0.05, linger=0.5
    )
    path = "/v1/chat/completions"
    with trio.fail_after(20):
        before = await begin(one.url + path, 3)
        response = await resume(two.url + path, ids_of(before)[-1])
    events = before + events_of(response)
    assert content_of(events) == reply_text(TOKENS)
    assert events[-1].startswith("data: [DONE]")
    assert one.server.core.resumes.remote_reads >= 2  # its linger was put off, again and again
    assert fake.streams_started == fake.streams_completed == 1


async def test_an_ended_stream_is_resumed_on_another_replica(
    start_backend, start_proxy, redis_server
):
    fake, one, two = await two_replicas(start_backend, start_proxy, redis_server)
    path = "/v1/chat/completions"
    with trio.fail_after(20):
        before = await begin(one.url + path, 3)
        token = ids_of(before)[0].split(".")[0]
        await fake.wait_until(lambda: fake.streams_completed == 1)
        await wait_state(redis_server.url, token, b"ended")
        response = await resume(two.url + path, ids_of(before)[-1])
    events = before + events_of(response)
    assert ids_of(events) == [f"{token}.{n}" for n in range(1, len(events) + 1)]
    assert content_of(events) == reply_text(TOKENS)
    assert fake.streams_started == 1


async def test_other_credentials_on_another_replica_are_an_unknown_stream(
    start_backend, start_proxy, redis_server
):
    fake, one, two = await two_replicas(start_backend, start_proxy, redis_server)
    path = "/v1/chat/completions"
    with trio.fail_after(20):
        before = await begin(one.url + path, 3, {"Authorization": "Bearer alice"})
        stranger = await resume(two.url + path, ids_of(before)[-1], {"Authorization": "Bearer eve"})
        owner = await resume(two.url + path, ids_of(before)[-1], {"Authorization": "Bearer alice"})
    assert stranger.status_code == 200
    assert '"code": "resume_unknown"' in stranger.text
    assert "tell" not in stranger.text and "id:" not in stranger.text
    assert content_of(before + events_of(owner)) == reply_text(TOKENS)
    assert two.server.core.resumes.refused["unknown"] == 1
    assert fake.streams_started == 1


async def test_a_dead_redis_harms_no_stream_and_refuses_resumes_cleanly(
    start_backend, start_proxy, redis_server
):
    fake, one, two = await two_replicas(start_backend, start_proxy, redis_server, delay=0.02)
    url = one.url + "/v1/chat/completions"
    with trio.fail_after(20):
        async with (
            httpx.AsyncClient() as client,
            client.stream("POST", url, json=REQUEST) as response,
        ):
            events: list[str] = []
            async for event in sse_events(response):
                events.append(event)
                if len(events) == 3:
                    await redis_server.kill()  # mid-stream
        # The stream through A went on unharmed: every event, once, to its end.
        token = ids_of(events)[0].split(".")[0]
        assert ids_of(events) == [f"{token}.{n}" for n in range(1, len(events) + 1)]
        assert content_of(events) == reply_text(TOKENS)
        refused = await resume(two.url + "/v1/chat/completions", ids_of(events)[3])
        async with httpx.AsyncClient() as client:
            plain = await client.get(
                two.url + "/v1/chat/completions", headers={"Last-Event-ID": ids_of(events)[3]}
            )
    assert refused.status_code == 200
    assert '"code": "resume_unavailable"' in refused.text
    assert plain.status_code == 503
    assert one.server.core.resumes.store_errors >= 1  # A's appends after the kill
    assert two.server.core.resumes.store_errors >= 2  # B's two reads
    assert two.server.core.resumes.refused["unavailable"] == 2
    metrics = render([two.server.core.measurements.snapshot()]).decode()
    errors = two.server.core.resumes.store_errors
    assert f"muxproxy_resume_store_errors_total {errors}" in metrics
    assert 'muxproxy_resumes_total{result="unavailable"} 2' in metrics
    assert fake.streams_started == 1


async def test_resumes_through_redis_work_again_once_it_is_back(
    start_backend, start_proxy, redis_server
):
    fake, one, two = await two_replicas(start_backend, start_proxy, redis_server)
    path = "/v1/chat/completions"
    with trio.fail_after(20):
        await begin(one.url + path, 2)
        await redis_server.kill()
        await fake.wait_until(lambda: fake.streams_completed == 1)
        await redis_server.restart()  # empty: what was kept is gone
        before = await begin(one.url + path, 4)
        response = await resume(two.url + path, ids_of(before)[-1])
    assert content_of(before + events_of(response)) == reply_text(TOKENS)
    assert one.server.core.resumes.store_errors >= 1
    assert fake.streams_started == 2


def comparable(response: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    """A response's status, fields (but its date and request id) and body."""
    fields = [
        (name, value)
        for name, value in response.headers.multi_items()
        if name not in ("date", "x-request-id")
    ]
    return response.status_code, fields, response.content


@pytest.mark.parametrize(
    "credential",
    [{"X-Api-Key": "sk-alice"}, {"Api-Key": "azure-alice"}, {"Cookie": "session=alice"}],
)
async def test_a_stream_begun_with_a_key_is_unknown_to_a_resume_without_it_on_another_replica(
    start_backend, start_proxy, redis_server, credential
):
    fake, one, two = await two_replicas(start_backend, start_proxy, redis_server)
    path = "/v1/chat/completions"
    with trio.fail_after(20):
        before = await begin(one.url + path, 3, credential)
        last = ids_of(before)[-1]
        token = last.split(".")[0]
        unknown = await resume(two.url + path, "A" * 22 + ".3")
        nothing = await resume(two.url + path, last)
        other = await resume(two.url + path, last, {name: "eve" for name in credential})
        async with coredis.Redis.from_url(redis_server.url) as client:
            meta = await client.hgetall(meta_key(token.encode()))
        owner = await resume(two.url + path, last, credential)
    # No oracle: what a stranger gets is what a token that never existed gets.
    assert comparable(nothing) == comparable(other) == comparable(unknown)
    assert '"code": "resume_unknown"' in unknown.text
    assert content_of(before + events_of(owner)) == reply_text(TOKENS)
    assert two.server.core.resumes.refused["unknown"] == 3
    # Redis keeps a digest, never the credential.
    (secret,) = credential.values()
    assert len(meta[b"credential"]) == 32
    assert all(secret.encode() not in value for value in meta.values())
    assert fake.streams_started == 1


async def test_a_resume_of_a_finished_stream_on_another_replica_is_204(
    start_backend, start_proxy, redis_server
):
    fake, one, two = await two_replicas(start_backend, start_proxy, redis_server)
    path = "/v1/chat/completions"
    with trio.fail_after(20):
        events = await begin(one.url + path, 10_000)  # the whole stream
        token = ids_of(events)[0].split(".")[0]
        await wait_state(redis_server.url, token, b"ended")
        response = await resume(two.url + path, ids_of(events)[-1])
    assert events[-1].startswith("data: [DONE]")
    assert response.status_code == 204 and response.content == b""
    assert fake.streams_started == 1


async def test_a_post_routed_by_its_model_is_resumed_on_another_replica(
    start_backend, start_proxy, redis_server
):
    # Its route is known once its body named the model; the stream is then asked of the
    # store while the body is held, and the body goes to no backend.
    fake, one, two = await two_replicas(
        start_backend, start_proxy, redis_server, models=(REQUEST["model"],)
    )
    url = "/v1/chat/completions"
    with trio.fail_after(20):
        before = await begin(one.url + url, 5)
        async with httpx.AsyncClient() as client:
            sent = {"Last-Event-ID": ids_of(before)[-1], **SSE}
            async with client.stream("POST", two.url + url, json=REQUEST, headers=sent) as got:
                assert got.status_code == 200
                after = await read_events(got)
    assert content_of(before + after) == reply_text(TOKENS)
    assert fake.streams_started == 1  # resumed: no second generation
    assert two.server.core.resumes.resumed == 1
