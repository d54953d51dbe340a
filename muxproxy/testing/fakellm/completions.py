"""The fake LLM backend's chat-completion objects and the ASGI messages that carry them.

Pure: no trio, no I/O, no clock; the ASGI app (``app.py``) decides when each is sent, these
functions only say what it is. Kept apart from the app so its timing and counting read
without the wire format in the way.

What it obeys is the OpenAI chat-completions wire format, closely enough for the ``openai``
Python SDK:

* Every object of one completion shares its ``base`` (:func:`completion_base`: ``id``,
  ``created``, ``model``, ``system_fingerprint``).
* Streamed: a head of ``text/event-stream`` (:func:`stream_head`), then one ASGI body message
  per server-sent event ``data: <json>\\n\\n`` (:func:`sse_event`) of a
  ``chat.completion.chunk`` (:func:`chunk`; the usage chunk has no choices,
  :func:`usage_chunk`), closed by ``data: [DONE]`` (:func:`done_event`).
* Whole: one ``chat.completion`` object (:func:`whole_completion`) with ``usage``.
* ``usage`` (:func:`usage_of`) counts the prompt crudely, in whitespace-separated words of the
  messages' string contents: the fake has no tokenizer, and a client only checks the sums.
* With an echo asked for, the first object of a completion carries the request's headers
  under ``request_headers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from muxproxy.testing.fakellm.responses import dumps


def completion_base(
    completion_id: str, created: int, model: str, fingerprint: str
) -> dict[str, Any]:
    """The fields every object of one completion shares."""
    return {
        "id": completion_id,
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
    }


def usage_of(messages: object, completion_tokens: int) -> dict[str, int]:
    """``usage`` of a completion of ``completion_tokens`` answering ``messages``."""
    prompt_tokens = _prompt_tokens(messages)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def stream_head(common: Sequence[tuple[bytes, bytes]]) -> dict[str, Any]:
    """The ``http.response.start`` of a stream, with the backend's ``common`` headers."""
    return {
        "type": "http.response.start",
        "status": 200,
        "headers": [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            *common,
        ],
    }


def chunk(
    base: dict[str, Any],
    delta: dict[str, Any],
    finish_reason: str | None,
    echo: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion.chunk`` of one choice (``echo``: the request headers to add)."""
    obj: dict[str, Any] = {
        **base,
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if echo is not None:
        obj["request_headers"] = echo
    return obj


def usage_chunk(base: dict[str, Any], usage: dict[str, int]) -> dict[str, Any]:
    """The chunk after the finish chunk that carries ``usage`` (``include_usage``)."""
    return {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage}


def sse_event(obj: object) -> dict[str, Any]:
    """The ASGI body message of one server-sent event carrying ``obj``."""
    return body_message(b"data: " + dumps(obj) + b"\n\n", more_body=True)


def whole_completion(
    base: dict[str, Any], text: str, usage: dict[str, int], echo: dict[str, str] | None
) -> dict[str, Any]:
    """A ``chat.completion`` answering ``text`` (``echo``: the request headers to add)."""
    obj: dict[str, Any] = {
        **base,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": usage,
    }
    if echo is not None:
        obj["request_headers"] = echo
    return obj


def done_event() -> dict[str, Any]:
    """The last message of a stream: ``data: [DONE]``."""
    return body_message(b"data: [DONE]\n\n", more_body=False)


def body_message(body: bytes, more_body: bool) -> dict[str, Any]:
    """An ``http.response.body`` message."""
    return {"type": "http.response.body", "body": body, "more_body": more_body}


def _prompt_tokens(messages: object) -> int:
    """A crude prompt size: whitespace-separated words of the string contents."""
    if not isinstance(messages, list):
        return 0
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content.split())
    return total
