"""A gray release under load: conversations stream while traffic moves from model v1 to v2.

One group of four fake GPU backends, two serving "v1" and two "v2" (each names its model version
in ``x-model-version`` and itself in ``x-backend-id``), behind a real ``python -m muxproxy
serve`` process with its admin API. Multi-turn conversations stream through it, half sticky by
the proxy's sticky cookie (HTTP/1.1), half by their ``X-Chat-ID`` header (HTTP/2, cookies
dropped so only the key counts), while the weights move v1 -> v2 in steps of 25 % through
``PATCH /upstreams/gpus/servers/...``; then one v1 backend is drained and removed by a reload
(``POST /reload``) while long streams on it are in flight.

What must hold: no request fails and every stream is complete (all its tokens, then
``[DONE]``); every conversation stays on the server where it began while that server is
configured (also while it drains, and across every weight change); a stream in flight on the
removed server finishes there; new conversations land on v2 by weight (none at 0 %, all at
100 %, the shares between within a bound).

The conversations of the first step wait for the drain before their second turn and for the
reload before their third, so both happen with conversations mid-way on the v1 servers; the
rest run their turns back to back, across the weight changes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import httpx
import pytest
import trio
from processes import proxy_process

if TYPE_CHECKING:
    from conftest import StartBackend

    from muxproxy.testing.fakellm import FakeLLM

TOKEN = "gray-release-token"
STEPS = 5
"""Weights (v1, v2) per step: (4, 0), (3, 1), (2, 2), (1, 3), (0, 4): v2's share 0 to 100 %."""
CONVERSATIONS_PER_STEP = 60
"""New conversations begun in each step: half by cookie, half by header; 300 in all."""
TURNS = 3
TOKENS = 6
LONG_TOKENS = 40
"""Tokens of the long second turns in flight on the drained server during the reload."""
DELAY = 0.01
SHARE_BOUND = 0.2
"""How far the share of new conversations on v2 may be from the weights' share: 60 draws of
a rendezvous hash and of the round-robin are not exact (3 standard deviations at 50 %)."""
FIGURES: dict[str, object] = {}


@attrs.define
class Turn:
    backend: str | None = None
    version: str | None = None
    status: int | None = None
    tokens: int = 0
    done: bool = False
    error: str | None = None
    after_reload: bool = False


@attrs.define
class Conversation:
    ident: int
    step: int
    by_cookie: bool
    turns: list[Turn] = attrs.Factory(list)
    long: bool = False
    """Its second turn is long, and still streaming while the reload happens."""

    @property
    def first(self) -> str | None:
        return self.turns[0].backend if self.turns else None


@attrs.define
class Gates:
    drained: trio.Event = attrs.Factory(trio.Event)
    reloaded: trio.Event = attrs.Factory(trio.Event)
    long_started: int = 0
    changed: trio.Event = attrs.Factory(trio.Event)

    def long_started_one(self) -> None:
        self.long_started += 1
        self.notify()

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self.changed.wait()


def config_text(ports: dict[str, int], *, with_v1a: bool = True) -> str:
    servers = [
        f'  {{ address = "127.0.0.1:{port}", weight = {4 if name.startswith("v1") else 0} }},'
        for name, port in ports.items()
        if with_v1a or name != "v1a"
    ]
    return "\n".join(
        [
            "[[listeners]]",
            'address = "127.0.0.1:0"',
            "[admin]",
            'address = "127.0.0.1:0"',
            f'token = "{TOKEN}"',
            "[log]",
            'access = "off"',
            "[upstreams.gpus]",
            "servers = [",
            *servers,
            "]",
            "[upstreams.gpus.sticky]",
            'sources = ["header:X-Chat-ID"]',
            "[upstreams.gpus.sticky.cookie]",
            'name = "mux_srv"',
            "[[routes]]",
            'prefix = "/"',
            'upstream = "gpus"',
            "",
        ]
    )


def chat(tokens: int) -> dict[str, object]:
    return {
        "model": "m",
        "stream": True,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": "hi"}],
    }


async def stream_turn(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    tokens: int,
    *,
    on_first_token: Callable[[], None] | None = None,
) -> Turn:
    turn = Turn()
    try:
        async with client.stream("POST", url, json=chat(tokens), headers=headers) as response:
            turn.status = response.status_code
            turn.backend = response.headers.get("x-backend-id")
            turn.version = response.headers.get("x-model-version")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    turn.done = True
                    continue
                delta = json.loads(data)["choices"][0]["delta"]
                if delta.get("content"):
                    turn.tokens += 1
                    if turn.tokens == 1 and on_first_token is not None:
                        on_first_token()
    except httpx.HTTPError as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
    return turn


@asynccontextmanager
async def conversation_client(by_cookie: bool) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(http1=by_cookie, http2=not by_cookie, timeout=30) as client:
        yield client


async def converse(
    conversation: Conversation, url: str, gates: Gates, first_head: trio.Event
) -> None:
    headers = {} if conversation.by_cookie else {"X-Chat-ID": f"chat-{conversation.ident}"}
    async with conversation_client(conversation.by_cookie) as client:
        for number in range(TURNS):
            if conversation.step == 0 and number == 1:
                await gates.drained.wait()
            if conversation.step == 0 and number == 2:
                await gates.reloaded.wait()
            long = conversation.long and number == 1
            tokens = LONG_TOKENS if long else TOKENS
            after_reload = gates.reloaded.is_set()
            turn = await stream_turn(
                client,
                url,
                headers,
                tokens,
                on_first_token=gates.long_started_one if long else None,
            )
            turn.after_reload = after_reload
            if turn.done and turn.tokens != tokens:
                turn.error = f"{turn.tokens} of {tokens} tokens"
            conversation.turns.append(turn)
            if number == 0:
                first_head.set()
            if not conversation.by_cookie:
                client.cookies.clear()  # only the X-Chat-ID key routes this one


