"""End to end: routing across a fleet of real fake backends, through a real proxy.

Real sockets on 127.0.0.1, Hypercorn-served ``FakeLLM`` backends that can be killed (their
``serve_fakellm`` runs in a cancel scope of its own: Hypercorn then closes its listener and
every connection, so new connects are refused) and restarted on the same port, real clients
(httpx for HTTP/1.1 and h2c, the raw peers of :mod:`tests.e2e.peers` where a test needs to see
a reset or a missing last chunk).

What is checked, from the outside:

* failover: a backend killed under load costs only the streams it was already sending
  (truncated, visibly), every other request is retried elsewhere and completes;
* sticky keys: weighted rendezvous hashing moves only a dead server's keys; once it is back
  (passive health's ``fail_timeout``) the moved conversations stay where they went (the
  affinity memory) and new keys go to it again; two proxies built from one configuration
  route every key alike;
* the sticky cookie pins a client, also to a server drained at runtime (weight 0), which new
  sessions avoid;
* ``retry_until_first_event``: a backend dying between its SSE head and its first event is
  retried, the client sees one clean stream (HTTP/1.1 and HTTP/2);
* ``set_headers`` templates reach the backend;
* a group without a usable server answers 503 at once (HTTP/1.1 and HTTP/2).

Nothing waits on elapsed time: every wait is on a condition (a counter, a log record, the
proxy's own passive-health deadline), under ``trio.fail_after``.
"""

from __future__ import annotations

import json
import posixpath
import urllib.parse
from collections.abc import Callable
from typing import Any

import attrs
import h2.errors
import h11
import httpx
import pytest
import trio
from peers import H1Peer, H1Response, H2Peer, open_h2, serve_raw, sse_events

from muxproxy.config import (
    Config,
    HeaderRule,
    Listener,
    NextUpstream,
    Route,
    Server,
    SessionSource,
    Sticky,
    StickyCookie,
    Upstream,
)
from muxproxy.config.runtime import RuntimeState
from muxproxy.core.commands import Log
from muxproxy.routing.balancer import rendezvous_order
from muxproxy.routing.router import GroupRouter
from muxproxy.testing.fakellm import FakeLLM, reply_text, serve_fakellm

GROUP = "llm"
CHAT = "/v1/chat/completions"
JSON = (b"content-type", b"application/json")


# -- helpers --------------------------------------------------------------------------------


@attrs.define
class Backend:
    """A ``FakeLLM`` served in its own cancel scope, so that a test can kill it."""

    fake: FakeLLM
    port: int
    scope: trio.CancelScope
    stopped: trio.Event

    @property
    def id(self) -> str:
        return self.fake.backend_id

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def kill(self) -> None:
        """Stop serving: returns once the listener and every connection are closed."""
        self.scope.cancel()
        await self.stopped.wait()


async def start_killable(nursery: trio.Nursery, *, port: int = 0, **options: Any) -> Backend:
    """Serve ``FakeLLM(**options)`` on ``port`` (0: any; or a dead backend's, to restart it)."""
    fake = FakeLLM(**options)
    scope = trio.CancelScope()
    stopped = trio.Event()

    async def serve(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with scope:
                await serve_fakellm(fake, port=port, task_status=task_status)
        finally:
            stopped.set()

    bound: int = await nursery.start(serve)
    return Backend(fake=fake, port=bound, scope=scope, stopped=stopped)


def make_config(
    backends: list[Backend],
    *,
    servers: dict[str, Any] | None = None,
    sticky: Sticky | None = None,
    next_upstream: NextUpstream | None = None,
    set_headers: tuple[HeaderRule, ...] = (),
    retry_until_first_event: bool = False,
) -> Config:
    """One listener on port 0, one group ``llm`` of ``backends`` (in order), one route ``/``."""
    group = Upstream(
        name=GROUP,
        servers=tuple(Server(address=b.address, **(servers or {})) for b in backends),
        sticky=sticky or Sticky(),
        next_upstream=next_upstream or NextUpstream(),
        set_headers=set_headers,
    )
    return Config(
        listeners=(Listener(address="127.0.0.1:0"),),
        upstreams={GROUP: group},
        routes=(
            Route(prefix="/", upstream=GROUP, retry_until_first_event=retry_until_first_event),
        ),
    )


def group_router(proxy: Any) -> GroupRouter:
    core = proxy.server.core
    router: GroupRouter = core.router(core.config.upstreams[GROUP])
    return router


def chat_body(*, stream: bool) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    ).encode()


