"""Tests of the fake LLM backend's answer and its continuation (``continue_final_message``).

Through the fake's real HTTP server on 127.0.0.1 (raw h11 for streams, so an abort shows as
an incomplete body; httpx for whole bodies), plus the pure parse of a partial answer. The
check is always the one a resuming client needs: the partial answer spliced with the
continuation is exactly the uninterrupted answer.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from test_fakellm import h11_exchange, parse_sse

from muxproxy.testing.fakellm import reply_text, tokens_text
from muxproxy.testing.fakellm.answer import (
    BOTH_OPTIONS,
    NOT_ASSISTANT,
    BadContinuation,
    answered_tokens,
)

if TYPE_CHECKING:
    from conftest import StartBackend

CHAT = "/v1/chat/completions"
N = 8
"""Tokens of the uninterrupted answer in these tests."""
QUESTION = {"role": "user", "content": "count for me"}


def request(stream: bool, partial: object = None, *, usage: bool = False, **extra: Any) -> bytes:
    """A chat request; ``partial`` (a content) makes it a continuation of that message."""
    body: dict[str, Any] = {"model": "m1", "messages": [QUESTION], "stream": stream}
    if usage:
        body["stream_options"] = {"include_usage": True}
    if partial is not None:
        body["messages"] = [QUESTION, {"role": "assistant", "content": partial}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    return json.dumps({**body, **extra}).encode()


def content_deltas(events: list[Any]) -> list[str]:
    """The non-empty content deltas of a stream's chunks, in order (one per token)."""
    return [
        e["choices"][0]["delta"]["content"]
        for e in events
        if isinstance(e, dict) and e["choices"] and e["choices"][0]["delta"].get("content")
    ]


async def stream(port: int, body: bytes, headers: list[tuple[str, str]]) -> tuple[list[Any], bool]:
    """One streamed completion: its SSE events and whether the body ended cleanly."""
    result = await h11_exchange(port, CHAT, headers, body)
    assert result.response.status_code == 200
    return parse_sse(result.body), result.complete


async def whole(port: int, body: bytes, headers: list[tuple[str, str]]) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        response = await client.post(CHAT, content=body, headers=headers)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


# ---- the answer, pure --------------------------------------------------------------------


@given(k=st.integers(0, 300))
def test_a_prefix_of_k_tokens_reads_as_k_tokens(k: int) -> None:
    assert answered_tokens(reply_text(k)) == k
    assert reply_text(k) + tokens_text(k, k + 5) == reply_text(k + 5)


@given(text=st.text(alphabet="tok0123 ", max_size=30))
def test_only_a_token_aligned_prefix_of_the_answer_is_accepted(text: str) -> None:
    try:
        done = answered_tokens(text)
    except BadContinuation as exc:
        assert exc.param == "messages"
        assert not any(text == reply_text(k) for k in range(len(text) + 1))
    else:
        assert text == reply_text(done)


# ---- continuing over HTTP ----------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 4, N - 1, N])
async def test_a_streamed_continuation_is_exactly_the_rest_of_the_answer(
    start_backend: StartBackend, k: int
) -> None:
    fake, port = await start_backend(tokens=3, delay=0)
    headers = [("x-fake-tokens", str(N))]
    with trio.fail_after(10):
        first, first_done = await stream(port, request(True, usage=True), headers)
        answer = content_deltas(first)
        prefix = "".join(answer[:k])
        rest, rest_done = await stream(port, request(True, prefix, usage=True), headers)
    assert first_done and rest_done
    assert len(answer) == N
    assert prefix + "".join(content_deltas(rest)) == "".join(answer) == reply_text(N)
    assert len(content_deltas(rest)) == N - k  # one chunk per remaining token
    # A stream like any other: role on the first chunk, the finish chunk, usage, [DONE].
    chunks = rest[:-1]
    assert rest[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (N - k) + ["stop"]
    assert chunks[-1]["choices"] == []
    used, first_used = chunks[-1]["usage"], first[-2]["usage"]
    assert used["completion_tokens"] == N - k
    assert used["prompt_tokens"] == first_used["prompt_tokens"] + k  # the message is prompt now
    assert used["total_tokens"] == first_used["total_tokens"]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} != {first[0]["id"]}
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "m1" for c in chunks)
    assert (fake.continuations, fake.streams_completed, fake.aborts) == (1, 2, 0)