async def admin_call(admin: str, method: str, path: str, body: object = None) -> httpx.Response:
    async with httpx.AsyncClient(base_url=admin) as client:
        response = await client.request(
            method, path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}
        )
    assert response.status_code == 200, (method, path, response.text)
    return response


def v2_share(conversations: list[Conversation], step: int) -> float:
    mine = [c for c in conversations if c.step == step]
    return sum(c.turns[0].version == "v2" for c in mine) / len(mine)


def every_turn(conversations: list[Conversation]) -> Iterator[tuple[Conversation, Turn]]:
    for conversation in conversations:
        for turn in conversation.turns:
            yield conversation, turn


@pytest.fixture(scope="module", autouse=True)
def report_figures() -> Iterator[None]:
    yield
    if FIGURES:
        print("\ngray release:", json.dumps(FIGURES, indent=1))


async def test_gray_release_moves_traffic_without_a_failed_or_moved_conversation(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend
) -> None:
    fakes: dict[str, FakeLLM] = {}
    ports: dict[str, int] = {}
    for name in ("v1a", "v1b", "v2a", "v2b"):
        fakes[name], ports[name] = await start_backend(
            backend_id=name, model_version=name[:2], tokens=TOKENS, delay=DELAY
        )
    address = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    path = tmp_path / "muxproxy.toml"
    path.write_text(config_text(ports))
    gates = Gates()
    conversations: list[Conversation] = []
    with trio.fail_after(120):
        async with proxy_process(nursery, config=path) as proxy:
            line = await proxy.stdout.wait_for(lambda text: text.startswith("muxproxy admin on "))
            admin = line.rsplit(" ", 1)[1]
            url = f"http://127.0.0.1:{proxy.ports()[0]}/v1/chat/completions"
            async with trio.open_nursery() as running:
                for step in range(STEPS):
                    for name in ("v1a", "v1b"):
                        body = {"weight": 4 - step}
                        await admin_call(
                            admin, "PATCH", f"/upstreams/gpus/servers/{address[name]}", body
                        )
                    for name in ("v2a", "v2b"):
                        body = {"weight": step}
                        await admin_call(
                            admin, "PATCH", f"/upstreams/gpus/servers/{address[name]}", body
                        )
                    heads = []
                    for index in range(CONVERSATIONS_PER_STEP):
                        conversation = Conversation(
                            ident=step * CONVERSATIONS_PER_STEP + index,
                            step=step,
                            by_cookie=index % 2 == 0,
                        )
                        conversations.append(conversation)
                        head = trio.Event()
                        heads.append(head)
                        running.start_soon(converse, conversation, url, gates, head)
                    # The next weights apply once this step's conversations have begun.
                    for head in heads:
                        await head.wait()
                # Long second turns on v1a: in flight through the reload that removes it.
                on_v1a = [c for c in conversations if c.step == 0 and c.first == "v1a"]
                assert on_v1a, "no first-step conversation began on v1a"
                for conversation in on_v1a[::2]:
                    conversation.long = True
                await admin_call(
                    admin, "PATCH", f"/upstreams/gpus/servers/{address['v1a']}", {"drain": True}
                )
                gates.drained.set()
                longs = sum(c.long for c in conversations)
                await gates.wait_until(lambda: gates.long_started >= longs)
                path.write_text(config_text(ports, with_v1a=False))
                reloaded = (await admin_call(admin, "POST", "/reload")).json()
                assert reloaded["ok"] is True, reloaded
                gates.reloaded.set()
            status = (await admin_call(admin, "GET", "/status")).json()

    # No request failed; every stream is complete.
    turns = list(every_turn(conversations))
    failed = [(c.ident, t) for c, t in turns if t.status != 200 or not t.done or t.error]
    assert not failed, failed[:5]
    # Each conversation stays where it began while that server is configured; those of the
    # removed v1a move after the reload, to v2 (v1's weights are 0 by then).
    moved = []
    for conversation in conversations:
        for number, turn in enumerate(conversation.turns):
            if conversation.first == "v1a" and turn.after_reload:
                assert turn.version == "v2", (conversation, number)
            elif turn.backend != conversation.first:
                moved.append((conversation.ident, number, conversation.first, turn.backend))
    assert not moved, moved[:5]
    # The long streams on v1a were in flight through the reload and finished there.
    longs = [c.turns[1] for c in conversations if c.long]
    assert longs and all(t.backend == "v1a" and t.tokens == LONG_TOKENS for t in longs)
    # New conversations follow the weights.
    shares = [v2_share(conversations, step) for step in range(STEPS)]
    assert shares[0] == 0.0 and shares[-1] == 1.0, shares
    for step, share in enumerate(shares):
        assert abs(share - step / (STEPS - 1)) <= SHARE_BOUND, shares
    # The reload removed v1a; the servers that stayed kept their runtime weights.
    servers = {s["address"]: s for s in status["groups"]["gpus"]["servers"]}
    assert address["v1a"] not in servers
    assert servers[address["v1b"]]["weight"] == 0
    assert servers[address["v2a"]]["weight"] == servers[address["v2b"]]["weight"] == 4
    assert all(s["active"] == 0 for s in servers.values())

    FIGURES.update(
        conversations=len(conversations),
        streams=len(turns),
        failed=len(failed),
        moved_while_up=len(moved),
        moved_after_removal=sum(1 for c, t in turns if c.first == "v1a" and t.after_reload),
        long_streams_through_reload=len(longs),
        v2_share_by_step=[round(share, 2) for share in shares],
        streams_per_backend={name: fake.streams_completed for name, fake in fakes.items()},
    )
