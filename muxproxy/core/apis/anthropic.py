"""The Anthropic Messages stream (docs.anthropic.com/en/docs/build-with-claude/streaming).

Every event is ``event: <type>`` then ``data: {json}`` whose ``type`` repeats the name. The
order: ``message_start`` (``message.usage.input_tokens``), then per content block
``content_block_start``, ``content_block_delta``\\* and ``content_block_stop``, with ``ping``
events anywhere; then ``message_delta`` (``usage.output_tokens``, cumulative) and
``message_stop``. A delta is the answer when its ``delta.type`` is ``text_delta`` (``text``),
``input_json_delta`` (``partial_json``, a tool call's arguments) or ``thinking_delta``
(``thinking``); a ``signature_delta`` is not. A failure is ``event: error`` with ``{"type":
"error", "error": {"type": "overloaded_error", "message": ...}}``.

The event's name is taken from the ``event:`` line, else from the payload's ``type``."""

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
    payload_object,
    usage_of,
)

DELTA_FIELDS: Mapping[str, str] = {
    "text_delta": "text",
    "input_json_delta": "partial_json",
    "thinking_delta": "thinking",
}
"""A content delta's type -> the field holding its part of the answer."""


def message_start(obj: JsonObject) -> Reading:
    """``message_start``: the prompt's tokens."""
    usage = usage_of(member(obj.get("message"), "usage"), "input_tokens", "output_tokens")
    return META if usage is None else Reading(kind=Kind.USAGE, usage=usage)


def block_delta(obj: JsonObject) -> Reading:
    """``content_block_delta``: content when it carries part of the answer."""
    delta = obj.get("delta")
    field = DELTA_FIELDS.get(str(member(delta, "type")))
    if field is not None and is_text(member(delta, field)):
        return Reading(kind=Kind.CONTENT, tokens=1)
    return META


def message_delta(obj: JsonObject) -> Reading:
    """``message_delta``: the answer's tokens so far."""
    usage = usage_of(obj.get("usage"), "input_tokens", "output_tokens")
    return META if usage is None else Reading(kind=Kind.USAGE, usage=usage)


def message_stop(obj: JsonObject) -> Reading:
    return DONE


def error(obj: JsonObject) -> Reading:
    """``error``: the nested error's type."""
    return error_reading(obj.get("error"))


TABLE: Mapping[str, Handler] = {
    "message_start": message_start,
    "content_block_delta": block_delta,
    "message_delta": message_delta,
    "message_stop": message_stop,
    "error": error,
}
"""Events that matter; ``content_block_start``, ``content_block_stop``, ``ping`` and unknown
events are meta."""


def read_messages(event: str | None, data: bytes) -> Reading:
    """One Messages event."""
    obj = payload_object(data)
    if obj is None:
        return META
    return dispatch(TABLE, event if event else obj.get("type"), obj)
