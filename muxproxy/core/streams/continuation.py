"""Continuation: a chat answer whose backend died mid-stream is finished by another backend.

What it obeys, and why:

- Only an OpenAI-style chat completion (``/chat/completions``, a JSON body with a
  ``messages`` array and ``"stream": true``) whose whole body was kept (within
  ``next_upstream.replay_buffer``) is continued, on a route with ``continue_on_failure``.
  (An Anthropic Messages answer is continued by ``prefill.py``, through the same
  ``FollowedAnswer`` shape; ``docs/apis.md`` says why Responses and Completions are not.)
- The answer so far (``AnswerSoFar``) is read from the SSE events relayed: the text of
  ``choices[0].delta.content``, and the ``id``, ``created`` and ``model`` of the stream. A
  stream that already finished (a ``finish_reason``, or ``[DONE]``) is not continued: cut
  after its finish with no partial event pending, it is ended by the proxy (``ending``: the
  ``[DONE]`` it lacks, if any, then a clean end), as the answer is whole; a usage chunk the
  backend would have sent after the finish is lost with it.
- The continuation request (``continuation_body``) is the original with the text so far
  appended as a final assistant message, and ``continue_final_message: true``,
  ``add_generation_prompt: false``: the chat-template options with which vLLM and SGLang
  continue a partial assistant message instead of starting a new one. Its ``max_tokens``
  (or ``max_completion_tokens``) is what was left of the original's: the text relayed so far
  counts one token per content event.
- The new stream is spliced into the old one (``Splicer``): each event gets the original's
  ``id``, ``created`` and ``model``; the role goes out once (the new stream's role-only
  chunk is dropped, a role in a content chunk removed), so the client sees one stream, one
  role chunk and a single ``[DONE]``. A usage chunk of the continuation counts its own
  tokens only (it is passed as it is).
- An answer cut after its last token (as many content events as its ``max_tokens`` or
  ``max_completion_tokens`` allow, the finish chunk lost) needs no backend: the proxy ends it
  as the engine would have (``AnswerSoFar.ending``: ``finish_reason: "length"``, then
  ``[DONE]``), instead of asking the next server for a token the client did not ask for.
- RFC 9110 §9.2.2 leaves retrying to the proxy, and nothing of the original is re-sent to the
  client: only what the new backend generates after the text so far.

Pure: no clock, no I/O; one ``json.loads`` per event, on such routes only.
"""

from __future__ import annotations

import json
from typing import Any, Protocol


class Splicing(Protocol):
    """What a continuation's stream goes through on its way to the client."""

    def feed(self, data: bytes) -> bytes: ...
    def flush(self) -> bytes: ...


class FollowedAnswer(Protocol):
    """An answer followed for a continuation: ``AnswerSoFar`` (chat), ``prefill.MessagesSoFar``."""

    @property
    def continuable(self) -> bool: ...
    @property
    def exhausted(self) -> bool: ...
    def ending(self) -> bytes: ...
    def feed(self, data: bytes) -> None: ...
    def continuation_body(self) -> bytes: ...
    def splicer(self) -> Splicing: ...


MAX_TEXT = 1024 * 1024
"""Most bytes of answer text held for a continuation; past it the answer is not continued."""


def wants_continuation(target: bytes, document: object) -> bool:
    """Whether a request for ``target`` with JSON body ``document`` may be continued."""
    path = target.split(b"?", 1)[0]
    return (
        path.endswith(b"/chat/completions")
        and isinstance(document, dict)
        and isinstance(document.get("messages"), list)
        and document.get("stream") is True
        and document.get("n", 1) == 1
    )


class EventSplitter:
    """Splits an SSE byte stream into events (LF or CRLF line ends, WHATWG HTML §9.2.6)."""

    def __init__(self) -> None:
        self.pending = b""

    def split(self, data: bytes) -> list[bytes]:
        buffer = self.pending + data if self.pending else data
        buffer = buffer.replace(b"\r\n", b"\n")
        *events, self.pending = buffer.split(b"\n\n")
        return events


def _data_of(event: bytes) -> bytes | None:
    """The data of ``event`` (its ``data:`` lines joined), or None if it has none."""
    lines = [line for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[5:].removeprefix(b" ") for line in lines)