def sse_text(body: bytes) -> tuple[str, bool]:
    """The concatenated content deltas of an SSE body, and whether ``[DONE]`` closed it."""
    events = sse_events(body)
    text = "".join(
        e["choices"][0]["delta"].get("content", "")
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )
    return text, bool(events) and events[-1] == "[DONE]"


class Waiter:
    """Something to wait on: ``changed()`` after every update, ``wait_until(predicate)``."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def changed(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._event.wait()


class LogCapture(Waiter):
    """The proxy's ``Log`` commands, through ``Driver.on_log``."""

    def __init__(self, proxy: Any) -> None:
        super().__init__()
        self.records: list[Log] = []
        proxy.server.driver.on_log = self._on_log

    def _on_log(self, record: Log) -> None:
        self.records.append(record)
        self.changed()

    @property
    def access(self) -> list[dict[str, Any]]:
        return [r.fields for r in self.records if r.event == "access"]

    async def wait_access(self, n: int = 1) -> list[dict[str, Any]]:
        await self.wait_until(lambda: len(self.access) >= n)
        return self.access


async def backend_of(
    client: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None
) -> str:
    """GET /health through the proxy; the ``x-backend-id`` that answered it."""
    response = await client.get(url + "/health", headers=headers)
    assert response.status_code == 200, response.text
    backend = response.headers["x-backend-id"]
    return backend


async def h1_exchange(port: int, body: bytes) -> H1Response:
    """POST ``body`` to the chat path on a fresh HTTP/1.1 connection, the whole request in
    one write (so an early answer cannot race the body); read the response to its end."""
    peer = await H1Peer.connect(port)
    try:
        headers = [(b"host", b"proxy"), JSON, (b"content-length", b"%d" % len(body))]
        await peer.send(
            h11.Request(method="POST", target=CHAT, headers=headers),
            h11.Data(data=body),
            h11.EndOfMessage(),
        )
        return await peer.read_response()
    finally:
        await peer.aclose()


async def h2_request(peer: H2Peer, body: bytes) -> int:
    """POST ``body`` to the chat path on a new stream, HEADERS and DATA in one write."""
    sid = await peer.request("POST", CHAT, [JSON], body, flush=False)
    await peer.flush()
    return sid


# -- 1. a backend killed under load ---------------------------------------------------------


@attrs.define(eq=False)
class Outcome:
    backend: str | None = None
    status: int | None = None
    text: str = ""
    done: bool = False
    truncated: bool = False
    error: str | None = None
    after_kill: bool = False
    """The request was sent after the killed backend had stopped."""


