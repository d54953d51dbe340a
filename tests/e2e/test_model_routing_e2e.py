"""Routing by model and a canary between model versions, with the ``openai`` SDK as the client
of a real ``python -m muxproxy serve`` process and fake LLM backends (``muxproxy fakellm``).

Three groups, one fake backend each: ``a`` serves ``llama-a``, ``v1`` serves ``llama-v1``,
``v2`` serves ``llama-v2``; the alias ``chat-default`` stands for v1 and v2, 9 to 1, sticky
by the ``X-Chat-ID`` header. What must hold: each model reaches its own group, and an
unknown one is the SDK's ``NotFoundError`` with ``model_not_found``; over 200 conversations
of two turns each, every conversation stays on one version and v2 gets near 10 % of them;
then the weights move to 0/100 through the admin API while a long stream runs on v1, which
is not cut, and every new conversation goes to v2. The backend names the model it was asked
for in each chunk's ``model`` (the fake echoes it) and itself in ``x-backend-id``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
import trio
from processes import proxy_process

if TYPE_CHECKING:
    from conftest import StartBackend

TOKEN = "models-token"
CONVERSATIONS = 200
LONG_TOKENS = 120
DELAY = 0.005
V2_SHARE = (0.04, 0.18)
"""Where v2's share of 200 conversations at weight 1 in 10 must lie: 10 % within about 3.5
standard deviations of a binomial draw."""


def config_text(ports: dict[str, int]) -> str:
    lines = [
        "[[listeners]]",
        'address = "127.0.0.1:0"',
        "[admin]",
        'address = "127.0.0.1:0"',
        f'token = "{TOKEN}"',
        "[log]",
        'access = "off"',
    ]
    for name, port in ports.items():
        lines += [
            f"[upstreams.{name}]",
            f'servers = ["127.0.0.1:{port}"]',
            f"[upstreams.{name}.sticky]",
            'sources = ["header:X-Chat-ID"]',
        ]
    for name in ports:
        lines += ["[[routes]]", 'prefix = "/v1/"', f'upstream = "{name}"']
        lines.append(f'models = ["llama-{name}"]')
    lines += [
        '[models."chat-default"]',
        'targets = [{ model = "llama-v1", weight = 9 }, { model = "llama-v2", weight = 1 }]',
        "",
    ]
    return "\n".join(lines)


def ask(client: openai.OpenAI, model: str, chat_id: str = "") -> tuple[str, str]:
    """One short chat completion: the model the backend was asked for, and the backend."""
    headers = {"X-Chat-ID": chat_id} if chat_id else {}
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        extra_headers=headers,
    )
    return raw.parse().model, raw.headers["x-backend-id"]


async def admin_call(admin: str, method: str, path: str, body: object = None) -> httpx.Response:
    async with httpx.AsyncClient(base_url=admin) as client:
        return await client.request(
            method, path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}
        )


async def test_models_route_to_their_groups_and_an_alias_canary_moves_without_a_cut(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend
) -> None:
    ports = {}
    for name in ("a", "v1", "v2"):
        _, ports[name] = await start_backend(backend_id=name, tokens=1, delay=DELAY)
    path = tmp_path / "muxproxy.toml"
    path.write_text(config_text(ports))
    with trio.fail_after(18):
        async with proxy_process(nursery, config=path, admin=True) as proxy:
            line = await proxy.stdout.wait_for(lambda text: text.startswith("muxproxy admin on "))
            admin = line.rsplit(" ", 1)[1]
            base = f"http://127.0.0.1:{proxy.ports()[0]}/v1"
            client = openai.OpenAI(base_url=base, api_key="x", timeout=10, max_retries=0)

            # Each model to its own group; a model no route serves is the API's 404.
            for model, backend in (("llama-a", "a"), ("llama-v2", "v2"), ("llama-v1", "v1")):
                assert await trio.to_thread.run_sync(ask, client, model) == (model, backend)

            def unknown() -> openai.NotFoundError:
                try:
                    ask(client, "gpt-4o")
                except openai.NotFoundError as exc:
                    return exc
                raise AssertionError("a model no route serves was answered")

            error = await trio.to_thread.run_sync(unknown)
            assert error.code == "model_not_found" and "gpt-4o" in error.message

            # The canary at 9 to 1: two turns per conversation, on one version each.
            versions: dict[str, list[tuple[str, str]]] = {}
            limiter = trio.CapacityLimiter(8)

            async def conversation(chat_id: str) -> None:
                for _ in range(2):
                    turn = await trio.to_thread.run_sync(
                        ask, client, "chat-default", chat_id, limiter=limiter
                    )
                    versions.setdefault(chat_id, []).append(turn)

            async with trio.open_nursery() as talks:
                for number in range(CONVERSATIONS):
                    talks.start_soon(conversation, f"chat-{number}")
            for turns in versions.values():
                assert len(set(turns)) == 1, turns  # one version, on its own group
                ((model, backend),) = set(turns)
                assert backend == model.removeprefix("llama-")
            share = sum(turns[0][0] == "llama-v2" for turns in versions.values()) / CONVERSATIONS
            assert V2_SHARE[0] <= share <= V2_SHARE[1], share

            # A long stream on v1 while the weights move to 0/100: it ends whole.
            on_v1 = next(chat for chat, turns in versions.items() if turns[0][0] == "llama-v1")

            def long_stream(started: trio.Event) -> tuple[int, str | None, set[str]]:
                stream = client.chat.completions.create(
                    model="chat-default",
                    messages=[{"role": "user", "content": "tell me a long story"}],
                    max_tokens=LONG_TOKENS,
                    stream=True,
                    extra_headers={"X-Chat-ID": on_v1},
                )
                pieces, finish, models = 0, None, set()
                for chunk in stream:
                    models.add(chunk.model)
                    if chunk.choices and chunk.choices[0].delta.content:
                        pieces += 1
                        if pieces == 1:
                            trio.from_thread.run_sync(started.set)
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                return pieces, finish, models

            result: list[tuple[int, str | None, set[str]]] = []

            async def run_long(started: trio.Event) -> None:
                result.append(await trio.to_thread.run_sync(long_stream, started))

            started = trio.Event()
            async with trio.open_nursery() as streaming:
                streaming.start_soon(run_long, started)
                await started.wait()
                weights = {"weights": {"llama-v1": 0, "llama-v2": 100}}
                moved = await admin_call(admin, "PATCH", "/models/chat-default", weights)
                assert moved.status_code == 200, moved.text
                assert not result  # the stream still runs
            assert result == [(LONG_TOKENS, "stop", {"llama-v1"})]

            for number in range(20):
                turn = await trio.to_thread.run_sync(ask, client, "chat-default", f"new-{number}")
                assert turn == ("llama-v2", "v2")
            status = (await admin_call(admin, "GET", "/status")).json()
            assert status["models"]["chat-default"]["targets"] == [
                {"model": "llama-v1", "configured_weight": 9, "runtime_weight": 0, "weight": 0},
                {"model": "llama-v2", "configured_weight": 1, "runtime_weight": 100, "weight": 100},
            ]
            refused = await admin_call(
                admin, "PATCH", "/models/chat-default", {"weights": {"llama-v2": 0}}
            )
            assert refused.status_code == 400 and "would be 0" in refused.text
