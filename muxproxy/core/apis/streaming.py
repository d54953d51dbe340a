"""What the proxy reads of a streamed answer on its way through, per LLM API: its first token,
its tokens, its usage and an error before its first token.

One ``ApiStream`` per API (``paths.api_for`` picks it by the request path), handed to the SSE
meter (``core/observe/ssemeter.py``), the commit point (``core/streams/commit.py``) and the
usage scan (``core/exchange/admit.py``). Its rules:

- First token (time to first token, and the commit point of a held head): the first event that
  is content. Chat Completions and Completions keep the meter's byte patterns
  (``ssemeter.is_token_event``: no JSON parse, and a backend's plain-text events still count);
  Responses and Messages are read by their API's reader (``responses.py``, ``anthropic.py``),
  one JSON parse per event, so ``response.created`` (whose ``"text":{"format":...}`` the byte
  patterns take for a token), ``message_start``, ``content_block_start`` and ``ping`` are not
  the first token. Only events up to the first token are inspected so, as before.
- Tokens: Chat Completions and Completions count every event from the first token on (the
  meter's events, as before). Responses counts its ``response.*.delta`` events and Messages its
  ``content_block_delta`` events, by one byte check per chunk (``token_marker``: the event's
  quoted ``type`` value, ``.delta"`` and ``"content_block_delta"``; an ``event:`` line is not
  quoted, and a quote inside a string value is escaped, so each such event counts once).
- Usage: the last ``"<output field>": N`` and ``"<input field>": N`` of the body settle a token
  budget: ``completion_tokens`` / ``prompt_tokens`` (chat, completions), ``output_tokens`` /
  ``input_tokens`` (Responses' ``response.completed``, Messages' ``message_delta``, whose
  cumulative count comes after ``message_start``'s).
- Error before the first token (``error_of``): an event the API's reader reads as an error
  (Anthropic's ``event: error``, an OpenAI ``{"error": ...}`` object, Responses' ``error`` and
  ``response.failed``). Chat and Completions events are parsed for it only when they hold
  ``"error"``. The commit point turns it into a failover; after the first token it is relayed.

Pure and total: a backend's bytes never raise here (the readers' rule, ``reading.py``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import attrs

from muxproxy.core.apis.paths import READERS, Api, api_for
from muxproxy.core.apis.reading import Kind, Reader, Reading


def split_event(event: bytes) -> tuple[str | None, bytes] | None:
    """One SSE event's name and joined data (WHATWG HTML §9.2.6), or None when it has no
    ``data:`` line (a comment or a keep-alive: nothing is dispatched)."""
    name: str | None = None
    data: list[bytes] = []
    for line in event.splitlines():  # CRLF, LF and CR, as §9.2.6 allows
        field, colon, value = line.partition(b":")
        if not colon:
            value = b""
        elif value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data.append(value)
        elif field == b"event":
            name = value.decode("utf-8", "replace")
    return None if not data else (name, b"\n".join(data))


def read_event(read: Reader, event: bytes) -> Reading | None:
    """``event`` read by ``read``; None when it dispatches nothing."""
    parts = split_event(event)
    return None if parts is None else read(*parts)


def _by_reader(read: Reader) -> Callable[[bytes], bool]:
    def is_content(event: bytes) -> bool:
        reading = read_event(read, event)
        return reading is not None and reading.kind is Kind.CONTENT

    return is_content


def _error_of(read: Reader, cheap_test: bytes | None) -> Callable[[bytes], str | None]:
    def error_of(event: bytes) -> str | None:
        if cheap_test is not None and cheap_test not in event:
            return None
        reading = read_event(read, event)
        return reading.error_type if reading is not None and reading.kind is Kind.ERROR else None

    return error_of


def usage_pattern(field: bytes) -> re.Pattern[bytes]:
    return re.compile(b'"' + field + rb'"\s*:\s*([0-9]{1,12})')


@attrs.frozen(kw_only=True)
class ApiStream:
    """How one API's stream is read (the module's rules)."""

    api: Api
    is_content: Callable[[bytes], bool] | None
    """Whether one SSE event (its bytes before the empty line) is content; None: the SSE
    meter's byte patterns (``ssemeter.is_token_event``)."""
    error_of: Callable[[bytes], str | None]
    """The error type one SSE event reports, or None."""
    token_marker: bytes
    """Counted per chunk as the tokens; empty: every event from the first token on."""
    output_usage: re.Pattern[bytes]
    input_usage: re.Pattern[bytes]


def _stream(api: Api, by_reader: bool, marker: bytes, output: bytes, input: bytes) -> ApiStream:
    read = READERS[api]
    return ApiStream(
        api=api,
        is_content=_by_reader(read) if by_reader else None,
        error_of=_error_of(read, None if by_reader else b'"error"'),
        token_marker=marker,
        output_usage=usage_pattern(output),
        input_usage=usage_pattern(input),
    )


STREAMS: Mapping[Api, ApiStream] = {
    Api.CHAT_COMPLETIONS: _stream(
        Api.CHAT_COMPLETIONS, False, b"", b"completion_tokens", b"prompt_tokens"
    ),
    Api.COMPLETIONS: _stream(Api.COMPLETIONS, False, b"", b"completion_tokens", b"prompt_tokens"),
    Api.RESPONSES: _stream(Api.RESPONSES, True, b'.delta"', b"output_tokens", b"input_tokens"),
    Api.MESSAGES: _stream(
        Api.MESSAGES, True, b'"content_block_delta"', b"output_tokens", b"input_tokens"
    ),
}

OPENAI_LIKE = STREAMS[Api.CHAT_COMPLETIONS]
"""A path that names no known API: its usage is read in Chat Completions' fields."""


def stream_for(target: bytes) -> ApiStream | None:
    """The ``ApiStream`` of the API a request target speaks, or None."""
    api = api_for(target.decode("latin-1"))
    return None if api is None else STREAMS[api]