async def test_backend_killed_under_load_costs_only_its_running_streams(nursery, start_proxy):
    tokens = 5
    backends = [
        await start_killable(nursery, backend_id=f"b{i}", tokens=tokens, delay=0.01)
        for i in range(3)
    ]
    victim = backends[2]
    config = make_config(
        backends, next_upstream=NextUpstream(on=frozenset({"error", "timeout"}), tries=3)
    )
    proxy = await start_proxy(config=config)
    logs = LogCapture(proxy)

    total, concurrency, kill_after = 200, 50, 50
    outcomes: list[Outcome] = []
    streaming_on = {b.id: 0 for b in backends}
    """Streams whose first chunk the client has, and whose end it has not."""
    progress = Waiter()
    killed = trio.Event()
    limiter = trio.CapacityLimiter(concurrency)
    body = chat_body(stream=True)

    async def one(client: httpx.AsyncClient) -> None:
        async with limiter:
            outcome = Outcome(after_kill=killed.is_set())
            outcomes.append(outcome)
            streaming = False
            data = b""
            try:
                async with client.stream(
                    "POST",
                    proxy.url + CHAT,
                    content=body,
                    headers={"content-type": "application/json"},
                ) as response:
                    outcome.status = response.status_code
                    outcome.backend = response.headers.get("x-backend-id")
                    try:
                        async for chunk in response.aiter_bytes():
                            data += chunk
                            if not streaming and outcome.backend in streaming_on:
                                streaming = True
                                streaming_on[outcome.backend] += 1
                                progress.changed()
                    except httpx.TransportError as exc:
                        outcome.truncated = True
                        outcome.error = repr(exc)
            except httpx.TransportError as exc:  # no response head at all
                outcome.error = repr(exc)
            finally:
                if streaming:
                    streaming_on[outcome.backend] -= 1  # type: ignore[index]
                outcome.text, outcome.done = sse_text(data) if data else ("", False)
                progress.changed()

    async def killer() -> None:
        # Kill once enough requests completed *and* a stream on the victim is under way,
        # so the kill surely cuts at least one running stream.
        await progress.wait_until(
            lambda: sum(o.done for o in outcomes) >= kill_after and streaming_on[victim.id] > 0
        )
        await victim.kill()
        killed.set()

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with trio.fail_after(30):
        async with (
            httpx.AsyncClient(limits=limits, timeout=20) as client,
            trio.open_nursery() as requests,
        ):
            requests.start_soon(killer)
            for _ in range(total):
                requests.start_soon(one, client)
        await logs.wait_access(total)

    assert killed.is_set()
    assert len(outcomes) == total
    complete = [o for o in outcomes if o.status == 200 and o.done and not o.truncated]
    truncated = [o for o in outcomes if o.truncated]
    other = [o for o in outcomes if o not in complete and o not in truncated]
    assert other == [], f"requests neither complete nor truncated: {other[:5]}"
    # Every complete reply is whole: all tokens, in order, then [DONE].
    assert all(o.text == reply_text(tokens) for o in complete)
    # Only streams the victim was already sending were cut, and at least one was.
    assert truncated, "the kill cut no stream (the test did not exercise truncation)"
    assert {o.backend for o in truncated} == {victim.id}
    # (A cut stream may hold every event, [DONE] included, and still lack its last chunk:
    # the proxy cannot know the backend would have ended it cleanly, so it must not.)
    assert all(o.status == 200 for o in truncated)
    # Requests sent after the kill all went elsewhere and completed.
    late = [o for o in outcomes if o.after_kill]
    assert late, "no request was sent after the kill"
    assert all(o in complete and o.backend != victim.id for o in late)
    # The survivors' streams were untouched: each started stream completed, none was cut.
    for backend in backends[:2]:
        fake = backend.fake
        served = sum(o.backend == backend.id for o in complete)
        assert fake.streams_started == fake.streams_completed == served
        assert fake.disconnects == 0 and fake.aborts == 0
    # The proxy's own account agrees: the cut streams are logged as such, on the victim.
    access = logs.access
    assert len(access) == total, "an exchange was logged more than once"
    cut = [a for a in access if a["outcome"].startswith("upstream failed mid-stream")]
    assert len(cut) == len(truncated)
    assert {a["server"] for a in cut} == {victim.address}
    assert all(a["status"] == 200 and a["tries"] <= 3 for a in access)
    # New requests that found the victim dead were retried elsewhere (nothing had gone out).
    assert any(a["tries"] >= 2 for a in access)


# -- 2. sticky keys move with a dead server; moved conversations stay, new keys come back ----


