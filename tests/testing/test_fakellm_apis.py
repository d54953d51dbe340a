"""The fake LLM backend's OpenAI Responses and Anthropic Messages APIs, with the official SDKs
as clients over a real socket on 127.0.0.1 (each SDK in a worker thread)."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from muxproxy.testing.fakellm import FakeLLM, reply_text, serve_fakellm


async def _start(nursery: trio.Nursery, **kwargs: Any) -> tuple[FakeLLM, int]:
    fake = FakeLLM(**kwargs)
    port = await nursery.start(serve_fakellm, fake)
    return fake, port


async def test_openai_responses_streamed_and_whole(nursery: trio.Nursery) -> None:
    with trio.fail_after(5):
        fake, port = await _start(nursery, tokens=4, delay=0.001)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=5)

        def use_sdk() -> tuple[list[Any], Any]:
            events = list(client.responses.create(model="m1", input="say hi there", stream=True))
            whole = client.responses.create(model="m1", input="say hi", max_output_tokens=3)
            return events, whole

        events, whole = await trio.to_thread.run_sync(use_sdk)
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == reply_text(4)
    done = events[-1].response
    assert done.output_text == reply_text(4)
    assert (done.usage.input_tokens, done.usage.output_tokens, done.usage.total_tokens) == (3, 4, 7)
    assert whole.status == "completed"
    assert whole.output_text == reply_text(3)
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (2, 3)
    assert fake.streams_started == 1
    assert fake.streams_completed == 1


async def test_anthropic_messages_streamed_and_whole(nursery: trio.Nursery) -> None:
    with trio.fail_after(5):
        fake, port = await _start(nursery, tokens=16, delay=0.001)
        client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="x", timeout=5)
        messages: Any = [{"role": "user", "content": "say hi there"}]

        def use_sdk() -> tuple[list[str], Any, Any]:
            whole = client.messages.create(model="m1", max_tokens=3, messages=messages)
            with client.messages.stream(
                model="m1", max_tokens=5, system="be brief", messages=messages
            ) as stream:
                pieces = list(stream.text_stream)
                final = stream.get_final_message()
            return pieces, final, whole

        pieces, final, whole = await trio.to_thread.run_sync(use_sdk)
    assert whole.content[0].text == reply_text(3)
    assert whole.stop_reason == "end_turn"
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (3, 3)
    assert pieces == [f"tok{i} " for i in range(5)]
    assert final.content[0].text == reply_text(5)
    assert final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (5, 5)
    assert fake.streams_completed == 1


async def test_anthropic_overloaded_before_first_token(nursery: trio.Nursery) -> None:
    with trio.fail_after(5):
        _, port = await _start(nursery, tokens=4, delay=0.001, die_after=0)
        client = anthropic.Anthropic(
            base_url=f"http://127.0.0.1:{port}", api_key="x", timeout=5, max_retries=0
        )

        def use_sdk() -> None:
            with client.messages.stream(
                model="m1", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            ) as stream:
                list(stream.text_stream)

        with pytest.raises(anthropic.APIStatusError) as raised:
            await trio.to_thread.run_sync(use_sdk)
    assert "overloaded_error" in str(raised.value)


async def test_responses_die_after_cuts_the_stream(nursery: trio.Nursery) -> None:
    with trio.fail_after(5):
        fake, port = await _start(nursery, tokens=4, delay=0.001, die_after=2)
        async with httpx.AsyncClient(timeout=5) as client:
            with pytest.raises(httpx.HTTPError):
                async with client.stream(
                    "POST",
                    f"http://127.0.0.1:{port}/v1/responses",
                    json={"model": "m1", "input": "hi", "stream": True},
                ) as response:
                    body = b""
                    async for data in response.aiter_bytes():
                        body += data
        await fake.wait_until(lambda: fake.aborts == 1)
    assert body.count(b"event: response.output_text.delta") == 2
    assert b"response.completed" not in body
    assert fake.streams_completed == 0
