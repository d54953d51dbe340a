"""Continuation of an Anthropic Messages answer by an assistant prefill (``core/streams/
prefill.py``): the answer followed, the continuation request, the splice and the ending, with
the events the fake LLM server's Messages wire makes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from muxproxy.core.streams.prefill import MessagesSoFar, wants_prefill
from muxproxy.testing.fakellm.anthropic_messages import MessagesWire

USER = {"role": "user", "content": "hi"}
DOCUMENT: dict[str, Any] = {"model": "m", "max_tokens": 10, "stream": True, "messages": [USER]}


def sse(event: tuple[str, dict[str, Any]]) -> bytes:
    name, data = event
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(data).encode() + b"\n\n"


def events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                out.append(json.loads(line[6:]))
    return out


def opening(ident: str, tokens: int) -> tuple[MessagesWire, bytes]:
    wire = MessagesWire.of(DOCUMENT, "m", ident, 0, tokens)
    return wire, b"".join(sse(e) for e in wire.start())


def test_a_cut_open_block_goes_on_and_the_usage_is_totalled() -> None:
    _, start = opening("one", 10)
    wire = MessagesWire.of(DOCUMENT, "m", "one", 0, 10)
    answer = MessagesSoFar(DOCUMENT)
    sent = start + b"".join(sse(e) for i in range(3) for e in wire.delta(f"tok{i} "))
    for i in range(len(sent)):  # byte by byte
        answer.feed(sent[i : i + 1])
    assert answer.continuable and not answer.exhausted
    body = json.loads(answer.continuation_body())
    assert body["messages"] == [USER, {"role": "assistant", "content": "tok0 tok1 tok2 "}]
    assert body["max_tokens"] == 7
    # The next server's stream: its own message, block 0, seven tokens.
    other, other_start = opening("two", 7)
    rest = other_start + b"".join(sse(e) for i in range(3, 10) for e in other.delta(f"tok{i} "))
    rest += b"".join(sse(e) for e in other.end("x"))
    splicer = answer.splicer()
    out = splicer.feed(rest[:50]) + splicer.feed(rest[50:]) + splicer.flush()
    spliced = events(out)
    kinds = [e["type"] for e in spliced]
    assert "message_start" not in kinds and "content_block_start" not in kinds
    assert {e["index"] for e in spliced if "index" in e} == {0}
    assert "".join(e["delta"]["text"] for e in spliced if e["type"] == "content_block_delta") == (
        "".join(f"tok{i} " for i in range(3, 10))
    )
    (delta,) = [e for e in spliced if e["type"] == "message_delta"]
    assert delta["usage"]["output_tokens"] == 7 + 3


def test_a_cut_between_blocks_starts_the_next_index() -> None:
    wire, start = opening("one", 10)
    answer = MessagesSoFar(DOCUMENT)
    answer.feed(start + sse(wire.delta("tok0 ")[0]))
    answer.feed(sse(("content_block_stop", {"type": "content_block_stop", "index": 0})))
    assert answer.continuable
    other, other_start = opening("two", 9)
    spliced = events(answer.splicer().feed(other_start + sse(other.delta("tok1 ")[0])))
    assert [(e["type"], e.get("index")) for e in spliced] == [
        ("content_block_start", 1),
        ("ping", None),
        ("content_block_delta", 1),
    ]


def test_an_existing_prefill_is_extended() -> None:
    document = {**DOCUMENT, "messages": [USER, {"role": "assistant", "content": "Sure: "}]}
    assert wants_prefill(b"/v1/messages", document)
    wire, start = opening("one", 10)
    answer = MessagesSoFar(document)
    answer.feed(start + sse(wire.delta("tok0 ")[0]))
    body = json.loads(answer.continuation_body())
    assert body["messages"][-1] == {"role": "assistant", "content": "Sure: tok0 "}
    assert len(body["messages"]) == 2


def test_a_tool_call_block_is_not_continued() -> None:
    _, start = opening("one", 10)
    answer = MessagesSoFar(DOCUMENT)
    tool = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    block = {"type": "content_block_start", "index": 1, "content_block": tool}
    answer.feed(start + sse(("content_block_start", block)))
    assert not answer.continuable and not answer.exhausted


def test_an_answer_cut_after_its_finish_is_ended_by_the_proxy() -> None:
    wire, start = opening("one", 2)
    answer = MessagesSoFar(DOCUMENT)
    answer.feed(start + b"".join(sse(e) for e in wire.delta("tok0 ")))
    *body, _stop = wire.end("tok0 ")
    answer.feed(b"".join(sse(e) for e in body))
    assert answer.exhausted and not answer.continuable
    assert [e["type"] for e in events(answer.ending())] == ["message_stop"]


def test_an_answer_cut_at_its_max_tokens_is_ended_as_the_engine_would() -> None:
    document = {**DOCUMENT, "max_tokens": 2}
    wire, start = opening("one", 2)
    answer = MessagesSoFar(document)
    answer.feed(start + b"".join(sse(e) for i in range(2) for e in wire.delta(f"tok{i} ")))
    assert answer.exhausted
    ending = events(answer.ending())
    assert [e["type"] for e in ending] == ["content_block_stop", "message_delta", "message_stop"]
    assert ending[1]["delta"]["stop_reason"] == "max_tokens"
    assert ending[1]["usage"]["output_tokens"] == 2


@pytest.mark.parametrize(
    ("target", "document"),
    [
        (b"/v1/chat/completions", DOCUMENT),
        (b"/v1/messages", {**DOCUMENT, "stream": False}),
        (b"/v1/messages", {**DOCUMENT, "messages": []}),
        (
            b"/v1/messages",
            {**DOCUMENT, "messages": [USER, {"role": "assistant", "content": [{"type": "text"}]}]},
        ),
    ],
)
def test_what_is_not_followed(target: bytes, document: dict[str, Any]) -> None:
    assert not wants_prefill(target, document)