@pytest.mark.parametrize("k", [0, 1, 4, N - 1, N])
async def test_a_whole_continuation_is_exactly_the_rest_of_the_answer(
    start_backend: StartBackend, k: int
) -> None:
    fake, port = await start_backend(tokens=N, delay=0)  # the default length, no header
    with trio.fail_after(10):
        first = await whole(port, request(False), [])
        answer = first["choices"][0]["message"]["content"]
        prefix = "".join(f"{word} " for word in answer.split()[:k])
        rest = await whole(port, request(False, prefix), [])
    assert answer == reply_text(N)
    message = rest["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert prefix + message["content"] == answer
    assert rest["choices"][0]["finish_reason"] == "stop"
    assert rest["usage"]["completion_tokens"] == N - k
    assert rest["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"] + k
    assert rest["id"] != first["id"] and rest["object"] == "chat.completion"
    assert fake.continuations == 1


async def test_a_continuation_with_a_role_chunk_and_text_parts(
    start_backend: StartBackend,
) -> None:
    _, port = await start_backend(tokens=4, delay=0, role_chunk=True)
    parts = [{"type": "text", "text": "tok0 tok1"}, {"type": "text", "text": " "}]
    with trio.fail_after(5):
        events, done = await stream(port, request(True, parts), [])
    assert done
    assert [e["choices"][0]["delta"] for e in events[:-1]] == [
        {"role": "assistant", "content": ""},
        {"content": "tok2 "},
        {"content": "tok3 "},
        {},
    ]


async def test_max_tokens_counts_only_the_new_tokens_as_vllm_does(
    start_backend: StartBackend,
) -> None:
    _, port = await start_backend(tokens=99, delay=0)
    with trio.fail_after(5):
        first = await whole(port, request(False, max_tokens=6), [])
        answer = first["choices"][0]["message"]["content"]
        prefix = reply_text(2)
        lowered = await whole(port, request(False, prefix, max_tokens=4), [])
        kept = await whole(port, request(False, prefix, max_completion_tokens=6), [])
        # The header is the whole answer's length, and wins over max_tokens.
        header = await whole(port, request(False, prefix, max_tokens=6), [("x-fake-tokens", "6")])
    assert answer == reply_text(6)
    assert prefix + lowered["choices"][0]["message"]["content"] == answer
    assert kept["choices"][0]["message"]["content"] == tokens_text(2, 8)  # 2 too many
    assert prefix + header["choices"][0]["message"]["content"] == answer


async def test_a_continuation_under_the_step_model(start_backend: StartBackend) -> None:
    fake, port = await start_backend(tokens=N, delay=0.001, prefill_chunk=64, max_running=2)
    with trio.fail_after(10):
        rest, done = await stream(port, request(True, reply_text(3)), [])
        nothing_left, empty_done = await stream(port, request(True, reply_text(N)), [])
    assert done and empty_done
    assert reply_text(3) + "".join(content_deltas(rest)) == reply_text(N)
    assert content_deltas(nothing_left) == []
    assert nothing_left[-2]["choices"][0]["finish_reason"] == "stop"
    assert (fake.running, fake.continuations) == (0, 2)


# ---- refusals ----------------------------------------------------------------------------


async def test_what_cannot_be_continued_answers_400(start_backend: StartBackend) -> None:
    fake, port = await start_backend(backend_id="g", tokens=N, delay=0)
    user_last = json.loads(request(True, reply_text(1)))
    user_last["messages"] = [QUESTION]
    nothing = {**user_last, "messages": []}
    both = {**user_last, "messages": [QUESTION, {"role": "assistant", "content": ""}]}
    both["add_generation_prompt"] = True
    cases: list[tuple[bytes, list[tuple[str, str]], str, str]] = [
        (request(True, "tok0 tok2 "), [], "messages", "first 1 tokens it has 'tok2 '"),
        (request(False, "tok0 to"), [], "messages", "'to' where 'tok1 ' was expected"),
        (request(True, "tok0 tok1"), [], "messages", "'tok1' where 'tok1 ' was expected"),
        (request(True, "hello "), [], "messages", "not a token-aligned prefix"),
        (request(True, reply_text(4)), [("x-fake-tokens", "3")], "messages", "more than the 3"),
        (json.dumps(user_last).encode(), [], "messages", NOT_ASSISTANT),
        (json.dumps(nothing).encode(), [], "messages", NOT_ASSISTANT),
        (json.dumps(both).encode(), [], "add_generation_prompt", BOTH_OPTIONS),
        (
            request(True, "", continue_final_message="yes"),
            [],
            "continue_final_message",
            "must be a boolean",
        ),
    ]
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for body, headers, param, words in cases:
                response = await client.post(CHAT, content=body, headers=headers)
                assert response.status_code == 400, body
                assert response.headers["x-backend-id"] == "g"
                error = response.json()["error"]
                assert error["type"] == "invalid_request_error"
                assert (error["code"], error["param"]) == (400, param)
                assert words in error["message"], error["message"]
            # As in vLLM, add_generation_prompt left out is not true.
            left_out = json.loads(request(False, reply_text(N - 1)))
            del left_out["add_generation_prompt"]
            accepted = await client.post(CHAT, json=left_out)
    assert accepted.json()["choices"][0]["message"]["content"] == tokens_text(N - 1, N)
    assert (fake.continuations, fake.streams_started) == (1, 0)


# ---- die-after ---------------------------------------------------------------------------


async def test_a_continuation_may_die_again_and_be_continued_to_the_end(
    start_backend: StartBackend,
) -> None:
    fake, port = await start_backend(tokens=N, delay=0, die_after=3)
    with trio.fail_after(10):
        whole_events, whole_done = await stream(port, request(True), [("x-fake-die-after", "none")])
        spliced = ""
        rounds: list[tuple[int, bool]] = []
        events, done = await stream(port, request(True), [])
        while True:
            spliced += "".join(content_deltas(events))
            rounds.append((len(content_deltas(events)), done))
            if done:
                break
            assert len(rounds) <= N
            events, done = await stream(port, request(True, spliced), [])
    assert whole_done
    # die-after counts each response's own tokens: 3, 3 more, then the last 2 and the end.
    assert rounds == [(3, False), (3, False), (2, True)]
    assert spliced == "".join(content_deltas(whole_events)) == reply_text(N)
    assert (fake.aborts, fake.continuations, fake.streams_completed) == (2, 2, 2)


async def test_a_whole_continuation_dies_with_half_its_body(start_backend: StartBackend) -> None:
    fake, port = await start_backend(tokens=N, delay=0)
    body = request(False, reply_text(5))
    with trio.fail_after(5):
        died = await h11_exchange(port, CHAT, [("x-fake-die-after", "1")], body)
        # die-after 4 is beyond the continuation's own 3 tokens: no abort.
        kept = await h11_exchange(port, CHAT, [("x-fake-die-after", "4")], body)
    assert died.response.status_code == 200 and not died.complete
    assert kept.complete
    assert json.loads(kept.body)["choices"][0]["message"]["content"] == tokens_text(5, N)
    assert (fake.aborts, fake.continuations) == (1, 2)