class AnswerSoFar:
    """What the client has of an answer, read from the events relayed to it."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        self.text: list[str] = []
        self.size = 0
        self.content_events = 0
        self.id: object = None
        self.created: object = None
        self.model: object = None
        self.finished = False
        """A ``finish_reason`` or ``[DONE]`` was relayed: no token is missing."""
        self.done = False
        """``[DONE]`` was relayed."""
        self.broken = False
        """Something could not be followed (a non-JSON event, too much text): no continuation."""
        self._events = EventSplitter()

    @property
    def continuable(self) -> bool:
        return not self.finished and not self.broken and self.id is not None

    @property
    def exhausted(self) -> bool:
        """Only the stream's end was lost (see the module): it finished, or every token the
        request allows was relayed (a content event holds one at least), and no partial
        event is pending."""
        if self._events.pending or self.broken:
            return False
        if self.finished:
            return True
        limit = self._limit()
        return limit is not None and self.content_events >= limit

    def _limit(self) -> int | None:
        """The request's token limit: ``max_completion_tokens``, else ``max_tokens``."""
        limits = _token_limits(self.document)
        return next(iter(limits.values()), None)

    def ending(self) -> bytes:
        """The events that end an ``exhausted`` answer: nothing after ``[DONE]``; ``[DONE]``
        after a finish; else what an OpenAI-style engine sends when a generation reaches its
        limit, a chunk with ``finish_reason: "length"`` and an empty delta, then ``[DONE]``."""
        if self.done:
            return b""
        if self.finished:
            return b"data: [DONE]\n\n"
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
        }
        encoded = json.dumps(chunk, separators=(",", ":")).encode()
        return b"data: " + encoded + b"\n\ndata: [DONE]\n\n"

    def feed(self, data: bytes) -> None:
        if self.broken or self.done:
            return
        for event in self._events.split(data):
            payload = _data_of(event)
            if payload is None:
                continue
            if payload.strip() == b"[DONE]":
                self.finished = self.done = True
                return
            if self.finished:  # the usage chunk after the finish: only its end is followed
                continue
            try:
                chunk = json.loads(payload)
            except ValueError:
                self.broken = True
                return
            if not isinstance(chunk, dict):
                self.broken = True
                return
            if self.id is None:
                self.id, self.created, self.model = (
                    chunk.get("id"),
                    chunk.get("created"),
                    chunk.get("model"),
                )
            choices = chunk.get("choices")
            if not isinstance(choices, list) or not choices:
                continue
            choice = choices[0]
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            content = delta.get("content") if isinstance(delta, dict) else None
            if isinstance(content, str) and content:
                self.text.append(content)
                self.size += len(content)
                self.content_events += 1
                if self.size > MAX_TEXT:
                    self.broken = True
            if choice.get("finish_reason") is not None:
                self.finished = True

    def continuation_body(self) -> bytes:
        """The request that continues the answer (see the module)."""
        document = dict(self.document)
        messages = list(document["messages"])
        messages.append({"role": "assistant", "content": "".join(self.text)})
        document["messages"] = messages
        document["continue_final_message"] = True
        document["add_generation_prompt"] = False
        for key, limit in _token_limits(document).items():
            document[key] = max(1, limit - self.content_events)
        return json.dumps(document, separators=(",", ":")).encode()

    def splicer(self) -> Splicer:
        return Splicer(self)


def _token_limits(document: dict[str, Any]) -> dict[str, int]:
    """The request's integer token limits, ``max_completion_tokens`` first."""
    limits = {}
    for key in ("max_completion_tokens", "max_tokens"):
        limit = document.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            limits[key] = limit
    return limits


class Splicer:
    """Rewrites a continuation's events into the original stream (see the module)."""

    def __init__(self, answer: AnswerSoFar) -> None:
        self.answer = answer
        self._events = EventSplitter()

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        for event in self._events.split(data):
            spliced = self._splice(event)
            if spliced is not None:
                out.append(spliced + b"\n\n")
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._events.pending = self._events.pending, b""
        return rest

    def _splice(self, event: bytes) -> bytes | None:
        payload = _data_of(event)
        if payload is None or payload.strip() == b"[DONE]":
            return event
        try:
            chunk = json.loads(payload)
        except ValueError:
            return event
        if not isinstance(chunk, dict):
            return event
        answer = self.answer
        chunk["id"], chunk["created"], chunk["model"] = answer.id, answer.created, answer.model
        choices = chunk.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                delta = choice.get("delta") if isinstance(choice, dict) else None
                if isinstance(delta, dict) and "role" in delta:
                    del delta["role"]
                    role_only = delta in ({}, {"content": ""})
                    if role_only and choice.get("finish_reason") is None:
                        return None  # the new stream's role-only chunk
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode()