async def test_sticky_keys_move_off_a_dead_server_and_new_ones_come_back(nursery, start_proxy):
    backends = [await start_killable(nursery, backend_id=f"b{i}") for i in range(3)]
    fail_timeout = 0.5
    config = make_config(
        backends,
        servers={"max_fails": 1, "fail_timeout": fail_timeout},
        sticky=Sticky(sources=(SessionSource(kind="header", name="x-chat-id"),)),
        next_upstream=NextUpstream(on=frozenset({"error", "timeout"}), tries=3),
    )
    proxy = await start_proxy(config=config)
    router = group_router(proxy)
    keys = [f"chat-{i}" for i in range(30)]

    def owner_order(key: str) -> list[str]:
        order = rendezvous_order(key.encode(), router.ids, router.weights, range(3))
        return [backends[i].id for i in order]

    async def route_all(client: httpx.AsyncClient, which: list[str]) -> dict[str, str]:
        return {k: await backend_of(client, proxy.url, {"x-chat-id": k}) for k in which}

    victim = backends[1]
    # Keys never sent before whose rendezvous owner is the victim: each asks afresh.
    unseen = (k for k in (f"new-{i}" for i in range(100_000)) if owner_order(k)[0] == victim.id)
    with trio.fail_after(15):
        async with httpx.AsyncClient(timeout=10) as client:
            before = await route_all(client, keys)
            # Each key is on its rendezvous owner; a same key asked again stays put.
            assert before == {k: owner_order(k)[0] for k in keys}
            assert await route_all(client, keys) == before
            assert len(set(before.values())) == 3, f"keys not spread: {before}"
            on_victim = [k for k in keys if before[k] == victim.id]
            elsewhere = [k for k in keys if before[k] != victim.id]

            await victim.kill()
            during = await route_all(client, keys)
            # Only the dead server's keys moved, each to its next rendezvous choice.
            assert {k: during[k] for k in elsewhere} == {k: before[k] for k in elsewhere}
            assert {k: during[k] for k in on_victim} == {k: owner_order(k)[1] for k in on_victim}

            # The same server, back on the same port (a new process, as far as anyone knows).
            restarted = await start_killable(nursery, port=victim.port, backend_id="b1-again")
            index = backends.index(victim)
            while await backend_of(client, proxy.url, {"x-chat-id": next(unseen)}) != "b1-again":
                # Passive health keeps it out until its fail_timeout has passed: wait for the
                # proxy's own deadline (re-armed whenever a request found the server dead).
                until = router.passive.out_until(index)
                assert until is not None
                await trio.sleep_until(max(until, trio.current_time() + 0.01))
            after = await route_all(client, keys)
            fresh = [next(unseen) for _ in range(5)]
            fresh_after = await route_all(client, fresh)
    # Conversations that moved went on where they moved to (their KV cache is there now:
    # sticky.session_idle remembers them); the others never moved; new keys use the server.
    assert after == during
    assert fresh_after == dict.fromkeys(fresh, "b1-again")
    assert restarted.fake.requests >= len(fresh)


# -- 3. two proxies, one configuration, one answer per key ----------------------------------


async def test_two_proxies_from_one_config_route_keys_alike(nursery, start_proxy):
    backends = [await start_killable(nursery, backend_id=f"b{i}") for i in range(3)]
    config = make_config(
        backends, sticky=Sticky(sources=(SessionSource(kind="header", name="x-chat-id"),))
    )
    first = await start_proxy(config=config)
    second = await start_proxy(config=config)
    assert first.port != second.port
    keys = [f"user-{i}" for i in range(50)]
    with trio.fail_after(15):
        async with httpx.AsyncClient(timeout=10) as client:
            one = {k: await backend_of(client, first.url, {"x-chat-id": k}) for k in keys}
            # The second proxy in reverse order: its balancer state cannot matter either.
            two = {k: await backend_of(client, second.url, {"x-chat-id": k}) for k in keys[::-1]}
    assert one == two
    assert len(set(one.values())) == 3, f"keys not spread: {one}"


# -- 4. the sticky cookie -------------------------------------------------------------------


