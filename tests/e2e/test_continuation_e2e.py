"""End to end: a backend that dies mid-answer is replaced by the next, which finishes the answer.

Real sockets: fake LLM backends (the first dies after a few tokens, ``die_after``; a backup
continues the partial assistant message, ``continue_final_message``), the proxy, httpx. The
client must see one stream: the uninterrupted answer's text exactly, one role chunk, one
``id``, one ``[DONE]``.
"""

from __future__ import annotations

import json

import attrs
import httpx
import pytest
import trio

from muxproxy.config import NextUpstream, Route, Server, quick_config
from muxproxy.testing.fakellm import MODEL, reply_text

TOKENS = 24


def request(max_tokens: int = TOKENS) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long answer, please"}],
        "stream": True,
        "max_tokens": max_tokens,
    }


async def fleet(start_backend, start_proxy, dies: list[int | None], *, on: bool = True):  # type: ignore[no-untyped-def]
    """One primary and backups, the n-th dying after ``dies[n]`` tokens (None: never)."""
    fakes, servers = [], []
    for n, die_after in enumerate(dies):
        fake, port = await start_backend(
            backend_id=f"gpu{n}", delay=0.005, die_after=die_after, role_chunk=True
        )
        fakes.append(fake)
        servers.append(Server(address=f"127.0.0.1:{port}", backup=n > 0))
    config = quick_config("127.0.0.1:0", [s.address for s in servers])
    group = attrs.evolve(
        config.upstreams["default"], servers=tuple(servers), next_upstream=NextUpstream(tries=3)
    )
    route = Route(prefix="/", upstream="default", continue_on_failure=on)
    config = attrs.evolve(config, upstreams={"default": group}, routes=(route,))
    return fakes, await start_proxy(config=config)


def chunks_of(raw: str) -> tuple[list[dict[str, object]], int]:
    """The JSON chunks of an SSE body, and how many ``[DONE]`` it had."""
    chunks, done = [], 0
    for event in raw.split("\n\n"):
        for line in event.splitlines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks, done


async def answer(proxy, http2: bool):  # type: ignore[no-untyped-def]
    """Stream one chat completion through ``proxy``: its chunks, ``[DONE]`` count and text."""
    with trio.fail_after(20):
        async with (
            httpx.AsyncClient(http1=not http2, http2=http2) as client,
            client.stream("POST", proxy.url + "/v1/chat/completions", json=request()) as response,
        ):
            assert response.status_code == 200
            raw = "".join([text async for text in response.aiter_text()])
    chunks, done = chunks_of(raw)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)  # type: ignore[index]
    return chunks, done, text


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "h2c"])
@pytest.mark.parametrize("dies", [[5, None], [3, 9, None]], ids=["once", "twice"])
async def test_the_answer_is_finished_by_the_next_server_as_one_stream(
    start_backend, start_proxy, http2, dies
):
    fakes, proxy = await fleet(start_backend, start_proxy, dies)
    chunks, done, text = await answer(proxy, http2)
    assert text == reply_text(TOKENS)
    assert done == 1
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert {c["model"] for c in chunks} == {MODEL}
    roles = [c for c in chunks if "role" in c["choices"][0]["delta"]]  # type: ignore[index]
    assert len(roles) == 1 and chunks.index(roles[0]) == 0
    assert [f.aborts for f in fakes] == [1] * (len(dies) - 1) + [0]
    assert [f.continuations for f in fakes] == [0] + [1] * (len(dies) - 1)


async def test_without_continue_on_failure_the_truncation_stays_visible(start_backend, start_proxy):
    fakes, proxy = await fleet(start_backend, start_proxy, [5, None], on=False)
    raw = ""
    with trio.fail_after(20):
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream(
                    "POST", proxy.url + "/v1/chat/completions", json=request()
                ) as response:
                    async for text in response.aiter_text():
                        raw += text
    chunks, done = chunks_of(raw)
    assert done == 0 and len(chunks) < TOKENS
    assert fakes[1].requests == 0


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "h2c"])
async def test_an_answer_cut_after_its_last_token_is_ended_with_no_second_server(
    start_backend, start_proxy, http2
):
    # The first backend dies after its 24th and last token, before the finish chunk.
    fakes, proxy = await fleet(start_backend, start_proxy, [TOKENS, None])
    chunks, done, text = await answer(proxy, http2)
    assert text == reply_text(TOKENS)  # exactly max_tokens tokens, none asked of another server
    assert done == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert len({c["id"] for c in chunks}) == 1
    assert [f.aborts for f in fakes] == [1, 0]
    assert fakes[1].requests == 0
