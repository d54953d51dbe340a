"""What one SSE event of an LLM API means, as a small frozen record, and the helpers every
API's reader shares: the JSON payload read without raising, and the dispatch by table.

Invariants: ``Reading`` is immutable; ``tokens`` is non-zero only for ``CONTENT`` (one content
event is one token, as the SSE metering counts it, ``core/observe/ssemeter.py``); ``usage`` is
set only when the event reports token counts; ``error_type`` only for ``ERROR``. Nothing here
raises on a backend's bytes: ``payload_object`` answers ``None`` for anything that is not a
JSON object (bad UTF-8, bad JSON, a number, an array, nesting past the parser's limit)."""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping

import attrs

JsonObject = dict[str, object]


class Kind(enum.Enum):
    """What an event is to the proxy."""

    CONTENT = "content"
    """Part of the answer (text, a tool call's arguments, reasoning): counted as a token."""
    USAGE = "usage"
    """Token counts reported by the backend, no content."""
    ERROR = "error"
    """The backend reports a failure in the stream (before any content: a failover's cue)."""
    META = "meta"
    """Anything else: framing, keep-alives, unknown or malformed events."""
    DONE = "done"
    """The stream's end marker."""


@attrs.frozen(kw_only=True)
class Usage:
    """Token counts a backend reports; ``None`` where the event leaves one out."""

    input_tokens: int | None = None
    output_tokens: int | None = None


@attrs.frozen(kw_only=True)
class Reading:
    """One event, read."""

    kind: Kind
    tokens: int = 0
    """Tokens the event carries: 1 for a content event, else 0."""
    usage: Usage | None = None
    error_type: str | None = None
    """The error's type (``overloaded_error``, ``server_error`` ...) or ``"error"`` when the
    backend gave none."""
    sequence_number: int | None = None
    """The Responses API's per-stream event number, where the event carries one."""


META = Reading(kind=Kind.META)
DONE = Reading(kind=Kind.DONE)

Reader = Callable[[str | None, bytes], Reading]
"""An API's reader: (the event's name or ``None``, its joined data) -> what it means."""

Handler = Callable[[JsonObject], Reading]
"""One row of an API's table: the event's decoded JSON object -> what it means."""

MAX_PAYLOAD = 16 * 1024 * 1024
"""A payload larger than this is not decoded (meta): bounds the work one event can cost."""


def payload_object(data: bytes) -> JsonObject | None:
    """The payload as a JSON object, or ``None`` when it is not one (never raises)."""
    if len(data) > MAX_PAYLOAD:
        return None
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        # ValueError covers bad JSON and bad UTF-8 (UnicodeDecodeError is one); deep
        # nesting raises RecursionError in the decoder.
        return None
    return value if isinstance(value, dict) else None


def member(value: object, key: str) -> object:
    """``value[key]`` when ``value`` is a JSON object, else ``None``."""
    return value.get(key) if isinstance(value, dict) else None


def count(value: object) -> int | None:
    """A token count: a non-negative integer (not a boolean), else ``None``."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def non_empty(value: object) -> bool:
    """Whether a field carries something: a non-empty string, list or object, or a number."""
    if value is None or isinstance(value, bool):
        return False
    if isinstance(value, (str, list, dict)):
        return len(value) > 0
    return isinstance(value, (int, float))


def is_text(value: object) -> bool:
    """Whether a text field carries text: a non-empty string (a number there is malformed)."""
    return isinstance(value, str) and len(value) > 0


def usage_of(value: object, input_key: str, output_key: str) -> Usage | None:
    """The usage object's counts under the API's key names, or ``None`` when it has neither."""
    if not isinstance(value, dict):
        return None
    found = Usage(
        input_tokens=count(value.get(input_key)), output_tokens=count(value.get(output_key))
    )
    if found.input_tokens is None and found.output_tokens is None:
        return None
    return found


def error_reading(error: object, sequence_number: int | None = None) -> Reading:
    """An error event: its ``type`` when it names more than ``"error"``, else its ``code``,
    else ``"error"`` (the Responses API's error event is ``{"type": "error", "code": ...}``)."""
    name = "error"
    for key in ("type", "code"):
        value = member(error, key)
        if isinstance(value, str) and value and value != "error":
            name = value
            break
    return Reading(kind=Kind.ERROR, error_type=name, sequence_number=sequence_number)


def dispatch(table: Mapping[str, Handler], key: object, obj: JsonObject) -> Reading:
    """The table's row for ``key`` applied to ``obj``; ``META`` when there is none."""
    if not isinstance(key, str):
        return META
    handler = table.get(key)
    return META if handler is None else handler(obj)