async def test_sticky_cookie_pins_also_to_a_drained_server(nursery, start_proxy):
    backends = [await start_killable(nursery, backend_id=f"b{i}") for i in range(3)]
    cookie = StickyCookie(name="mux_srv", secret="s3cret")
    proxy = await start_proxy(config=make_config(backends, sticky=Sticky(cookie=cookie)))
    router = group_router(proxy)

    async def get(client: httpx.AsyncClient, pin: str | None) -> httpx.Response:
        client.cookies.clear()  # only the cookie this test names is sent
        headers = {"cookie": f"mux_srv={pin}"} if pin is not None else {}
        response = await client.get(proxy.url + "/health", headers=headers)
        assert response.status_code == 200
        return response

    def set_cookie_value(response: httpx.Response) -> str:
        (header,) = response.headers.get_list("set-cookie")
        attributes = [part.strip() for part in header.split(";")]
        name, _, value = attributes[0].partition("=")
        assert name == "mux_srv"
        assert set(attributes[1:]) == {"Path=/", "HttpOnly", "SameSite=Lax"}
        return value

    with trio.fail_after(15):
        async with httpx.AsyncClient(timeout=10) as client:
            first = await get(client, None)
            pin = set_cookie_value(first)
            pinned_backend = first.headers["x-backend-id"]
            index = router.by_id[pin.encode()]
            assert backends[index].id == pinned_backend
            # Replaying the cookie pins the backend (round-robin would rotate), and a client
            # already pinned there gets no new cookie.
            for _ in range(6):
                again = await get(client, pin)
                assert again.headers["x-backend-id"] == pinned_backend
                assert "set-cookie" not in again.headers

            drain = RuntimeState.empty().changed(GROUP, backends[index].address, weight=0)
            proxy.server.apply_runtime(drain)  # drain it at runtime
            for _ in range(3):
                again = await get(client, pin)
                assert again.headers["x-backend-id"] == pinned_backend
                assert "set-cookie" not in again.headers
            fresh = [await get(client, None) for _ in range(8)]
            # New sessions avoid it, spread over the others, each pinned to where it went.
            assert {r.headers["x-backend-id"] for r in fresh} == {
                b.id for b in backends if b.id != pinned_backend
            }
            for response in fresh:
                value = set_cookie_value(response)
                assert backends[router.by_id[value.encode()]].id == response.headers["x-backend-id"]
            # A cookie naming no server of the group is a new session: re-pinned elsewhere.
            stale = await get(client, "0123456789abcdef")
            assert stale.headers["x-backend-id"] != pinned_backend
            assert set_cookie_value(stale) != pin


# -- 5. retry_until_first_event -------------------------------------------------------------


@pytest.mark.parametrize("role_chunk", [False, True], ids=["no-event", "role-only-chunk"])
@pytest.mark.parametrize("hold", [True, False], ids=["hold", "no-hold"])
@pytest.mark.parametrize("protocol", ["h1", "h2"])
async def test_death_before_the_first_event_is_retried_when_held(
    nursery, start_proxy, protocol, hold, role_chunk
):
    tokens = 5
    # ``die_after=0``: the SSE head goes out (with ``role_chunk``, then a role-only chunk, as
    # vLLM and OpenAI begin), then the backend aborts before any content event.
    dying = await start_killable(
        nursery, backend_id="dying", tokens=tokens, die_after=0, role_chunk=role_chunk
    )
    healthy = await start_killable(nursery, backend_id="healthy", tokens=tokens, delay=0.005)
    # The dying one is first: round-robin on a fresh proxy picks index 0 first.
    config = make_config([dying, healthy], retry_until_first_event=hold)
    proxy = await start_proxy(config=config)
    logs = LogCapture(proxy)
    body = chat_body(stream=True)

    with trio.fail_after(10):
        if protocol == "h1":
            response = await h1_exchange(proxy.port, body)
            status, backend = response.status, response.header("x-backend-id")
            data, clean = response.body, response.complete
        else:
            async with open_h2(proxy.port) as h2peer:
                stream = await h2peer.wait_done(await h2_request(h2peer, body))
            status, backend = stream.status, stream.header("x-backend-id")
            data, clean = stream.body, stream.ended and stream.reset is None
            if not hold:
                assert stream.reset == h2.errors.ErrorCodes.INTERNAL_ERROR
        (access,) = await logs.wait_access(1)

    assert dying.fake.streams_started == 1 and dying.fake.aborts == 1
    assert status == 200
    if hold:
        # One clean, complete stream, all of it from the healthy backend.
        assert backend == "healthy"
        assert clean
        assert sse_text(data) == (reply_text(tokens), True)
        assert access["tries"] == 2
        assert access["server"] == healthy.address
        assert access["outcome"] == "ok"
    else:
        # The control: without holding, the head went out and the death shows as truncation.
        assert backend == "dying"
        assert not clean
        assert len(sse_events(data)) == role_chunk
        assert access["tries"] == 1
        assert access["outcome"].startswith("upstream failed mid-stream")
        assert healthy.fake.requests == 0


