"""The LLM APIs' event readers (``muxproxy/core/apis/``), with streams shaped as OpenAI,
Anthropic, vLLM and SGLang send them: where the first content is, how many tokens, the usage,
an error before content, and unknown or malformed events that read as meta."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from muxproxy.core.apis.anthropic import read_messages
from muxproxy.core.apis.openai import read_chat, read_completions
from muxproxy.core.apis.paths import Api, api_for, reader_for
from muxproxy.core.apis.reading import Kind, Reader, Reading, Usage
from muxproxy.core.apis.responses import read_responses

Event = tuple[str | None, bytes]


def data(obj: object) -> bytes:
    return json.dumps(obj).encode()


def chat_chunk(delta: dict[str, object], finish: str | None = None, usage: object = None) -> Event:
    return None, data(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1718000000,
            "model": "llama-3-8b",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            "usage": usage,
        }
    )


CHAT_STREAM: list[Event] = [
    chat_chunk({"role": "assistant", "content": ""}),
    chat_chunk({"content": "Hello"}),
    chat_chunk({"content": " world"}),
    chat_chunk({"reasoning_content": "hmm"}),
    chat_chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "f", "arguments": ""},
                }
            ]
        }
    ),
    chat_chunk({}, finish="stop"),
    (
        None,
        data(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 1718000000,
                "model": "llama-3-8b",
                "choices": [],
                "usage": {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16},
            }
        ),
    ),
    (None, b"[DONE]"),
]


def completion_chunk(text: str, finish: str | None = None) -> Event:
    return None, data(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1718000000,
            "model": "llama-3-8b",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        }
    )


COMPLETIONS_STREAM: list[Event] = [
    completion_chunk("Once"),
    completion_chunk(" upon"),
    completion_chunk("", finish="length"),
    (
        None,
        data(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 1718000000,
                "model": "llama-3-8b",
                "choices": [],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            }
        ),
    ),
    (None, b"[DONE]"),
]


def responses_event(kind: str, seq: int, **fields: object) -> Event:
    return kind, data({"type": kind, "sequence_number": seq, **fields})


RESPONSE: dict[str, object] = {
    "id": "resp_1",
    "object": "response",
    "status": "in_progress",
    "output": [],
    "usage": None,
}
RESPONSES_STREAM: list[Event] = [
    responses_event("response.created", 0, response=RESPONSE),
    responses_event("response.in_progress", 1, response=RESPONSE),
    responses_event(
        "response.output_item.added",
        2,
        output_index=0,
        item={
            "id": "msg_1",
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        },
    ),
    responses_event(
        "response.content_part.added",
        3,
        item_id="msg_1",
        output_index=0,
        content_index=0,
        part={"type": "output_text", "text": "", "annotations": []},
    ),
    responses_event(
        "response.output_text.delta",
        4,
        item_id="msg_1",
        output_index=0,
        content_index=0,
        delta="Hi",
    ),
    responses_event(
        "response.output_text.delta",
        5,
        item_id="msg_1",
        output_index=0,
        content_index=0,
        delta=" there",
    ),
    responses_event(
        "response.output_text.done",
        6,
        item_id="msg_1",
        output_index=0,
        content_index=0,
        text="Hi there",
    ),
    responses_event(
        "response.completed",
        7,
        response={
            **RESPONSE,
            "status": "completed",
            "usage": {"input_tokens": 9, "output_tokens": 2, "total_tokens": 11},
        },
    ),
]


def anthropic_event(kind: str, **fields: object) -> Event:
    return kind, data({"type": kind, **fields})


MESSAGES_STREAM: list[Event] = [
    anthropic_event(
        "message_start",
        message={
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": "claude-sonnet-4",
            "stop_reason": None,
            "usage": {"input_tokens": 25, "output_tokens": 1},
        },
    ),
    anthropic_event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    anthropic_event("ping"),
    anthropic_event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hello"}),
    anthropic_event("content_block_delta", index=0, delta={"type": "text_delta", "text": "!"}),
    anthropic_event("content_block_stop", index=0),
    anthropic_event(
        "content_block_start",
        index=1,
        content_block={"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}},
    ),
    anthropic_event(
        "content_block_delta", index=1, delta={"type": "input_json_delta", "partial_json": '{"a":'}
    ),
    anthropic_event("content_block_stop", index=1),
    anthropic_event(
        "message_delta", delta={"stop_reason": "tool_use"}, usage={"output_tokens": 15}
    ),
    anthropic_event("message_stop"),
]


def read_all(reader: Reader, stream: list[Event]) -> list[Reading]:
    return [reader(event, payload) for event, payload in stream]


def first_content(readings: list[Reading]) -> int | None:
    return next((i for i, r in enumerate(readings) if r.kind is Kind.CONTENT), None)


def last_usage(readings: list[Reading]) -> Usage | None:
    found = [r.usage for r in readings if r.usage is not None]
    return found[-1] if found else None


@pytest.mark.parametrize(
    ("reader", "stream", "first", "tokens", "usage", "last"),
    [
        (read_chat, CHAT_STREAM, 1, 4, Usage(input_tokens=12, output_tokens=4), Kind.DONE),
        (
            read_completions,
            COMPLETIONS_STREAM,
            0,
            2,
            Usage(input_tokens=3, output_tokens=2),
            Kind.DONE,
        ),
        (
            read_responses,
            RESPONSES_STREAM,
            4,
            2,
            Usage(input_tokens=9, output_tokens=2),
            Kind.USAGE,
        ),
        (
            read_messages,
            MESSAGES_STREAM,
            3,
            3,
            Usage(input_tokens=None, output_tokens=15),
            Kind.DONE,
        ),
    ],
    ids=["chat", "completions", "responses", "messages"],
)
def test_a_recorded_stream_reads_its_first_content_tokens_and_usage(
    reader: Reader, stream: list[Event], first: int, tokens: int, usage: Usage, last: Kind
) -> None:
    readings = read_all(reader, stream)
    assert first_content(readings) == first
    assert sum(r.tokens for r in readings) == tokens
    assert last_usage(readings) == usage
    assert readings[-1].kind is last
    assert all(r.error_type is None for r in readings)
    assert all((r.tokens == 1) == (r.kind is Kind.CONTENT) for r in readings)


def test_chat_role_and_finish_chunks_are_not_content() -> None:
    readings = read_all(read_chat, CHAT_STREAM)
    assert [r.kind for r in readings] == [
        Kind.META,
        Kind.CONTENT,
        Kind.CONTENT,
        Kind.CONTENT,
        Kind.CONTENT,
        Kind.META,
        Kind.USAGE,
        Kind.DONE,
    ]


def test_chat_content_chunk_with_continuous_usage_keeps_both() -> None:
    reading = read_chat(
        *chat_chunk({"content": "x"}, usage={"prompt_tokens": 5, "completion_tokens": 1})
    )
    assert reading == Reading(
        kind=Kind.CONTENT, tokens=1, usage=Usage(input_tokens=5, output_tokens=1)
    )


def test_messages_start_reports_the_prompt_tokens() -> None:
    readings = read_all(read_messages, MESSAGES_STREAM)
    assert readings[0] == Reading(kind=Kind.USAGE, usage=Usage(input_tokens=25, output_tokens=1))
    assert [r.kind for r in readings[1:3]] == [Kind.META, Kind.META]


def test_every_responses_event_carries_its_sequence_number() -> None:
    readings = read_all(read_responses, RESPONSES_STREAM)
    assert [r.sequence_number for r in readings] == list(range(len(RESPONSES_STREAM)))
    assert [r.kind for r in readings[:4]] == [Kind.META] * 4


@pytest.mark.parametrize(
    ("reader", "event", "error_type"),
    [
        (
            read_chat,
            (
                None,
                data(
                    {
                        "error": {
                            "message": "busy",
                            "type": "server_error",
                            "param": None,
                            "code": None,
                        }
                    }
                ),
            ),
            "server_error",
        ),
        (
            read_chat,
            (
                None,
                data({"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}),
            ),
            "BadRequestError",
        ),
        (
            read_completions,
            (None, data({"error": {"message": "oops", "code": "internal"}})),
            "internal",
        ),
        (
            read_responses,
            (
                "error",
                data(
                    {
                        "type": "error",
                        "code": "rate_limit_exceeded",
                        "message": "slow",
                        "sequence_number": 2,
                    }
                ),
            ),
            "rate_limit_exceeded",
        ),
        (
            read_responses,
            (
                "response.failed",
                data(
                    {
                        "type": "response.failed",
                        "sequence_number": 3,
                        "response": {
                            **RESPONSE,
                            "status": "failed",
                            "error": {"code": "server_error", "message": "x"},
                        },
                    }
                ),
            ),
            "server_error",
        ),
        (
            read_messages,
            (
                "error",
                data(
                    {
                        "type": "error",
                        "error": {"type": "overloaded_error", "message": "Overloaded"},
                    }
                ),
            ),
            "overloaded_error",
        ),
        (read_messages, ("error", data({"type": "error"})), "error"),
    ],
    ids=[
        "chat",
        "vllm-object-error",
        "completions",
        "responses-error",
        "responses-failed",
        "messages",
        "bare",
    ],
)
def test_an_error_before_content_reads_as_error_not_meta(
    reader: Reader, event: Event, error_type: str
) -> None:
    prologues: dict[Reader, list[Event]] = {
        read_chat: CHAT_STREAM[:1],
        read_completions: [],
        read_responses: RESPONSES_STREAM[:4],
        read_messages: MESSAGES_STREAM[:3],
    }
    prologue = prologues[reader]
    readings = read_all(reader, [*prologue, event])
    assert first_content(readings) is None
    assert readings[-1].kind is Kind.ERROR
    assert readings[-1].error_type == error_type
    assert readings[-1].tokens == 0


UNKNOWN_AND_MALFORMED: list[bytes] = [
    b"",
    b"{",
    b"not json",
    b"\xff\xfe",
    b"[1, 2]",
    b"42",
    b"null",
    b'"text"',
    b"[" * 100_000,
    data({"object": "something.new", "choices": [{"delta": {"content": "x"}}]}),
    data({"choices": "not a list"}),
    data({"type": "response.output_text.delta", "delta": 7, "sequence_number": -1}),
    data({"type": "content_block_delta", "delta": "text"}),
    data(
        {
            "object": "chat.completion.chunk",
            "choices": [{"delta": []}],
            "usage": {"prompt_tokens": True},
        }
    ),
]


@pytest.mark.parametrize("reader", [read_chat, read_completions, read_responses, read_messages])
@pytest.mark.parametrize("payload", UNKNOWN_AND_MALFORMED)
def test_unknown_or_malformed_events_are_meta_with_nothing_counted(
    reader: Reader, payload: bytes
) -> None:
    for event in (None, "brand_new_event"):
        reading = reader(event, payload)
        assert reading.kind is Kind.META
        assert reading.tokens == 0
        assert reading.usage is None
        assert reading.error_type is None


def test_named_but_unknown_events_are_meta() -> None:
    assert (
        read_messages("content_block_future", data({"type": "content_block_future"})).kind
        is Kind.META
    )
    assert read_responses(
        "response.audio.delta", data({"type": "response.audio.delta", "delta": "AAA"})
    ) == Reading(kind=Kind.META)


@pytest.mark.parametrize("reader", [read_chat, read_completions, read_responses, read_messages])
@given(event=st.none() | st.text(max_size=30), payload=st.binary(max_size=200))
def test_arbitrary_bytes_never_raise(reader: Reader, event: str | None, payload: bytes) -> None:
    assert isinstance(reader(event, payload), Reading)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)
known_keys = st.sampled_from(
    [
        "object",
        "type",
        "choices",
        "delta",
        "usage",
        "error",
        "response",
        "message",
        "sequence_number",
        "text",
    ]
)


@pytest.mark.parametrize("reader", [read_chat, read_completions, read_responses, read_messages])
@given(
    obj=st.dictionaries(known_keys, json_values, max_size=6),
    event=st.none()
    | st.sampled_from(["error", "message_start", "response.completed", "content_block_delta"]),
)
def test_arbitrary_json_in_the_known_fields_never_raises(
    reader: Reader, obj: dict[str, object], event: str | None
) -> None:
    reading = reader(event, data(obj))
    assert reading.tokens in (0, 1)


@pytest.mark.parametrize(
    ("path", "api"),
    [
        ("/v1/chat/completions", Api.CHAT_COMPLETIONS),
        ("/v1/completions", Api.COMPLETIONS),
        ("/v1/responses", Api.RESPONSES),
        ("/v1/messages", Api.MESSAGES),
        ("/openai/v1/chat/completions", Api.CHAT_COMPLETIONS),
        ("/anthropic/v1/messages?beta=true", Api.MESSAGES),
        ("/v1/responses/", Api.RESPONSES),
        ("/v1/models", None),
        ("/v1/messages_old", None),
        ("/xv1/messages", None),
        ("/", None),
        ("", None),
    ],
)
def test_the_path_says_which_api(path: str, api: Api | None) -> None:
    assert api_for(path) is api
    reader = reader_for(path)
    assert (reader is None) == (api is None)


def test_each_path_gets_its_own_reader() -> None:
    assert reader_for("/v1/chat/completions") is read_chat
    assert reader_for("/v1/completions") is read_completions
    assert reader_for("/v1/responses") is read_responses
    assert reader_for("/v1/messages") is read_messages
