"""The OpenAI Chat Completions and Completions streams, as vLLM, SGLang and OpenAI send them.

Chat Completions (platform.openai.com/docs/api-reference/chat-streaming): every event is
``data: {json}`` with ``"object": "chat.completion.chunk"`` and no ``event:`` name; the answer
is in ``choices[i].delta`` (``content``, ``tool_calls``, and the ``reasoning_content`` /
``reasoning`` vLLM and SGLang add); the first chunk carries only ``role`` with empty content,
the last one a ``finish_reason`` and an empty delta. With ``stream_options.include_usage`` the
chunks carry ``"usage": null`` and one more chunk, with ``"choices": []``, carries
``usage.prompt_tokens`` / ``completion_tokens`` (vLLM's ``continuous_usage_stats`` puts usage
in every chunk: a content chunk is still content, its usage attached). The stream ends with
``data: [DONE]``. A failure mid-stream is an ``{"error": {"message", "type", "code"}}`` object
(OpenAI, vLLM) or vLLM's older ``{"object": "error", "type": ..., ...}``.

Completions (the legacy API, ``/v1/completions``): the same framing with ``"object":
"text_completion"`` and the answer in ``choices[i].text``.

A chunk is content when one of its choices carries a non-empty answer field, as the SSE
metering decides (``core/observe/ssemeter.py``)."""

from __future__ import annotations

from collections.abc import Mapping

from muxproxy.core.apis.reading import (
    DONE,
    META,
    Handler,
    JsonObject,
    Kind,
    Reading,
    dispatch,
    error_reading,
    is_text,
    member,
    non_empty,
    payload_object,
    usage_of,
)

DONE_MARKER = b"[DONE]"

CHAT_CONTENT_FIELDS = ("content", "tool_calls", "reasoning_content", "reasoning")
"""Fields of a chat delta that carry the answer (vLLM and SGLang add the reasoning ones)."""


def _choices(obj: JsonObject) -> list[object]:
    choices = obj.get("choices")
    return choices if isinstance(choices, list) else []


def _answer(obj: JsonObject, carries: bool) -> Reading:
    """Content when ``carries``, else usage when the chunk reports it, else meta."""
    usage = usage_of(obj.get("usage"), "prompt_tokens", "completion_tokens")
    if carries:
        return Reading(kind=Kind.CONTENT, tokens=1, usage=usage)
    if usage is not None:
        return Reading(kind=Kind.USAGE, usage=usage)
    return META


def chat_chunk(obj: JsonObject) -> Reading:
    """A ``chat.completion.chunk``."""
    carries = any(
        non_empty(member(member(choice, "delta"), field))
        for choice in _choices(obj)
        for field in CHAT_CONTENT_FIELDS
    )
    return _answer(obj, carries)


def text_completion(obj: JsonObject) -> Reading:
    """A ``text_completion`` chunk."""
    carries = any(is_text(member(choice, "text")) for choice in _choices(obj))
    return _answer(obj, carries)


CHAT_TABLE: Mapping[str, Handler] = {
    "chat.completion.chunk": chat_chunk,
    "error": error_reading,
}
COMPLETIONS_TABLE: Mapping[str, Handler] = {
    "text_completion": text_completion,
    "error": error_reading,
}


def _read(table: Mapping[str, Handler], data: bytes) -> Reading:
    if data.strip() == DONE_MARKER:
        return DONE
    obj = payload_object(data)
    if obj is None:
        return META
    if "error" in obj and obj["error"] is not None:
        return error_reading(obj["error"])
    return dispatch(table, obj.get("object"), obj)


def read_chat(event: str | None, data: bytes) -> Reading:
    """One Chat Completions event (the ``event:`` name is unused: the API sends none)."""
    return _read(CHAT_TABLE, data)


def read_completions(event: str | None, data: bytes) -> Reading:
    """One Completions event."""
    return _read(COMPLETIONS_TABLE, data)