# -- 6. set_headers -------------------------------------------------------------------------


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
async def test_configured_request_headers_reach_the_backend(nursery, start_proxy, http2):
    backend = await start_killable(nursery, backend_id="b0")
    config = make_config(
        [backend],
        sticky=Sticky(sources=(SessionSource(kind="cookie", name="chat_session"),)),
        set_headers=(
            HeaderRule(name="x-chat-id", value="$session_key"),
            HeaderRule(name="x-user-id", value="$arg_user"),
        ),
    )
    proxy = await start_proxy(config=config)

    async def seen(client: httpx.AsyncClient, query: str, headers: dict[str, str]) -> Any:
        response = await client.post(
            proxy.url + CHAT + query,
            content=chat_body(stream=False),
            headers={"content-type": "application/json", "x-fake-echo-headers": "1", **headers},
        )
        assert response.status_code == 200, response.text
        assert response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
        return response.json()["request_headers"]

    with trio.fail_after(10):
        async with httpx.AsyncClient(http1=not http2, http2=http2, timeout=10) as client:
            # The client's own values for the configured headers are replaced, not added to.
            spoof = {"x-chat-id": "forged", "x-user-id": "mallory"}
            got = await seen(client, "?user=alice", {"cookie": "chat_session=abc", **spoof})
            # Without the query argument the rule expands to nothing: the header is removed.
            bare = await seen(client, "", {"cookie": "chat_session=xyz", **spoof})
    assert got["x-chat-id"] == "abc"
    assert got["x-user-id"] == "alice"
    assert bare["x-chat-id"] == "xyz"
    assert "x-user-id" not in bare


# -- 7. no usable server --------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["h1", "h2"])
async def test_group_without_usable_server_answers_503_at_once(nursery, start_proxy, protocol):
    backends = [await start_killable(nursery, backend_id=f"b{i}") for i in range(2)]
    # Every server drained (weight 0) and a sticky cookie configured, but none sent.
    config = make_config(
        backends, servers={"weight": 0}, sticky=Sticky(cookie=StickyCookie(name="mux_srv"))
    )
    proxy = await start_proxy(config=config)
    logs = LogCapture(proxy)
    body = chat_body(stream=True)

    with trio.fail_after(5):
        if protocol == "h1":
            response = await h1_exchange(proxy.port, body)
            status, data, clean = response.status, response.body, response.complete
            content_type = response.header("content-type")
        else:
            async with open_h2(proxy.port) as h2peer:
                stream = await h2peer.wait_done(await h2_request(h2peer, body))
                # The connection stays usable for other streams.
                assert not h2peer.closed and h2peer.terminated is None
            status, data = stream.status, stream.body
            clean = stream.ended and stream.reset is None
            content_type = stream.header("content-type")
        (access,) = await logs.wait_access(1)

    assert status == 503
    assert clean
    # A chat path: OpenAI's error object, with the reason (``core/exchange/refusal.py``).
    error = {"message": "no backend available", "type": "server_error", "param": None}
    assert json.loads(data) == {"error": {**error, "code": "no_server"}}
    assert content_type == "application/json"
    # At once: no backend was tried, none even connected to.
    assert access["tries"] == 0 and access["server"] is None
    assert all(b.fake.requests == 0 for b in backends)


