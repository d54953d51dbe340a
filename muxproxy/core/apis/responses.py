"""The OpenAI Responses stream (platform.openai.com/docs/api-reference/responses-streaming).

Every event is ``event: <type>`` then ``data: {json}`` whose ``type`` repeats the name, and
every event carries a ``sequence_number`` (its place in the stream, from 0). The order:
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, then the deltas — ``response.output_text.delta`` (the answer),
``response.function_call_arguments.delta``, ``response.reasoning_text.delta``,
``response.refusal.delta`` — then the ``.done`` events, and one terminal event:
``response.completed`` (or ``response.incomplete``) whose ``response.usage`` has
``input_tokens`` and ``output_tokens``, or ``response.failed`` whose ``response.error`` has a
``code``. A failure outside a response is the ``error`` event (``{"type": "error", "code",
"message", "param"}``). There is no ``[DONE]``.

The event's name is taken from the ``event:`` line, else from the payload's ``type``."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from muxproxy.core.apis.reading import (
    META,
    Handler,
    JsonObject,
    Kind,
    Reading,
    count,
    dispatch,
    error_reading,
    is_text,
    member,
    payload_object,
    usage_of,
)


def delta(obj: JsonObject) -> Reading:
    """A delta of the answer: content when it carries text."""
    return Reading(kind=Kind.CONTENT, tokens=1) if is_text(obj.get("delta")) else META


def finished(obj: JsonObject) -> Reading:
    """``response.completed`` / ``response.incomplete``: the usage, when reported."""
    usage = usage_of(member(obj.get("response"), "usage"), "input_tokens", "output_tokens")
    return META if usage is None else Reading(kind=Kind.USAGE, usage=usage)


def failed(obj: JsonObject) -> Reading:
    """``response.failed``: the response's error."""
    return error_reading(member(obj.get("response"), "error"))


def error(obj: JsonObject) -> Reading:
    """The ``error`` event; some servers nest the details in an ``error`` object."""
    nested = obj.get("error")
    return error_reading(nested if isinstance(nested, dict) else obj)


TABLE: Mapping[str, Handler] = {
    "response.output_text.delta": delta,
    "response.function_call_arguments.delta": delta,
    "response.reasoning_text.delta": delta,
    "response.reasoning_summary_text.delta": delta,
    "response.refusal.delta": delta,
    "response.completed": finished,
    "response.incomplete": finished,
    "response.failed": failed,
    "error": error,
}
"""Events that matter; every other (``response.created``, ``.in_progress``, ``.added``,
``.done`` ...) is meta."""


def read_responses(event: str | None, data: bytes) -> Reading:
    """One Responses event, with its ``sequence_number``."""
    obj = payload_object(data)
    if obj is None:
        return META
    reading = dispatch(TABLE, event if event else obj.get("type"), obj)
    sequence = count(obj.get("sequence_number"))
    return reading if sequence is None else attrs.evolve(reading, sequence_number=sequence)