# -- paths: routes match (and backends get) the normalised path --------------------------------


@attrs.define
class PathBackend:
    """A backend that resolves what it is given, as many do: it percent-decodes the path and
    resolves its dot-segments, and serves ``/flag`` (the secret) for whatever lands there."""

    targets: list[bytes] = attrs.field(factory=list)

    async def serve(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                elif type(event) is h11.Request:
                    self.targets.append(bytes(event.target))
                elif type(event) is h11.EndOfMessage:
                    target = self.targets[-1].partition(b"?")[0]
                    resolved = posixpath.normpath(urllib.parse.unquote(target.decode()))
                    body = b"the flag" if resolved == "/flag" else b"ok"
                    head = h11.Response(
                        status_code=200, headers=[("content-length", str(len(body)))]
                    )
                    await stream.send_all(
                        conn.send(head)
                        + conn.send(h11.Data(data=body))
                        + conn.send(h11.EndOfMessage())
                    )
                    conn.start_next_cycle()
                else:
                    return


def v1_only_config(port: int) -> Config:
    group = Upstream(name=GROUP, servers=(Server(address=f"127.0.0.1:{port}"),))
    return Config(
        listeners=(Listener(address="127.0.0.1:0"),),
        upstreams={GROUP: group},
        routes=(Route(prefix="/v1/", upstream=GROUP),),
    )


ESCAPES = [
    (b"/v1/../flag", 404),
    (b"/v1/%2e%2e/flag", 404),
    (b"/v1/%2E%2e/flag?x=1", 404),
    (b"/v1/..%2fflag", 400),
    (b"/v1/..%2Fflag", 400),
    (b"/v1/..%5cflag", 400),
    (b"/v1/x/../../flag", 404),
    (b"/v1/x%2f..%2f..%2fflag", 400),
]


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
async def test_paths_escaping_the_route_never_reach_the_backend(nursery, start_proxy, http2):
    backend = PathBackend()
    port = await serve_raw(nursery, backend.serve)
    proxy = await start_proxy(config=v1_only_config(port))
    with trio.fail_after(10):
        for target, status in ESCAPES:
            if http2:
                async with open_h2(proxy.port) as peer:
                    sid = await peer.request("GET", target.decode())
                    stream = await peer.wait_done(sid)
                got, body = stream.status, stream.body
            else:
                peer = await H1Peer.connect(proxy.port)
                async with peer.stream:
                    await peer.send_request("GET", target.decode())
                    response = await peer.read_response()
                got, body = response.status, response.body
            assert got == status, target
            assert b"flag" not in body, target
    assert backend.targets == [], "a path outside /v1/ reached the backend"


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
async def test_backend_gets_the_normalised_path(nursery, start_proxy, http2):
    backend = PathBackend()
    port = await serve_raw(nursery, backend.serve)
    proxy = await start_proxy(config=v1_only_config(port))
    sent = [
        b"/v1/./models",
        b"/v1/a/../models?next=/../x",
        b"/%76%31/models",
        b"/v1/a%20b",
        b"/v1/models/org%2Fmodel",
    ]
    with trio.fail_after(10):
        for target in sent:
            if http2:
                async with open_h2(proxy.port) as peer:
                    stream = await peer.wait_done(await peer.request("GET", target.decode()))
                assert stream.status == 200 and stream.body == b"ok", target
            else:
                peer = await H1Peer.connect(proxy.port)
                async with peer.stream:
                    await peer.send_request("GET", target.decode())
                    response = await peer.read_response()
                assert response.status == 200 and response.body == b"ok", target
    assert backend.targets == [
        b"/v1/models",
        b"/v1/models?next=/../x",
        b"/v1/models",
        b"/v1/a%20b",
        b"/v1/models/org%2Fmodel",
    ]
